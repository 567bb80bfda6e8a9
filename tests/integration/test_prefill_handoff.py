"""The connector's behaviour inside a real vLLM (CPU): unmarked requests untouched, two requests in
flight, a receiver that has gone away, no free staging slot, and MultiConnector with NixlConnector.
Every test ends with every staging slot free."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid

import httpx
import pytest

from shared import subjects
from shared.events import KvFailed, KvMessage, KvReady
from shared.handoff import parse_status
from infra.processes import group_cpu_s
from infra.receiver import ReceiverProcess
from tests.fixtures.prefill import STAGING_SLOTS, TRANSFER_TIMEOUT_S, Express
from tests.fixtures.vllm import Plain
from tests.integration.test_prefill_kv import (
    KvEvents, decode_layout, handoff_params, hf_gqa_kv, received_segments, wait_all_free,
)

pytestmark = pytest.mark.vllm
# Not the native-pool (MultiConnector) server: it holds a core from its start (vLLM's NixlConnector
# polls), so its test starts it on demand and stops it after.
VLLM_SERVERS = [Express("llama"), Plain("llama"), Express("llama", chunk_tokens=64)]

PROMPT_A = [0] + [(13 * i + 3) % 700 + 5 for i in range(90)]
PROMPT_B = [0] + [(29 * i + 11) % 700 + 5 for i in range(140)]


@pytest.fixture
async def bus(nats_url):
    from shared.bus import Bus

    b = await Bus.connect(nats_url, name="test-prefill-handoff")
    yield b
    await b.close()


@pytest.fixture
async def llama(express_vllm):
    prefill = express_vllm("llama", "float32")
    yield prefill
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"] == STAGING_SLOTS, stats  # leak check


async def test_unmarked_requests_are_untouched(llama, vllm_servers, bus):
    seen: list = []

    async def on_event(event, msg):
        seen.append(event)

    sub = await bus.subscribe(subjects.KV_READY_ALL, on_event, KvMessage)
    before = llama.stats()
    async with httpx.AsyncClient() as client:
        express = await llama.complete(client, PROMPT_A, max_tokens=8)
        native = await llama.complete(client, PROMPT_A, max_tokens=8,
                                      kv_transfer_params={"do_remote_decode": False})
        plain_server = vllm_servers.get(llama.model_dir, dtype="float32")
        body = {"model": plain_server.model_name, "prompt": PROMPT_A, "max_tokens": 8, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True}
        plain = (await client.post(f"{plain_server.url}/v1/completions", json=body, timeout=120)).json()
    await asyncio.sleep(1.0)
    await sub.unsubscribe()
    want = plain["choices"][0]["token_ids"]
    assert express["choices"][0]["token_ids"] == want and native["choices"][0]["token_ids"] == want
    assert parse_status(express.get("kv_transfer_params")) is None
    assert seen == []
    after = llama.stats()
    for counter in ("claimed", "not_handed_off", "kv_ready", "kv_failed"):
        assert after[counter] == before[counter], counter


async def test_two_claimed_requests_in_flight_land_in_two_receivers(llama, bus, tmp_path):
    layout = decode_layout(llama.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    receivers = [ReceiverProcess("mooncake", layout.slot_nbytes) for _ in range(2)]
    try:
        (ha, pa), (hb, pb) = (handoff_params(rx, layout, node_id) for rx in receivers)
        async with httpx.AsyncClient() as client:
            ra, rb = await asyncio.gather(llama.complete(client, PROMPT_A, kv_transfer_params=pa),
                                          llama.complete(client, PROMPT_B, kv_transfer_params=pb))
        assert parse_status(ra["kv_transfer_params"]).handed_off
        assert parse_status(rb["kv_transfer_params"]).handed_off
        got = {}
        for _ in range(2):
            event, _ = await events.next()
            assert isinstance(event, KvReady), event
            got[event.request_id] = event
        assert set(got) == {ha.request_id, hb.request_id}
        for rx, prompt, name in ((receivers[0], PROMPT_A, "a"), (receivers[1], PROMPT_B, "b")):
            segs = received_segments(rx.read(str(tmp_path / name)), layout, len(prompt))
            for g, w in zip(segs, hf_gqa_kv(llama.model_dir, prompt)):
                assert (g - w.reshape(g.shape)).abs().max().item() < 1e-4
    finally:
        for rx in receivers:
            rx.close()
        await events.sub.unsubscribe()


async def test_receiver_gone_gives_kv_failed_and_frees_the_slot(llama, bus):
    layout = decode_layout(llama.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    h, params = handoff_params(rx, layout, node_id)
    rx.kill()
    rx.close()
    try:
        before = llama.stats()
        async with httpx.AsyncClient() as client:
            resp = await llama.complete(client, PROMPT_A, kv_transfer_params=params)
            assert parse_status(resp["kv_transfer_params"]).handed_off is True  # staged; then failed
            event, _ = await events.next(timeout_s=TRANSFER_TIMEOUT_S + 10)
            assert isinstance(event, KvFailed) and event.request_id == h.request_id, event
            assert "transfer failed" in event.reason
            again = await llama.complete(client, PROMPT_A)  # vLLM still serves
        assert again["choices"][0]["token_ids"] == resp["choices"][0]["token_ids"]
        assert llama.stats()["kv_failed"] == before["kv_failed"] + 1
    finally:
        await events.sub.unsubscribe()


async def test_no_free_staging_slot_is_reported_not_blocked(llama, bus):
    """Both slots held by writes into stopped receivers: the next claim is not handed off, at once;
    when the stopped receivers die, their writes fail and every staging slot comes back."""
    layout = decode_layout(llama.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    receivers = [ReceiverProcess("mooncake", layout.slot_nbytes) for _ in range(STAGING_SLOTS + 1)]
    stopped: list[ReceiverProcess] = []
    try:
        async with httpx.AsyncClient() as client:
            for rx in receivers[:STAGING_SLOTS]:  # connect once while alive, then stop them
                await llama.complete(client, PROMPT_A, kv_transfer_params=handoff_params(rx, layout, node_id)[1])
                assert isinstance((await events.next())[0], KvReady)
                os.kill(rx.proc.pid, signal.SIGSTOP)
                stopped.append(rx)
            held = [handoff_params(rx, layout, node_id) for rx in stopped]
            for _, params in held:
                await llama.complete(client, PROMPT_B, kv_transfer_params=params)
            # the response can come before the sender takes its slot from reserved to sending (extraction
            # and the write run beside the step): wait for both writes to be in flight, which they stay
            # until the stopped receivers time out
            loop = asyncio.get_running_loop()
            deadline = loop.time() + TRANSFER_TIMEOUT_S
            while llama.stats()["sending"] != STAGING_SLOTS and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert llama.stats()["sending"] == STAGING_SLOTS, llama.stats()
            h, params = handoff_params(receivers[-1], layout, node_id)
            # Not blocked behind the writes: had the response waited for one of them to end,
            # its staging slot would have been free again.
            resp = await llama.complete(client, PROMPT_A, kv_transfer_params=params)
            status = parse_status(resp["kv_transfer_params"])
            assert status.handed_off is False and status.reason == "no free staging slot"
            for rx in stopped:  # the held writes end now, not at their deadline
                rx.kill()
            failed = {}
            for _ in range(STAGING_SLOTS + 1):
                event, _ = await events.next(timeout_s=TRANSFER_TIMEOUT_S + 10)
                assert isinstance(event, KvFailed), event
                failed[event.request_id] = event.reason
            assert failed[h.request_id] == "no free staging slot"
            assert all(rid in failed for rid in (x.request_id for x, _ in held))
    finally:
        for rx in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rx.proc.pid, signal.SIGCONT)
        for rx in receivers:
            rx.close()
        await events.sub.unsubscribe()


async def test_idle_connector_vllm_keeps_no_thread_busy(llama, bus):
    """After hand-offs, including to receivers that died and stalled, a connector-loaded vLLM that
    serves nothing uses next to no CPU: no transfer-engine thread polls or retries in a loop (one
    that did would hold a whole core, on any machine)."""
    async with httpx.AsyncClient() as client:
        await llama.complete(client, PROMPT_A)
    window_s = 5.0
    before = group_cpu_s(llama.server.pid)
    await asyncio.sleep(window_s)
    used = group_cpu_s(llama.server.pid) - before
    assert used < 0.3 * window_s, f"idle vLLM used {used / window_s:.0%} of a core"  # measured ~1%


async def test_multiconnector_with_nixl_serves_both_kinds(express_vllm, vllm_servers, bus, tmp_path):
    """``--native-pool``: MultiConnector(NixlConnector, ExpressConnector) starts; a native-pool
    request (vLLM's P/D protocol) and an express request both succeed on the same vLLM."""
    prefill = express_vllm("llama", "float32", native_pool=True)
    assert prefill.kv_transfer_config["kv_connector"] == "MultiConnector"
    layout = decode_layout(prefill.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    # The express hand-off goes over Mooncake here: NIXL as the express transport is covered by
    # test_prefill_kv; what this test shows is vLLM's own NixlConnector next to ours.
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    try:
        h, params = handoff_params(rx, layout, node_id)
        native_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                         "remote_block_ids": None, "remote_host": None, "remote_port": None}
        async with httpx.AsyncClient() as client:
            express = await prefill.complete(client, PROMPT_B, kv_transfer_params=params)
            native = await prefill.complete(client, PROMPT_B, kv_transfer_params=native_params)
            plain = await prefill.complete(client, PROMPT_B)
        assert parse_status(express["kv_transfer_params"]).handed_off is True
        event, _ = await events.next()
        assert isinstance(event, KvReady) and event.request_id == h.request_id, event
        segs = received_segments(rx.read(str(tmp_path / "slot")), layout, len(PROMPT_B))
        want = hf_gqa_kv(prefill.model_dir, PROMPT_B)
        assert len(segs) == len(want)
        for g, w in zip(segs, want):
            assert (g - w.reshape(g.shape)).abs().max().item() < 1e-4
        native_out = native.get("kv_transfer_params") or {}
        assert native_out.get("remote_block_ids") and parse_status(native_out) is None  # NIXL's reply
        first = plain["choices"][0]["token_ids"]
        assert express["choices"][0]["token_ids"] == first == native["choices"][0]["token_ids"]
        stats = await wait_all_free(prefill)
        assert stats["free"] == stats["total"], stats
    finally:
        rx.close()
        await events.sub.unsubscribe()
        # vLLM's own NixlConnector keeps NIXL's progress thread polling (a whole core, idle or
        # not): no later test may share the machine with it.
        vllm_servers.stop(prefill.server)


async def test_chunked_prefill_hands_off_the_whole_prompt(express_vllm, bus, tmp_path):
    """vLLM computes the prompt in chunks over several steps: the hand-off waits for the last chunk
    and carries the KV of every chunk."""
    prefill = express_vllm("llama", "float32", chunk_tokens=64)
    layout = decode_layout(prefill.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    try:
        h, params = handoff_params(rx, layout, node_id)
        async with httpx.AsyncClient() as client:
            resp = await prefill.complete(client, PROMPT_B, kv_transfer_params=params)  # 141 tokens: 3 chunks
        assert parse_status(resp["kv_transfer_params"]).handed_off is True
        event, _ = await events.next()
        assert isinstance(event, KvReady) and event.num_tokens == len(PROMPT_B), event
        segs = received_segments(rx.read(str(tmp_path / "slot")), layout, len(PROMPT_B))
        for g, w in zip(segs, hf_gqa_kv(prefill.model_dir, PROMPT_B)):
            assert (g - w.reshape(g.shape)).abs().max().item() < 1e-4
    finally:
        rx.close()
        await events.sub.unsubscribe()
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats


async def test_handoff_spans_join_the_request_trace(llama, bus, otlp_receiver):
    """extract and transfer are spans of the router's trace (parent: the traceparent that came in
    kv_transfer_params), and KV-ready carries the transfer span as its parent."""
    layout = decode_layout(llama.model_dir, "float32", with_mtp=False)
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    try:
        _, params = handoff_params(rx, layout, node_id, traceparent=f"00-{trace_id}-{parent_id}-01")
        async with httpx.AsyncClient() as client:
            await llama.complete(client, PROMPT_A, kv_transfer_params=params)
        event, headers = await events.next()
        assert isinstance(event, KvReady)
        names = {"prefill.extract", "prefill.kv_transfer"}
        spans = await asyncio.to_thread(otlp_receiver.wait_for, lambda spans: names <= {
            s.name for s in spans if s.trace_id == trace_id}, 20)
        mine = {s.name: s for s in spans if s.trace_id == trace_id}
        assert all(mine[n].parent_span_id == parent_id and mine[n].service_name == "prefill" for n in names)
        assert headers["traceparent"].split("-")[2] == mine["prefill.kv_transfer"].span_id
    finally:
        rx.close()
        await events.sub.unsubscribe()
