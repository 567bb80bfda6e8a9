"""Full handoff without vLLM: the KV that HF transformers computes for a prompt, written in the
engine's layout into the leased slot over real Mooncake (TCP), then KV-ready and start over NATS;
the decode node's streamed tokens must equal the engine's own greedy tokens for that prompt.
The same over NIXL (UCX on loopback).
Real nats-server, real coordinator and decode processes (see test_coordinator_service)."""

from __future__ import annotations

import asyncio
import re
import uuid

import httpx

import pytest
import torch

from services.decode.engine import Engine
from shared import subjects
from shared.events import (
    ClaimGranted, DecodeStart, KvReady, RequestFailed, RequestFinished, SamplingParams, StructuredOutput,
    TokenMessage, TokensGenerated,
)
from shared.kvchecksum import CHECKSUM_ALGO, checksums, host_reader
from shared.kvlayout import write_ranges
from shared.transport import create_transport
from tests.integration.test_coordinator_service import (  # noqa: F401
    HEARTBEAT_MS, Stack, collect, run_request, stack,
)

PROMPT = [5, 17, 42, 9, 101, 77, 3, 250, 64, 12, 8, 199]
NUM_TOKENS = 24


def hf_prefill(model_dir, prompt: list[int]):
    """HF transformers' first greedy token and per-layer (K, V) [T, Hkv, D] after RoPE."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    kv = [(layer.keys[0].permute(1, 0, 2).contiguous(), layer.values[0].permute(1, 0, 2).contiguous())
          for layer in cache.layers]
    return int(out.logits[0, -1].argmax()), kv


def pack(layout, kv, num_tokens: int) -> torch.Tensor:
    """The slot image in the engine layout: for each layer K then V, [max_tokens, Hkv, D]."""
    buf = torch.zeros(layout.slot_nbytes, dtype=torch.uint8)
    for seg in layout.segments:
        k, v = kv[seg.layer]
        data = (k if seg.name == "k" else v).to(getattr(torch, layout.dtype)).reshape(-1).view(torch.uint8)
        assert data.numel() == num_tokens * seg.bytes_per_token
        buf[seg.offset_bytes: seg.offset_bytes + data.numel()] = data
    return buf


def engine_greedy(model_dir, prompt: list[int], num_tokens: int) -> tuple[int, list[int]]:
    """The engine's own greedy continuation of ``prompt`` (its prefill, not the handoff)."""
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=256)
    first = int(engine.prefill(0, prompt).argmax())
    engine.start(0, first, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    tokens: list[int] = []
    while True:
        out = engine.step()[0]
        tokens += out.token_ids
        if out.finish_reason:
            return first, tokens


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
async def test_full_handoff_streams_the_engines_greedy_tokens(stack, transport, monkeypatch):  # noqa: F811
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # nixl: loopback only (this process and the node)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    await stack.coordinator()
    node = await stack.decode("d1", 2, "--transport", transport)
    first, kv = await asyncio.to_thread(hf_prefill, stack.model_dir, PROMPT)
    ref_first, ref_tokens = await asyncio.to_thread(engine_greedy, stack.model_dir, PROMPT, NUM_TOKENS)
    assert first == ref_first  # HF and the engine agree on the prompt's next token

    grant = await stack.claim("r0")
    assert isinstance(grant, ClaimGranted) and grant.target.transport == transport
    assert bool(grant.target.nixl_metadata_b64) == (transport == "nixl")
    layout = grant.target.layout
    queue: asyncio.Queue = asyncio.Queue()

    async def on_token(ev, _msg):
        queue.put_nowait(ev)

    await stack.bus.subscribe(subjects.req_tokens("r0"), on_token, TokenMessage)
    # Start first, KV-ready after: the node must wait for both halves.
    await stack.bus.publish(subjects.decode_start("d1"), DecodeStart(
        request_id="r0", lease_id=grant.lease_id, generation=grant.generation,
        slot=grant.target.slot.slot, first_token_id=first, num_prompt_tokens=len(PROMPT),
        sampling=SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)))
    await asyncio.sleep(2 * HEARTBEAT_MS / 1000)
    assert queue.empty() and stack.states("r0") == ["claimed"]

    image = pack(layout, kv, len(PROMPT))
    sender = create_transport(transport, agent_name=f"test-sender-{uuid.uuid4().hex[:8]}")
    try:
        sender.register(image.data_ptr(), image.numel())
        base = grant.target.slot.base_addr
        ops = [(image.data_ptr() + off, base + off, n) for off, n in write_ranges(layout, len(PROMPT))]
        await asyncio.to_thread(sender.write, grant.target.endpoint, ops,
                                grant.target.nixl_metadata_b64)
    finally:
        sender.close()
    await stack.bus.publish(subjects.kv_ready("d1"), KvReady(
        request_id="r0", lease_id=grant.lease_id, generation=grant.generation, node_id="d1",
        slot=grant.target.slot.slot, num_tokens=len(PROMPT), layout_version=layout.layout_version,
        nbytes=sum(n for _, _, n in ops)))

    tokens, end = await collect(queue)
    assert tokens == ref_tokens
    assert isinstance(end, RequestFinished) and end.finish_reason == "length"
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (len(PROMPT), NUM_TOKENS + 1)
    await stack.wait_state("r0", "completed")
    assert stack.states("r0") == ["claimed", "kv_ready", "decoding", "completed"]
    # the node says which path decoded it: float32 on a CPU, no fast path: the fused CPU step (cpustep.py)
    metrics = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=5).text
    assert 'xl_decode_requests_total{path="cpu-fused"} 1.0' in metrics
    assert f'xl_decode_steps_total{{path="cpu-fused"}} {float(NUM_TOKENS)}' in metrics
    # the model and the imports frozen out of the collector's walks before the node took leases
    frozen = re.search(r"^xl_decode_gc_frozen_objects (\S+)$", metrics, re.M)
    assert frozen and float(frozen.group(1)) > 10_000, metrics
    assert "# TYPE xl_decode_gc_pause_seconds histogram" in metrics

    # Stale halves of the finished lease are ignored and counted, nothing is decoded.
    before = (await node.wait_healthy(5))["stale_ignored"]
    await stack.bus.publish(subjects.kv_ready("d1"), KvReady(
        request_id="r0", lease_id=grant.lease_id, generation=grant.generation, node_id="d1",
        slot=grant.target.slot.slot, num_tokens=len(PROMPT), layout_version=1, nbytes=0))
    await stack.bus.publish(subjects.decode_start("d1"), DecodeStart(
        request_id="r0", lease_id=grant.lease_id, generation=grant.generation,
        slot=grant.target.slot.slot, first_token_id=first, num_prompt_tokens=len(PROMPT),
        sampling=SamplingParams(max_tokens=4)))
    await node.wait_healthy(5, until=lambda h: h["stale_ignored"] == before + 2)
    await asyncio.sleep(0.2)
    assert queue.empty()
    await stack.assert_no_leak([node])


