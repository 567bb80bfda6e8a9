"""Losing one member of a three-node NATS cluster under load: nothing is lost.

A coordinator (state bucket and report stream with three replicas) and a decode node on the tiny
Llama connect with every member's URL; the test (router and prefill's part, on a member that
survives) runs requests. The member each service is connected to is SIGKILLed while a request
streams tokens, another handoff waits for its KV and claims keep arriving. Then: both services
reconnect by themselves (health says connected), the streaming request ends with every token
(indexes contiguous, replays after the reconnect only repeat what arrived), the waiting handoff
completes, later claims are granted, and nothing leaks. Outcomes only, never durations (how fast
is bench/chaos_nats.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared import subjects
from shared.bus import BusTimeout
from shared.events import ClaimGranted, ClaimRejected, KvReady, RequestFinished, TokensGenerated
from tests.integration.test_coordinator_service import Stack, run_request

SERVICES = ("coordinator", "decode-d1")  # their bus client names
NUM_TOKENS = 120  # long enough to be mid-stream when the member dies


@dataclass
class Members:
    """What Stack connects to: ``url`` (comma-separated member URLs)."""

    url: str


async def collect_all(queue: asyncio.Queue, first=None, timeout_s: float = 60.0) -> tuple[list[int], object]:
    """Token ids and the terminal event, starting with ``first`` (a message already taken from
    the queue); a message may repeat tokens already here (a replay after a reconnect) but never
    skip one."""
    tokens: list[int] = []
    while True:
        if first is not None:
            ev, first = first, None
        else:
            ev = await asyncio.wait_for(queue.get(), timeout_s)
        if not isinstance(ev, TokensGenerated):
            return tokens, ev
        assert ev.index <= len(tokens) + 1, f"tokens {len(tokens) + 1}..{ev.index - 1} never arrived"
        tokens += ev.token_ids[len(tokens) + 1 - ev.index:]


async def claim_until_stopped(stack: Stack, prefix: str, stop: asyncio.Event) -> list:
    """Claims arriving all along (no waiting: answered at once); replies or BusTimeout."""
    results = []
    i = 0
    while not stop.is_set():
        try:
            results.append(await stack.claim(f"{prefix}-c{i}", wait_ms=0, timeout_s=10))
        except BusTimeout as exc:  # asked while the coordinator had no connection: nobody heard
            results.append(exc)
        i += 1
        await asyncio.sleep(0.05)
    return results


async def finish(stack: Stack, grant: ClaimGranted, max_tokens: int = 4) -> None:
    tokens, end = await collect_all(await run_request(stack, grant, prompt_len=8, max_tokens=max_tokens))
    assert isinstance(end, RequestFinished) and len(tokens) == max_tokens
    await stack.wait_state(grant.request_id, "completed", timeout_s=60)


async def kill_under_load(stack: Stack, cluster, doomed: int, round_id: str) -> None:
    streaming = await stack.claim(f"{round_id}-stream")
    waiting = await stack.claim(f"{round_id}-waiting")  # claimed: its KV comes after the kill
    assert isinstance(streaming, ClaimGranted) and isinstance(waiting, ClaimGranted)
    queue = await run_request(stack, streaming, prompt_len=8, max_tokens=NUM_TOKENS)
    first = await asyncio.wait_for(queue.get(), 30)
    assert isinstance(first, TokensGenerated) and first.index == 1
    stop = asyncio.Event()
    claims = asyncio.create_task(claim_until_stopped(stack, round_id, stop))
    await asyncio.sleep(0.2)  # a few claims in before the kill

    await asyncio.to_thread(cluster.kill, doomed)
    for proc in stack.procs:  # every service is connected again, by itself
        await proc.wait_healthy(60, until=lambda h: h["connected"])
    tokens, end = await collect_all(queue, first)
    assert isinstance(end, RequestFinished) and end.finish_reason == "length"
    assert len(tokens) == NUM_TOKENS
    await stack.wait_state(streaming.request_id, "completed", timeout_s=60)
    await stack.bus.publish(subjects.kv_ready(waiting.node_id), KvReady(
        request_id=waiting.request_id, lease_id=waiting.lease_id, generation=waiting.generation,
        node_id=waiting.node_id, slot=waiting.target.slot.slot, num_tokens=8,
        layout_version=waiting.target.layout.layout_version, nbytes=0))
    await finish(stack, waiting, max_tokens=6)
    stop.set()
    answered = [r for r in await claims if not isinstance(r, BusTimeout)]
    assert answered, "no claim was answered around the kill"
    for reply in answered:  # granted ones (a slot was free) run to the end
        assert isinstance(reply, (ClaimGranted, ClaimRejected)), reply
        if isinstance(reply, ClaimGranted):
            await finish(stack, reply)
    later = [await stack.claim(f"{round_id}-later{i}") for i in range(2)]
    assert all(isinstance(g, ClaimGranted) for g in later), later
    for grant in later:
        await finish(stack, grant)
    await asyncio.to_thread(cluster.restart, doomed)


async def test_killing_the_nats_member_services_use_loses_nothing(make_nats_cluster, tiny_model,
                                                                 tmp_path):
    cluster = make_nats_cluster(3)
    stack = Stack(Members(cluster.url), tiny_model("llama"), tmp_path)
    try:
        await stack.coordinator("--js-replicas", "3")
        # Heartbeats as in production (1 s): a node reconnecting is not taken for dead.
        node = await stack.decode("d1", 2, "--heartbeat-ms", "1000")
        used = {name: cluster.client_nodes(name) for name in SERVICES}
        assert all(len(members) == 1 for members in used.values()), used
        # The test's own client sits on a member no service uses, so it never loses a message.
        spare = min(set(range(3)) - {m[0] for m in used.values()})
        stack.nats = Members(cluster.urls[spare])
        await stack.open()
        js = stack.bus.nc.jetstream()
        for stream in (f"KV_{subjects.COORD_KV_BUCKET}", "XL_COORD_INBOX"):
            assert (await js.stream_info(stream)).config.num_replicas == 3, stream
        # One kill per member a service is on: each service loses its server once or more.
        for round_number, doomed in enumerate(sorted({m[0] for m in used.values()})):
            await kill_under_load(stack, cluster, doomed, f"k{round_number}")
        for name in SERVICES:
            assert cluster.client_nodes(name), f"{name} is not connected to any member"
        await stack.assert_no_leak([node])
    finally:
        await stack.close()
