"""Sampled requests on the DeepSeek-family fast path, its Triton kernels interpreted on CPU.

A bfloat16 DeepSeek-V2-Lite-like tiny model (the shapes of test_engine_fast_path_mla.SMALL): seeded
sampled requests (a few parameter mixes, penalties and bad words included) decode on
``Engine(fast_path="on")``'s fast path (the sampling kernels of cuda/sampling.py after the MTP decoder's
lm_head) with the tokens of ``Engine(fast_path="off")``'s reference step for the same seed; unseeded
requests differ; plain greedy requests keep the argmax graph. On an engine with MTP drafts a sampled
request with drafts decodes on the fast path by speculative sampling (a slot's sampled draft + verify
graph; its distribution is covered in test_spec_sampling.py), and one with ``num_speculative_tokens=0``
samples plain steps there.
"""

from __future__ import annotations

import pytest

from services.decode.engine import Engine, spec_policy
from services.decode.engine.cuda import sampling as K
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path_mla import SMALL

PROMPT = [0, 17, 42, 99, 3, 250, 7]

CASES = [
    SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=4,
                   ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.2, presence_penalty=1.5, frequency_penalty=0.5,
                   logit_bias={42: 3.0, 105: -5.0}, bad_words_token_ids=[[200], [42, 43]], seed=5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-engine-mla-sampling")
    save_checkpoint("deepseek_v3_lite", path, **SMALL)
    return path


def load(path, mode: str, k: int = 0) -> Engine:
    return Engine.load(path, num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path=mode, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def fast(checkpoint):
    return load(checkpoint, "on")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load(checkpoint, "off")


def run(engine: Engine, sampling: SamplingParams):
    first = int(engine.prefill(0, PROMPT).argmax())
    engine.start(0, first, sampling)
    reason = engine.slot_fast_path_reason(0)
    tokens, paths = [first], set()
    while engine.active_slots():
        out = engine.step()[0]
        tokens += out.token_ids
        paths.add(engine.last_step_path)
    engine.release(0)
    return tokens, paths, reason


@pytest.mark.parametrize("sampling", CASES, ids=["temperature", "top_k_top_p_min_p", "penalties_bias_bad_words"])
def test_seeded_sampled_requests_decode_on_the_mla_fast_path_with_the_reference_tokens(fast, reference, sampling):
    want, ref_paths, _ = run(reference, sampling)
    got, paths, reason = run(fast, sampling)
    assert ref_paths == {"reference"} and paths == {"fast"} and reason is None
    assert got == want and len(got) == 7


def test_greedy_keeps_the_argmax_graph_and_unseeded_requests_differ(fast, monkeypatch):
    calls = []
    finish = K.FastSampler.finish
    monkeypatch.setattr(K.FastSampler, "finish", lambda self, *a, **kw: (calls.append(1), finish(self, *a, **kw)))
    _, paths, reason = run(fast, SamplingParams(max_tokens=2, ignore_eos=True))
    assert paths == {"fast"} and reason is None and calls == []  # the decoder's own greedy pick
    unseeded = SamplingParams(max_tokens=6, temperature=1.5, ignore_eos=True)
    a, b = run(fast, unseeded), run(fast, unseeded)
    assert a[1] == b[1] == {"fast"} and len(calls) == 12 and a[0] != b[0]


def test_sampled_requests_with_mtp_drafts_decode_on_the_fast_path_by_speculative_sampling(checkpoint, reference,
                                                                                         monkeypatch):
    # the reference step's CPU engine priced a draft as the fast path does (spec_policy.CPU_COST_PER_DRAFT), so
    # that both draft at the same steps: a seeded sampled request's tokens depend on where its drafts were
    monkeypatch.setattr(spec_policy, "CPU_COST_PER_DRAFT", spec_policy.COST_PER_DRAFT)
    mtp, mtp_reference = load(checkpoint, "on", k=2), load(checkpoint, "off", k=2)
    # temperature 0 with logits processors: one-hot distributions, so speculative sampling keeps exactly the
    # processed argmax, the reference step's tokens
    biased = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={5: 0.5, 42: -1.0}, min_tokens=3,
                            ignore_eos=True)
    got, paths, reason = run(mtp, biased)
    assert paths == {"fast"} and reason is None
    assert got == run(mtp_reference, biased)[0]
    # sampled with drafts: the fast path's sampled draft + verify graph, the same tokens for the same seed;
    # it draws with the reference step's distributions, positions and random numbers over the same MTP rows,
    # so its tokens follow the reference's until bf16 rounding (Triton kernels against torch) flips a draw:
    # here the last, a redraw after a rejected draft
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, seed=7, ignore_eos=True)
    before = dict(mtp.spec_counters)
    a, b = run(mtp, seeded), run(mtp, seeded)
    assert a[1] == b[1] == {"fast"} and a[2] is None and a[0] == b[0] and len(a[0]) == 9
    assert a[0][:8] == run(mtp_reference, seeded)[0][:8]
    assert mtp.spec_counters["draft_tokens"] > before["draft_tokens"]
    assert mtp.spec_counters["accepted_tokens"] > before["accepted_tokens"]
    plain = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=7, ignore_eos=True, num_speculative_tokens=0)
    got, paths, reason = run(mtp, plain)
    assert paths == {"fast"} and reason is None
    assert got == run(reference, plain)[0]
    with_logprobs = SamplingParams(max_tokens=2, temperature=0.8, seed=1, logprobs=2)
    assert "logprobs" in run(mtp, with_logprobs)[2]