async def write_kv(stack, grant: ClaimGranted, prompt: list[int], kv, with_checksums: bool = False,
                   flip_segment: int | None = None) -> asyncio.Queue:  # noqa: F811
    """Be the prefill sender for one granted request: its KV over Mooncake, then KV-ready; with
    checksums, the segment sums of the staged image, and ``flip_segment``: one byte of that
    segment flipped after summing (what the decode node receives is not what was summed)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_token(ev, _msg):
        queue.put_nowait(ev)

    await stack.bus.subscribe(subjects.req_tokens(grant.request_id), on_token, TokenMessage)
    layout = grant.target.layout
    image = pack(layout, kv, len(prompt))
    ranges = write_ranges(layout, len(prompt))
    sums = checksums(host_reader(image.numpy()), ranges) if with_checksums else []
    if flip_segment is not None:
        image[ranges[flip_segment][0] + ranges[flip_segment][1] - 1] ^= 0x01  # its last written byte
    sender = create_transport("mooncake")
    try:
        sender.register(image.data_ptr(), image.numel())
        ops = [(image.data_ptr() + off, grant.target.slot.base_addr + off, n) for off, n in ranges]
        await asyncio.to_thread(sender.write, grant.target.endpoint, ops)
    finally:
        sender.close()
    await stack.bus.publish(subjects.kv_ready(grant.node_id), KvReady(
        request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
        node_id=grant.node_id, slot=grant.target.slot.slot, num_tokens=len(prompt),
        layout_version=layout.layout_version, nbytes=sum(n for _, _, n in ops),
        kv_checksums=sums, kv_checksum_algo=CHECKSUM_ALGO if sums else ""))
    return queue


async def test_concurrent_handoffs_each_stream_their_own_greedy_tokens(stack):  # noqa: F811
    """Two requests decoded together in one node's batch: each gets exactly its own tokens."""
    num_tokens = 96
    await stack.coordinator()
    node = await stack.decode("d1", 2)
    prompts = [PROMPT, [300, 2, 45, 61, 7, 7, 19]]
    refs = [await asyncio.to_thread(engine_greedy, stack.model_dir, p, num_tokens) for p in prompts]
    hfs = [await asyncio.to_thread(hf_prefill, stack.model_dir, p) for p in prompts]
    assert refs[0][1] != refs[1][1]  # different prompts, different continuations
    grants = [await stack.claim(f"r{i}") for i in range(2)]
    assert sorted(g.target.slot.slot for g in grants) == [0, 1]
    queues = [await write_kv(stack, g, p, kv) for g, p, (_, kv) in zip(grants, prompts, hfs)]
    for g, p, (first, _) in zip(grants, prompts, hfs):  # start both back to back
        await stack.bus.publish(subjects.decode_start(g.node_id), DecodeStart(
            request_id=g.request_id, lease_id=g.lease_id, generation=g.generation,
            slot=g.target.slot.slot, first_token_id=first, num_prompt_tokens=len(p),
            sampling=SamplingParams(max_tokens=num_tokens, ignore_eos=True)))
    results = await asyncio.gather(*(collect(q) for q in queues))
    for (tokens, end), (ref_first, ref_tokens), (first, _) in zip(results, refs, hfs):
        assert first == ref_first
        assert tokens == ref_tokens
        assert isinstance(end, RequestFinished) and end.finish_reason == "length"
    # They shared engine steps: fewer steps than tokens (one step per token each if they had not).
    metrics = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=5).text
    num_steps = _metric(metrics, "xl_decode_step_seconds_count")
    num_tokens_out = _metric(metrics, 'xl_decode_events_total{event="tokens_generated"}')
    assert num_tokens_out == 2 * num_tokens and num_steps < 1.5 * num_tokens
    await stack.assert_no_leak([node])


