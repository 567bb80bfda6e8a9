"""The router's configuration: one object, parsed once from flags and ``EXPRESSLANE_*`` variables.

Every flag ``--foo-bar`` also reads ``EXPRESSLANE_FOO_BAR`` (shared.config). ``from_args`` checks
the values and raises ValueError naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.router.policy import PolicyConfig, parse_lane_table
from shared import config as shared_config
from shared.bus_auth import BusAuth


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = ("http://127.0.0.1:8100",)
    standard_url: str = ""  # an OpenAI endpoint for the standard lane; "" -> see below
    native_decode_urls: tuple[str, ...] = ()  # vLLM decode pool (NixlConnector): proxy protocol
    nats_url: str = "nats://127.0.0.1:4222"
    bus_auth: BusAuth = field(default_factory=BusAuth)  # NATS credential and TLS files
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty: no auth
    metrics_require_api_key: bool = False  # /metrics answers only with one of api_keys
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> tokenizer path override
    claim_wait_ms: int = 2000
    claim_margin_s: float = 2.0
    prefill_timeout_s: float = 300.0
    first_decode_timeout_s: float = 30.0
    token_timeout_s: float = 10.0
    standard_timeout_s: float = 600.0
    max_migrations: int = 2
    migrate_to: str = "express"  # "express": another node first, then standard; "standard"
    migrate_wait_ms: int = 500
    warm_leases: int = 1  # granted claims held ready per model (services.router.warm); 0: off
    # The prefill streams the first token over the bus and starts the decode itself
    # (shared.handoff.Handoff.start); off: the first token from vLLM's stream, DecodeStart from here.
    prefill_starts_decode: bool = True
    # vLLM's serving code for tools, structured output, logprobs and reasoning
    # (services.router.vllm_surface): the prefill vLLM's own parser flags
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    enable_auto_tool_choice: bool = False
    tool_strict_level: str = "auto"
    vllm_surface: str = "auto"  # auto: when vLLM is installed; on: required; off: never
    # the prefill vLLM's --default-chat-template-kwargs and structured outputs' enable_in_reasoning (from
    # --vllm-args): what its engine's reasoning gate reads (services.router.vllm_surface.reasoning_gate)
    default_chat_template_kwargs: dict = field(default_factory=dict)
    structured_in_reasoning: bool = False


def _pairs(text: str, what: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"--{what}: bad entry {item!r}, expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="expresslane router",
        description="OpenAI-compatible router: the express lane (our decode nodes) and the standard "
        "lane (vLLM) behind one endpoint.",
    )
    shared_config.add_common_args(p)
    d = RouterConfig()
    p.add_argument("--prefill-url", default=",".join(d.prefill_urls),
                   help="vLLM prefill server(s) with the express connector, comma separated")
    p.add_argument("--standard-url", default="",
                   help="OpenAI endpoint that serves the standard lane (e.g. a P/D proxy); default: "
                   "the native decode pool below, else the prefill vLLM generates")
    p.add_argument("--native-decode-url", default="",
                   help="vLLM decode servers of the native pool (NixlConnector), comma separated: "
                   "the router runs vLLM's prefill->decode proxy protocol with them")
    p.add_argument("--host", default=d.host, help="listen address")
    p.add_argument("--port", type=int, default=d.port, help="listen port")
    p.add_argument("--api-keys", default="", help="KEY=TENANT,... ; empty: no authentication")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="/metrics also needs 'Authorization: Bearer KEY' with one of --api-keys")
    p.add_argument("--default-lane", default="express", choices=["express", "standard"])
    p.add_argument("--tenant-lanes", default="", help="TENANT=express|standard,...")
    p.add_argument("--model-lanes", default="", help="MODEL=express|standard,...")
    p.add_argument("--header-override", default="on", choices=["on", "off"],
                   help="honour the x-expresslane: on|off request header")
    p.add_argument("--capability-gate", default="standard", choices=["standard", "reject"],
                   help="a parameter the express lane cannot honour: standard lane, or 400")
    p.add_argument("--tokenizers", default="", help="MODEL=PATH,... tokenizer overrides")
    p.add_argument("--warm-leases", type=int, default=d.warm_leases, metavar="N",
                   help="granted claims kept ready per model, so an express request skips the claim's "
                        "round trip; one is held only while it leaves a free slot unheld (0: off)")
    p.add_argument("--tool-call-parser", default="", metavar="NAME",
                   help="the tool-call parser the prefill vLLM runs (vLLM's --tool-call-parser: "
                        "hermes, llama3_json, qwen3_xml, deepseek_v3, ...): the router parses the "
                        "express lane's tool calls with vLLM's own parser of that name")
    p.add_argument("--reasoning-parser", default="", metavar="NAME",
                   help="the reasoning parser the prefill vLLM runs (vLLM's --reasoning-parser: "
                        "deepseek_r1, qwen3, ...): the express lane's reasoning_content is split "
                        "with vLLM's own parser of that name")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="as vLLM's flag: tool_choice=auto is parsed (needs --tool-call-parser)")
    p.add_argument("--tool-strict-level", default="auto", choices=["auto", "function", "parameter"],
                   help="as vLLM's flag: which tool calls its parser constrains with a structural tag "
                        "(such requests keep the standard lane)")
    p.add_argument("--vllm-args", default="", metavar="'VLLM ARGS'",
                   help="the prefill vLLM's own arguments as one string (compose passes the same "
                        "EXPRESSLANE_VLLM_ARGS to both): its --tool-call-parser, --reasoning-parser "
                        "and --enable-auto-tool-choice configure the router too, and its "
                        "--default-chat-template-kwargs and --structured-outputs-config (enable_in_reasoning) "
                        "decide where a grammar starts after the reasoning, as in vLLM")
    p.add_argument("--vllm-surface", default=d.vllm_surface, choices=["auto", "on", "off"],
                   help="render tools, structured output, logprobs and reasoning of express "
                        "requests with vLLM's serving code, imported in the router: auto (when "
                        "vLLM is installed), on (required), off (such requests use the standard lane); "
                        "with auto or on, /health says ok once the import has ended (seconds)")
    p.add_argument("--claim-wait-ms", type=int, default=d.claim_wait_ms,
                   help="how long a claim may queue for a free decode slot")
    p.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s)
    p.add_argument("--first-decode-timeout-s", type=float, default=d.first_decode_timeout_s,
                   help="silence before the first decoded token that counts as a failed node")
    p.add_argument("--token-timeout-s", type=float, default=d.token_timeout_s,
                   help="silence between tokens that counts as a failed node")
    p.add_argument("--prefill-starts-decode", default="on", choices=["on", "off"],
                   help="on: the prefill's connector publishes the first token to the router and "
                        "starts the decode node the moment vLLM's scheduler has the token (no round "
                        "trip through vLLM's response and the router); off: the router takes the "
                        "first token from vLLM's stream and starts the decode itself")
    p.add_argument("--max-migrations", type=int, default=d.max_migrations)
    p.add_argument("--migrate-to", default=d.migrate_to, choices=["express", "standard"])
    return p


def from_args(args: argparse.Namespace) -> RouterConfig:
    """Build and check the config; ValueError names the bad flag."""
    policy = PolicyConfig(
        default_lane=args.default_lane,
        tenant_lanes=parse_lane_table(args.tenant_lanes),
        model_lanes=parse_lane_table(args.model_lanes),
        header_override=args.header_override == "on",
        capability_gate=args.capability_gate,
    ).validate()
    urls = tuple(u.strip().rstrip("/") for u in args.prefill_url.split(",") if u.strip())
    if not urls:
        raise ValueError("--prefill-url: at least one vLLM URL is needed")
    api_keys = _pairs(args.api_keys, "api-keys")
    if args.metrics_require_api_key and not api_keys:
        raise ValueError("--metrics-require-api-key needs --api-keys (the keys that may read "
                         "/metrics)")
    for name in ("claim_wait_ms", "max_migrations", "warm_leases"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.vllm_args:
        import shlex

        from infra.vllm_flags import value

        vllm = shlex.split(args.vllm_args)
        for flag in ("tool_call_parser", "reasoning_parser", "tool_strict_level"):
            theirs = value(vllm, "--" + flag.replace("_", "-"))
            mine = getattr(args, flag) if getattr(args, flag) != "auto" else ""
            if theirs and mine and mine != theirs:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)!r} differs from the "
                                 f"prefill's ({theirs!r} in --vllm-args): set it in one place")
            setattr(args, flag, mine or theirs or getattr(args, flag))
        args.enable_auto_tool_choice = args.enable_auto_tool_choice or "--enable-auto-tool-choice" in vllm
        chat_defaults, in_reasoning = vllm_structured_flags(vllm)
    else:
        chat_defaults, in_reasoning = {}, False
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (as in vLLM)")
    if args.vllm_surface == "off" and (args.tool_call_parser or args.reasoning_parser):
        raise ValueError("--tool-call-parser/--reasoning-parser need --vllm-surface auto or on")
    from services.router import vllm_surface

    vllm_surface.check_parsers(args.tool_call_parser, args.reasoning_parser)
    if args.vllm_surface == "on" and not vllm_surface.available():
        raise ValueError("--vllm-surface on: vLLM is not installed in this environment")
    return RouterConfig(
        prefill_urls=urls,
        standard_url=args.standard_url.rstrip("/"),
        native_decode_urls=tuple(u.strip().rstrip("/") for u in args.native_decode_url.split(",")
                                 if u.strip()),
        nats_url=args.nats_url,
        bus_auth=shared_config.bus_auth(args),
        host=args.host,
        port=args.port,
        api_keys=api_keys,
        metrics_require_api_key=args.metrics_require_api_key,
        policy=policy,
        tokenizers=_pairs(args.tokenizers, "tokenizers"),
        claim_wait_ms=args.claim_wait_ms,
        prefill_timeout_s=args.prefill_timeout_s,
        first_decode_timeout_s=args.first_decode_timeout_s,
        token_timeout_s=args.token_timeout_s,
        max_migrations=args.max_migrations,
        migrate_to=args.migrate_to,
        warm_leases=args.warm_leases,
        prefill_starts_decode=args.prefill_starts_decode == "on",
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_strict_level=args.tool_strict_level,
        vllm_surface=args.vllm_surface,
        default_chat_template_kwargs=chat_defaults,
        structured_in_reasoning=in_reasoning,
    )


def vllm_structured_flags(vllm: list[str]) -> tuple[dict, bool]:
    """(``--default-chat-template-kwargs``, structured outputs' ``enable_in_reasoning``) of the prefill's vLLM
    arguments, as JSON (the dotted ``--structured-outputs-config.enable_in_reasoning`` too)."""
    import json

    from infra.vllm_flags import value

    def parsed(flag: str) -> dict:
        text = value(vllm, flag)
        try:
            out = json.loads(text) if text else {}
        except ValueError:
            raise ValueError(f"{flag} in --vllm-args is not JSON: {text!r}") from None
        if not isinstance(out, dict):
            raise ValueError(f"{flag} in --vllm-args must be a JSON object, got {text!r}")
        return out

    dotted = value(vllm, "--structured-outputs-config.enable_in_reasoning").lower()
    in_reasoning = bool(parsed("--structured-outputs-config").get("enable_in_reasoning", False))
    return parsed("--default-chat-template-kwargs"), (dotted in ("true", "1")) if dotted else in_reasoning
