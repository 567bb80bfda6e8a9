"""The DeepSeek-family fast path through the Engine API, its Triton kernels interpreted on CPU.

A bfloat16 DeepSeek-V2-Lite-like tiny model (no q LoRA, one routing group; near-bigram, with an MTP
layer whose drafts follow it): greedy tokens through ``Engine(fast_path="on")`` equal
``Engine(fast_path="off")``'s without drafts and with k = 1..3 MTP drafts per step (one graph of
drafts + verify), also where max_tokens and max_seq_len cut a step; drafts are accepted and counted;
engines it cannot serve say why.
"""

from __future__ import annotations

import pytest

from services.decode.engine import Engine
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint

PROMPT = [0, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-engine-mla")
    save_checkpoint("deepseek_v3_lite", path)
    return path


def load(path, mode: str, k: int, max_seq_len: int = 40) -> Engine:
    return Engine.load(path, num_slots=2, max_seq_len=max_seq_len, dtype="bfloat16", fast_path=mode,
                       num_speculative_tokens=k)


def run(engine: Engine, prompt: list[int], sampling: SamplingParams, slot: int = 0):
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, reason, paths, per_step = [first], None, set(), []
    while engine.active_slots():
        out = engine.step()[slot]
        tokens, reason = tokens + out.token_ids, out.finish_reason
        paths.add(engine.last_step_path)
        per_step.append(len(out.token_ids))
    stats = engine.spec_stats(slot)
    engine.release(slot)
    return tokens, reason, paths, per_step, stats


@pytest.mark.parametrize("k", [0, 3])
def test_mla_fast_path_greedy_tokens_equal_the_reference_engine(checkpoint, k):
    greedy = SamplingParams(max_tokens=9, ignore_eos=True)
    fast = load(checkpoint, "on", k)
    assert fast.fast_path_reason is None
    got, reason, paths, per_step, stats = run(fast, PROMPT, greedy)
    want, want_reason, ref_paths, _, _ = run(load(checkpoint, "off", k), PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == want_reason == "length" and len(got) == 10
    assert max(per_step) <= k + 1
    if k:
        assert stats.num_draft_tokens == k * stats.num_steps
        assert stats.num_accepted_tokens == len(got) - 1 - stats.num_steps > 0  # drafts were kept
    else:
        assert stats.num_draft_tokens == 0 and len(per_step) == 9


def test_mla_fast_path_cuts_a_speculative_step_at_max_tokens_and_max_seq_len(checkpoint):
    for max_tokens, max_seq_len in ((5, 40), (30, len(PROMPT) + 6)):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = run(load(checkpoint, "on", 3, max_seq_len), PROMPT, sampling)
        want = run(load(checkpoint, "off", 3, max_seq_len), PROMPT, sampling)
        assert got[0] == want[0] and got[1] == want[1] == "length"
        assert len(got[0]) - 1 == min(max_tokens, max_seq_len - len(PROMPT) - 1)


def test_mla_fast_path_refusals_say_why(checkpoint, tmp_path):
    save_checkpoint("deepseek_v3", tmp_path)  # q LoRA and group-limited routing
    engine = Engine.load(tmp_path, num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path="auto")
    assert engine.fast_path is None and "q LoRA" in engine.fast_path_reason
    with pytest.raises(ValueError, match="q LoRA"):
        Engine.load(tmp_path, num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path="on")
    fast = load(checkpoint, "on", 1)
    fast.prefill(0, PROMPT)
    fast.start(0, 5, SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    assert "sampling" in fast.slot_fast_path_reason(0)


def test_mla_fast_path_with_a_reduced_draft_vocabulary_keeps_the_output(checkpoint):
    greedy = SamplingParams(max_tokens=7, ignore_eos=True)
    fast = Engine.load(checkpoint, num_slots=1, max_seq_len=40, dtype="bfloat16", fast_path="on",
                       num_speculative_tokens=2, mtp_draft_vocab=128)
    assert fast.fast_path.decoders[0][0].draft_head.shape[0] == 128
    got = run(fast, PROMPT, greedy)
    want = run(load(checkpoint, "off", 2), PROMPT, greedy)
    assert got[0] == want[0] and got[2] == {"fast"}
    one = run(fast, PROMPT, SamplingParams(max_tokens=7, ignore_eos=True, num_speculative_tokens=1))
    assert one[0] == want[0] and max(one[3]) <= 2 and one[4].num_draft_tokens == one[4].num_steps
    for bad in (0, 257):
        with pytest.raises(ValueError, match="mtp_draft_vocab must be 1..256"):
            Engine.load(checkpoint, num_slots=1, max_seq_len=40, dtype="bfloat16", num_speculative_tokens=2,
                        mtp_draft_vocab=bad)