async def test_kv_checksum_mismatch_fails_the_lease_frees_the_slot_and_spares_the_good_one(stack):  # noqa: F811
    """Two handoffs with segment checksums: the one whose bytes match decodes to the end, the one
    with a byte flipped after summing ends failed with reason checksum, before injection (its
    start is stale), its slot free again; a node that requires checksums fails a KV-ready without
    them."""
    await stack.coordinator()
    node = await stack.decode("d1", 2, "--require-kv-checksum")
    first, kv = await asyncio.to_thread(hf_prefill, stack.model_dir, PROMPT)
    good, bad = [await stack.claim(rid) for rid in ("good", "bad")]
    queues = [await write_kv(stack, good, PROMPT, kv, with_checksums=True),
              await write_kv(stack, bad, PROMPT, kv, with_checksums=True, flip_segment=3)]
    await stack.wait_state("bad", "failed")
    for g in (good, bad):
        await stack.bus.publish(subjects.decode_start(g.node_id), DecodeStart(
            request_id=g.request_id, lease_id=g.lease_id, generation=g.generation,
            slot=g.target.slot.slot, first_token_id=first, num_prompt_tokens=len(PROMPT),
            sampling=SamplingParams(max_tokens=8, ignore_eos=True)))
    tokens, end = await collect(queues[0])
    assert isinstance(end, RequestFinished) and end.finish_reason == "length" and len(tokens) == 8
    await stack.wait_state("good", "completed")
    failed = [e for e in stack.events if e.request_id == "bad" and e.state == "failed"]
    assert [e.reason for e in failed] == ["checksum"]
    assert stack.states("bad") == ["claimed", "kv_ready", "failed"]
    await node.wait_healthy(5, until=lambda h: h["stale_ignored"] == 1)  # the bad one's start
    assert queues[1].empty()  # nothing decoded from the corrupted KV

    missing = await stack.claim("missing")
    await write_kv(stack, missing, PROMPT, kv)
    await stack.wait_state("missing", "failed")
    assert [e.reason for e in stack.events if e.request_id == "missing"][-1] == "checksum_missing"
    metrics = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=5).text
    assert _metric(metrics, 'xl_decode_events_total{event="kv_rejected.checksum"}') == 1
    assert _metric(metrics, 'xl_decode_events_total{event="kv_rejected.checksum_missing"}') == 1
    assert _metric(metrics, "xl_decode_kv_verify_seconds_count") == 2
    await stack.assert_no_leak([node])


