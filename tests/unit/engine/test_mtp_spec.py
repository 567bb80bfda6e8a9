"""MTP speculative decoding: exact for greedy, consistent counters, slots and injection under speculation."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine, spec_policy
from shared.events import SamplingParams
from tests.unit.engine.test_engine_behaviour import PROMPTS, run

GREEDY = SamplingParams(max_tokens=128, ignore_eos=True)


def load(path, **kw) -> Engine:
    """A float32 CPU engine that drafts every step unless the test asks for adaptive drafting (which, at a CPU
    engine's price a draft, would not draft at all: spec_policy.can_pay)."""
    return Engine.load(path, dtype=torch.float32, **{"adaptive_speculation": False, **kw})


def run_counted(engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams):
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, per_step = [first], []
    while engine.active_slots():
        out = engine.step()[slot]
        per_step.append(len(out.token_ids))
        tokens += out.token_ids
    stats = engine.spec_stats(slot)
    engine.release(slot)
    return tokens, per_step, stats


@pytest.fixture(scope="module")
def plain(hf_checkpoint):
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512)
    return {i: run(engine, 0, p, GREEDY) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_greedy_equals_plain_greedy_over_128_tokens(hf_checkpoint, plain, k):
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=k)
    total_accepted = 0
    for i, prompt in enumerate(PROMPTS):
        tokens, per_step, stats = run_counted(engine, 0, prompt, GREEDY)
        assert tokens == plain[i]
        assert len(tokens) == 129
        assert stats.num_steps == len(per_step)
        assert stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_steps
        assert sum(per_step) == stats.num_steps + stats.num_accepted_tokens == 128
        assert all(1 <= n <= k + 1 for n in per_step)
        total_accepted += stats.num_accepted_tokens
    assert 0 < total_accepted
    assert engine.free_slots() == [0]


def test_speculative_sampling_is_seeded_and_top_k_1_is_greedy(hf_checkpoint, plain):
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=2)
    seeded = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.9, top_p=0.95, seed=5)
    a, _, sa = run_counted(engine, 0, PROMPTS[0], seeded)
    b, _, sb = run_counted(engine, 0, PROMPTS[0], seeded)
    assert a == b and sa == sb and len(a) == 61
    top1 = SamplingParams(max_tokens=128, ignore_eos=True, temperature=1.3, top_k=1, seed=1)
    assert run_counted(engine, 0, PROMPTS[0], top1)[0] == plain[0]


def test_two_slots_greedy_and_sampling_under_speculation(hf_checkpoint, plain):
    """A greedy slot batched with a sampling slot keeps its exact greedy tokens; the sampled one its seeded ones."""
    path, _ = hf_checkpoint("deepseek_v3")
    sampled = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.7, top_k=20, seed=11)
    alone = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=3)
    expected = run_counted(alone, 0, PROMPTS[1], sampled)[0]
    engine = load(path, num_slots=2, max_seq_len=512, num_speculative_tokens=3)
    got = {}
    for slot, prompt, params in ((0, PROMPTS[0], GREEDY), (1, PROMPTS[1], sampled)):
        first = int(engine.prefill(slot, prompt).argmax())
        engine.start(slot, first, params)
        got[slot] = [first]
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
    assert got[0] == plain[0]
    assert got[1] == expected and len(expected) == 51
    stats = engine.spec_stats(1)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    for slot in (0, 1):
        engine.release(slot)
    assert engine.free_slots() == [0, 1]


def test_speculation_per_request_off_and_two_slots(hf_checkpoint, plain):
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=2, max_seq_len=512, num_speculative_tokens=3)
    params = [GREEDY, SamplingParams(max_tokens=100, ignore_eos=True, num_speculative_tokens=0)]
    got = {}
    for slot in (0, 1):
        first = int(engine.prefill(slot, PROMPTS[slot]).argmax())
        engine.start(slot, first, params[slot])
        got[slot] = [first]
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
    assert got[0] == plain[0] and got[1] == plain[1][:101]
    off = engine.spec_stats(1)
    assert off.num_draft_tokens == 0 and off.num_accepted_tokens == 0 and off.num_steps == 100
    for slot in (0, 1):
        engine.release(slot)
    assert engine.free_slots() == [0, 1]


