"""``expresslane decode``: load the engine, register its slot buffers with the transport
(receiver.py), connect to NATS and run the node (server.py) until SIGTERM or SIGINT, then drain.
With ``--tensor-parallel-size N`` this process is rank 0 and starts ranks 1..N-1 (ranks.py), each
of which loads its shard, registers its own buffers and then follows rank 0's engine calls.
Flags and ``EXPRESSLANE_*`` variables: config.py (``expresslane decode --help``)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import replace

from services.decode import ranks
from services.decode.config import DecodeConfig, parse
from services.decode.receiver import Receiver
from services.decode.server import DecodeNode
from shared import cpu_priority
from shared.bus import Bus, BusUnavailable
from shared.gcheap import GcPauses, freeze_heap
from shared.log import get_logger, setup_logging
from shared.tracing import setup_tracing


def _load(config: DecodeConfig, group=None):
    """The engine (this rank's shard) and its registered receive buffers."""
    from services.decode.engine import Engine
    from shared.transport import create_transport

    engine_config, agent = config.engine, config.node_id
    tp = None
    if group is not None:
        engine_config = replace(engine_config, device=ranks.rank_device(engine_config.device, group.rank))
        tp, agent = group.tensor_parallel(), f"{config.node_id}-r{group.rank}" if group.rank else agent
    engine = Engine.load(config.model, engine_config, tp=tp) if tp is not None else Engine.load(config.model, engine_config)
    transport = create_transport(config.transport, host=config.transport_host,
                                 protocol=config.transport_protocol, agent_name=agent,
                                 device=str(engine.device))  # the slot buffers are the engine's cache
    buffers = [engine.slot_buffer(s) for s in range(config.num_slots)]
    return engine, Receiver(transport, buffers, config.num_checksum_threads)


def _load_ranks(config: DecodeConfig, group):
    """Every rank loads and registers; rank 0 also gets the other ranks' endpoints."""
    engine, receiver = _load(config, group)
    others = ranks.exchange_endpoints(group, ranks.endpoints_of(group.rank, receiver, engine.layout))
    return engine, receiver, others


async def _run(config: DecodeConfig, argv: list[str]) -> int:
    # fail fast, before loading
    bus = await Bus.connect(config.nats_url, name=f"decode-{config.node_id}", auth=config.bus_auth)
    followers = group = None
    others: list = []
    if config.tensor_parallel_size > 1:
        followers = ranks.Followers.launch(config.tensor_parallel_size, argv)
        group = await asyncio.to_thread(ranks.Group, 0, config.tensor_parallel_size, config.engine.device)
        engine, receiver, others = await asyncio.to_thread(_load_ranks, config, group)
        engine = ranks.MirroredEngine(engine, group)
    else:
        engine, receiver = await asyncio.to_thread(_load, config)
    try:
        node = DecodeNode(engine, receiver, bus, config, ranks=others)
        # the model and the imports live as long as the process: out of the collector's walks (shared.gcheap)
        await node.compile_ahead.warm_now()  # xgrammar and the vocabulary: ~40k objects, into the frozen heap
        node.log.info("gc_heap_frozen", **freeze_heap())
        GcPauses(node.status.registry, "xl_decode")  # the pauses while serving
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await node.start()
        watch = asyncio.create_task(_watch(followers, stop)) if followers is not None else None
        await stop.wait()
        died = followers.exited() if followers is not None else None
        if died is not None:  # a rank is gone: the model cannot step; fail fast, migrate everything
            await node.abort(f"tensor-parallel rank {died[0]} exited with status {died[1]}")
            await bus.close()
            os._exit(1)  # a step may be stuck in a collective with the dead rank: no orderly exit
        if watch is not None:
            watch.cancel()
        await node.drain()
        await bus.close()
        if followers is not None:
            engine.shutdown()
            await asyncio.to_thread(followers.stop)
    finally:
        receiver.close()
    return 0


async def _watch(followers, stop: asyncio.Event) -> None:
    """Wake the node's stop when a rank process exits."""
    while followers.exited() is None:
        await asyncio.sleep(0.2)
    stop.set()


def _follow(config: DecodeConfig, rank: int) -> int:
    """Ranks 1..N-1: load the shard, register buffers, hand rank 0 the endpoints, then follow."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 drives the shutdown; this rank dies with it
    group = ranks.Group(rank, config.tensor_parallel_size, ranks.rank_device(config.engine.device, rank))
    engine, receiver, _ = _load_ranks(config, group)
    freeze_heap()  # a follower's pause stalls every rank's step
    try:
        return ranks.follow(engine, group)
    finally:
        receiver.close()


def main(argv: list[str]) -> int:
    config = parse(argv)
    priority = cpu_priority.lower(config.cpu_nice)  # before any thread starts: they inherit it
    setup_logging("decode", config.log_level, json=config.log_format == "json")
    if config.cpu_nice:
        get_logger("decode").info("cpu_priority", node_id=config.node_id, rank=ranks.rank_from_env(), **priority)
    setup_tracing("decode")
    import torch

    # Before any thread runs a torch op: each thread takes the count when it first does, and the
    # step runs on the event loop's thread or a worker thread.
    torch.set_num_threads(config.torch_threads)
    rank = ranks.rank_from_env()
    if rank:
        return _follow(config, rank)
    try:
        return asyncio.run(_run(config, list(sys.argv[1:] if argv is None else argv)))
    except BusUnavailable as exc:
        print(f"expresslane decode: {exc}", file=sys.stderr)
        return 1
