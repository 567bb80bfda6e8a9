"""``expresslane decode``: load the engine, register its slot buffers with the transport
(receiver.py), connect to NATS and run the node (server.py) until SIGTERM or SIGINT, then drain.
Flags and ``EXPRESSLANE_*`` variables: config.py (``expresslane decode --help``)."""

from __future__ import annotations

import asyncio
import signal
import sys

from services.decode.config import DecodeConfig, parse
from services.decode.receiver import Receiver
from services.decode.server import DecodeNode
from shared.bus import Bus, BusUnavailable
from shared.log import setup_logging
from shared.tracing import setup_tracing


def _load(config: DecodeConfig):
    """The engine and its registered receive buffers."""
    from services.decode.engine import Engine
    from shared.transport import create_transport

    engine = Engine.load(config.model, config.engine)
    transport = create_transport(config.transport, host=config.transport_host,
                                 protocol=config.transport_protocol, agent_name=config.node_id,
                                 device=str(engine.device))  # the slot buffers are the engine's cache
    buffers = [engine.slot_buffer(s) for s in range(config.num_slots)]
    return engine, Receiver(transport, buffers, config.num_checksum_threads)


async def _run(config: DecodeConfig) -> int:
    # fail fast, before loading
    bus = await Bus.connect(config.nats_url, name=f"decode-{config.node_id}", auth=config.bus_auth)
    engine, receiver = await asyncio.to_thread(_load, config)
    try:
        node = DecodeNode(engine, receiver, bus, config)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await node.start()
        await stop.wait()
        await node.drain()
        await bus.close()
    finally:
        receiver.close()
    return 0


def main(argv: list[str]) -> int:
    config = parse(argv)
    setup_logging("decode", config.log_level, json=config.log_format == "json")
    setup_tracing("decode")
    import torch

    # Before any thread runs a torch op: each thread takes the count when it first does, and the
    # step runs on the event loop's thread or a worker thread.
    torch.set_num_threads(config.torch_threads)
    try:
        return asyncio.run(_run(config))
    except BusUnavailable as exc:
        print(f"expresslane decode: {exc}", file=sys.stderr)
        return 1