def test_injected_state_with_mtp_cache_continues_like_own_prefill(hf_checkpoint, plain):
    """The MTP layer's cache travels in the slot buffer like any layer: a copied buffer decodes the same."""
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=2, max_seq_len=512, num_speculative_tokens=2)
    prompt = PROMPTS[2]
    first = int(engine.prefill(0, prompt).argmax())
    # the writer holds the MTP entry of the last prompt position too (from the first token), as vLLM's
    engine.start(0, first, GREEDY)
    engine.slot_buffer(1).copy_(engine.slot_buffer(0))
    engine.release(0)
    engine.inject(1, len(prompt))
    engine.start(1, first, GREEDY)
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[1].token_ids
    assert tokens == plain[2]
    assert engine.spec_stats(1).num_accepted_tokens > 0
    engine.release(1)
    assert engine.free_slots() == [0, 1]


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_up_to_max_seq_len(hf_checkpoint, plain, k):
    """Drafts that would land past the cache at the end of the context never break or change the output."""
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=40, num_speculative_tokens=k)
    tokens, per_step, stats = run_counted(engine, 0, PROMPTS[0], GREEDY)
    assert len(PROMPTS[0]) + len(tokens) == 40
    assert tokens == plain[0][: len(tokens)]
    assert sum(per_step) == stats.num_steps + stats.num_accepted_tokens


def test_speculative_sampling_keeps_the_target_distribution(hf_checkpoint):
    """The first decoded token under MTP speculation (often an accepted draft, drawn from a flatter
    draft distribution) follows the target distribution: frequencies over seeded runs match it."""
    path, _ = hf_checkpoint("deepseek_v3")
    prompt, first = PROMPTS[2], 7
    params = dict(max_tokens=2, ignore_eos=True, temperature=1.0, top_k=4)
    plain = load(path, num_slots=1, max_seq_len=64)
    plain.prefill(0, prompt)
    plain.start(0, first, SamplingParams(**params, seed=0))
    plain.step()
    logits = plain.last_logits[0, 0]
    top = logits.topk(4)
    target = dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))
    engine = load(path, num_slots=4, max_seq_len=64, num_speculative_tokens=2)
    engine.model.mtp[0].head.mul_(0.2)  # flatter drafts: the draft distribution differs from the target's
    counts: dict[int, int] = {}
    trials, accepted = 1200, 0
    for seed in range(0, trials, 4):
        for slot in range(4):
            engine.prefill(slot, prompt)
            engine.start(slot, first, SamplingParams(**params, seed=seed + slot))
        for slot, out in engine.step().items():
            counts[out.token_ids[0]] = counts.get(out.token_ids[0], 0) + 1
            accepted += engine.spec_stats(slot).num_accepted_tokens
            engine.release(slot)
    assert set(counts) <= set(target)
    assert accepted > trials // 3  # drafts were accepted often, so the draft path is what is measured
    tv = 0.5 * sum(abs(counts.get(t, 0) / trials - p) for t, p in target.items())
    assert tv < 0.05, (counts, target)
    assert engine.free_slots() == [0, 1, 2, 3]


@pytest.mark.parametrize("adaptive", [True, False])
def test_drafts_that_are_never_accepted_stop_costing_steps(hf_checkpoint, plain, adaptive, monkeypatch):
    """An MTP head whose drafts miss: adaptive drafting (at the GPU fast path's price a draft, where drafts can pay)
    verifies them only in rare probes (the output is the same either way); the engine's totals count what was
    verified and accepted."""
    monkeypatch.setattr(spec_policy, "CPU_COST_PER_DRAFT", spec_policy.COST_PER_DRAFT)
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=3,
                         adaptive_speculation=adaptive)
    engine.model.mtp[0].head.zero_()  # every draft is token 0
    tokens, per_step, stats = run_counted(engine, 0, PROMPTS[0], GREEDY)
    assert tokens == plain[0]
    missed = tokens[1:].count(0) == 0
    if adaptive:
        assert stats.num_draft_tokens <= 3 * 12  # the first steps and two probes in 128 tokens
    else:
        assert stats.num_draft_tokens == 3 * stats.num_steps
    if missed:
        assert stats.num_accepted_tokens == 0
    c = engine.spec_counters
    assert c["draft_tokens"] == stats.num_draft_tokens and c["accepted_tokens"] == stats.num_accepted_tokens
    assert 0 < c["steps"] <= stats.num_steps and c["steps"] * 3 >= c["draft_tokens"]
    assert sum(c["accepted_per_pos"]) == stats.num_accepted_tokens