def engine_under_grammar(model_dir, prompt: list[int], sampling: SamplingParams):
    """The engine's own first token (sampled under the grammar, as the prefill does), tokens and logprobs."""
    import xgrammar as xgr

    engine = Engine.load(model_dir, num_slots=1, max_seq_len=256)
    matcher = xgr.GrammarMatcher(engine.grammars.compile(sampling.structured))
    mask = xgr.allocate_token_bitmask(1, engine.cfg.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    logits = engine.prefill(0, prompt)[None].clone()
    xgr.apply_token_bitmask_inplace(logits, mask)
    first = int(logits.argmax())
    engine.start(0, first, sampling)
    tokens, lps = [], []
    while engine.active_slots():
        out = engine.step()[0]
        tokens, lps = tokens + out.token_ids, lps + out.logprobs
    return first, tokens, lps, out.finish_reason


async def test_logprobs_and_grammars_through_the_node(stack):  # noqa: F811
    """A choice-constrained request with logprobs streams the engine's own tokens, each with its
    logprobs, and ends with "stop" once the grammar is complete; a grammar that does not compile
    fails its request for good (retryable False) with the reason, and the slot frees."""
    await stack.coordinator()
    node = await stack.decode("d1", 2)
    _, kv = await asyncio.to_thread(hf_prefill, stack.model_dir, PROMPT)
    sampling = SamplingParams(max_tokens=20, logprobs=3,
                              structured=StructuredOutput(kind="choice", choices=["yes", "no", "maybe not"]))
    first, ref_tokens, ref_lps, ref_reason = await asyncio.to_thread(
        engine_under_grammar, stack.model_dir, PROMPT, sampling)
    good, bad = [await stack.claim(rid) for rid in ("good", "bad")]
    queues = [await write_kv(stack, g, PROMPT, kv) for g in (good, bad)]
    bad_sampling = SamplingParams(max_tokens=4, structured=StructuredOutput(kind="json", json_schema='{"type": '))
    for g, sp in ((good, sampling), (bad, bad_sampling)):
        await stack.bus.publish(subjects.decode_start(g.node_id), DecodeStart(
            request_id=g.request_id, lease_id=g.lease_id, generation=g.generation, slot=g.target.slot.slot,
            first_token_id=first, num_prompt_tokens=len(PROMPT), sampling=sp))
    events = []
    while not events or isinstance(events[-1], TokensGenerated):
        events.append(await asyncio.wait_for(queues[0].get(), 30))
    tokens = [t for ev in events[:-1] for t in ev.token_ids]
    lps = [lp for ev in events[:-1] for lp in ev.logprobs]
    assert all(len(ev.logprobs) == len(ev.token_ids) for ev in events[:-1])
    assert tokens == ref_tokens and ref_reason == "stop", events[-1]
    assert isinstance(events[-1], RequestFinished) and events[-1].finish_reason == "stop"
    assert [(a.rank, a.top_ids) for a in lps] == [(b.rank, b.top_ids) for b in ref_lps]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, ref_lps)) < 1e-5
    failed = await asyncio.wait_for(queues[1].get(), 30)
    assert isinstance(failed, RequestFailed) and not failed.retryable
    assert failed.reason.startswith("invalid_grammar: json_schema is not valid JSON")
    await stack.wait_state("bad", "failed")
    await stack.wait_state("good", "completed")
    await stack.assert_no_leak([node])


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _labelled(text: str, name: str) -> float:
    """The one sample of ``name`` with labels (the node's model)."""
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    return value


async def test_mla_node_with_mtp_reports_speculation_stats(make_nats_server, tiny_model, tmp_path):
    """A DeepSeek-V3-family node (MLA layout, MTP drafts): leased, decoded, stats in the end event.
    (The KV bytes are whatever the slot holds: this checks the service path, not the numbers.)"""
    stack = await Stack(make_nats_server(), tiny_model("deepseek_v3", "bfloat16"), tmp_path).open()
    try:
        await stack.coordinator()
        # every step drafts: on a CPU engine adaptive drafting would not draft at all (no draft pays there)
        node = await stack.decode("ds", 1, "--num-speculative-tokens", "1", "--no-adaptive-speculation")
        grant = await stack.claim("r0")
        assert isinstance(grant, ClaimGranted) and grant.target.layout.kind == "mla"
        tokens, end = await collect(await run_request(stack, grant, prompt_len=8, max_tokens=12))
        assert isinstance(end, RequestFinished) and len(tokens) == 12
        # one draft per step (K=1), none on the first step:
        # an injected slot has no hidden state yet
        assert end.spec.num_steps > 1
        assert end.spec.num_draft_tokens == end.spec.num_steps - 1
        assert 0 <= end.spec.num_accepted_tokens <= end.spec.num_draft_tokens
        assert end.spec.num_steps + end.spec.num_accepted_tokens == 12  # each step: 1 + accepted
        metrics = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=5).text  # vLLM's spec-decode totals
        assert _labelled(metrics, "xl_decode_spec_decode_num_draft_tokens_total") == end.spec.num_draft_tokens
        assert _labelled(metrics, "xl_decode_spec_decode_num_accepted_tokens_total") == end.spec.num_accepted_tokens
        assert 1 <= _labelled(metrics, "xl_decode_spec_decode_num_drafts_total") <= end.spec.num_draft_tokens
        await stack.assert_no_leak([node])
    finally:
        await stack.close()
