"""The ``expresslane`` command: one entry point, one module per subcommand, imported lazily.

Each subcommand module exposes ``main(argv: list[str]) -> int`` built on argparse, so
``expresslane SUBCOMMAND --help`` explains itself. Heavy imports (torch, vLLM) happen only in the
subcommand that needs them.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("infra.up", "start the whole stack on this machine (nats, coordinator, decode, prefill, router)"),
    "make-model": ("infra.tinymodel", "write a tiny HF checkpoint with seeded random weights and a tokenizer"),
    "nats": ("infra.nats", "run an embedded nats-server with JetStream"),
    "nats-secrets": ("infra.nats_secrets", "write a NATS TLS CA, server certificate and per-service passwords"),
    "events": ("infra.events", "watch the bus: one decoded event per line"),
    "router": ("services.router.app", "run the OpenAI-compatible router"),
    "coordinator": ("services.coordinator.service", "run the transfer coordinator"),
    "decode": ("services.decode.main", "run a decode node (engine + receive buffers)"),
    "prefill": ("services.prefill.launch", "run a stock vLLM prefill server with the express connector"),
    "convert-weights": ("services.decode.engine.convert", "convert an HF checkpoint to the engine's format"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: expresslane SUBCOMMAND [options]", "", "subcommands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "Run 'expresslane SUBCOMMAND --help' for the options of one subcommand."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"expresslane: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