def test_adaptive_drafting_keeps_drafting_what_is_accepted(hf_checkpoint, plain, monkeypatch):
    """Where drafts pay (the GPU fast path's cost a draft, given to this CPU engine), adaptive drafting accepts
    about as many as drafting every step."""
    monkeypatch.setattr(spec_policy, "CPU_COST_PER_DRAFT", spec_policy.COST_PER_DRAFT)
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=2, adaptive_speculation=True)
    tokens, per_step, stats = run_counted(engine, 0, PROMPTS[1], GREEDY)
    assert tokens == plain[1]
    fixed = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=2)
    _, _, always = run_counted(fixed, 0, PROMPTS[1], GREEDY)
    assert stats.num_accepted_tokens >= 0.8 * always.num_accepted_tokens > 0


def test_on_a_cpu_engine_drafts_never_pay_and_adaptive_drafting_does_not_draft(hf_checkpoint, plain):
    """A CPU engine's step verifying k drafts costs about k + 1 plain steps (spec_policy.CPU_COST_PER_DRAFT): no
    draft count pays even were every draft accepted, so under adaptive drafting its requests decode plain steps from
    the first (no first drafts, no probes), though drafting every step would have had most drafts accepted."""
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=2, adaptive_speculation=True)
    tokens, per_step, stats = run_counted(engine, 0, PROMPTS[1], GREEDY)
    assert tokens == plain[1]
    fixed = load(path, num_slots=1, max_seq_len=512, num_speculative_tokens=2)
    _, _, always = run_counted(fixed, 0, PROMPTS[1], GREEDY)
    assert always.num_accepted_tokens > 0.5 * always.num_draft_tokens  # the drafts would be accepted
    assert stats.num_draft_tokens == 0 and per_step == [1] * 128  # plain steps only
    assert engine.spec_counters["steps"] == 0 and engine.spec_counters["draft_tokens"] == 0
    assert engine.slots[0].drafting is None


def test_a_greedy_request_batched_with_others_prices_its_drafts_by_the_batched_step(hf_checkpoint, plain,
                                                                                    monkeypatch):
    """A greedy request's steps beside other slots take the batched step's cost table (BATCH_COST_PER_DRAFT): set
    where no draft count pays, two greedy requests decoding together stop drafting after their first steps (probes
    only) with their tokens unchanged, where alone the same request keeps drafting (the test above); a sampled request
    beside them keeps its own table (its draws depend on where its drafts were) and keeps drafting."""
    monkeypatch.setattr(spec_policy, "CPU_COST_PER_DRAFT", spec_policy.COST_PER_DRAFT)
    monkeypatch.setattr(spec_policy, "BATCH_COST_PER_DRAFT", 1.0)  # k drafts never beat k + 1 steps' cost
    path, _ = hf_checkpoint("deepseek_v3")
    engine = load(path, num_slots=3, max_seq_len=512, num_speculative_tokens=2, adaptive_speculation=True)
    sampled = SamplingParams(max_tokens=128, temperature=0.5, seed=3, ignore_eos=True)
    tokens = {}
    for slot, (prompt, sp) in enumerate([(PROMPTS[1], GREEDY), (PROMPTS[0], GREEDY), (PROMPTS[1], sampled)]):
        tokens[slot] = [int(engine.prefill(slot, prompt).argmax())]
        engine.start(slot, tokens[slot][0], sp)
    while engine.active_slots():
        for slot, out in engine.step().items():
            tokens[slot] += out.token_ids
    assert tokens[0] == plain[1] and tokens[1] == plain[0]
    for slot in (0, 1):  # the first steps and a probe now and then: few drafts over ~128 steps
        stats = engine.spec_stats(slot)
        assert stats.num_steps > 100 and stats.num_draft_tokens <= 0.15 * stats.num_steps
    sampled_stats = engine.spec_stats(2)
    assert sampled_stats.num_accepted_tokens > 0.5 * sampled_stats.num_draft_tokens > 0.3 * sampled_stats.num_steps
