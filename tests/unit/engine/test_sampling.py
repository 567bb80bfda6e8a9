"""The reference sampler, one parameter at a time on hand-checkable logits (vLLM's semantics and order),
the counter-based random numbers, and speculative acceptance (greedy exactness, distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from services.decode.engine.cuda import sampling_state as S
from services.decode.engine.sampling import ReferenceSampler, resolve, sample
from services.decode.engine.spec import verify
from shared.events import SamplingParams

NEG = float("-inf")


def sampler_for(req: S.RequestSampling, history: list[int], vocab: int, next_pos: int = 10):
    bufs = S.SamplingBuffers(2, vocab, "cpu")
    bufs.arm(1, req, history, next_pos)
    return ReferenceSampler(bufs), torch.tensor([1]), torch.tensor([next_pos])


def processed(req: S.RequestSampling, logits: list[float], history: list[int], next_pos: int = 10) -> list[float]:
    sampler, rows, pos = sampler_for(req, history, len(logits), next_pos)
    banned = [S.banned_ids(req.bad_words, history)]
    return sampler.processed(torch.tensor([logits]), rows, pos, req.flags, banned)[0].tolist()


def kept(req: S.RequestSampling, logits: list[float]) -> list[int]:
    sampler, rows, _ = sampler_for(req, [0], len(logits))
    x, _ = sampler.filtered(torch.tensor([logits]), rows, req.flags)
    return [i for i, v in enumerate(x[0].tolist()) if v > NEG]


LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def test_repetition_penalty_scales_exactly_the_prompt_and_output_tokens():
    # prompt [0], output [1, 4]: positive logits divided, negative ones multiplied; tokens 2, 3, 5 untouched
    req = S.RequestSampling(temperature=1.0, repetition_penalty=2.0, prompt_ids=[0])
    assert processed(req, LOGITS, history=[1, 4]) == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]


def test_frequency_and_presence_penalties_read_the_output_only():
    # output [2, 2, 5]: token 2 twice, token 5 once; the prompt (token 0) is not penalised
    req = S.RequestSampling(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25, prompt_ids=[0])
    assert processed(req, LOGITS, history=[2, 2, 5]) == [2.0, -1.0, 0.5 - 1.0 - 0.25, 3.0, -2.0, 1.0 - 0.5 - 0.25]


def test_repetition_then_frequency_then_presence():
    req = S.RequestSampling(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0,
                            prompt_ids=[3])
    out = processed(req, LOGITS, history=[0])
    assert out == [2.0 / 2 - 0.5 - 1.0, -1.0, 0.5, 1.5, -2.0, 1.0]


def test_logit_bias_and_allowed_token_ids():
    assert processed(S.RequestSampling(temperature=1.0, logit_bias={3: -10.0, 1: 1.5}), LOGITS, [0]) == \
        [2.0, 0.5, 0.5, -7.0, -2.0, 1.0]
    allowed = S.RequestSampling(temperature=1.0, allowed_token_ids=[1, 4], logit_bias={4: 1.0, 3: 5.0})
    assert processed(allowed, LOGITS, [0]) == [NEG, -1.0, NEG, NEG, -1.0, NEG]  # a bias cannot revive a disallowed id


def test_bad_words_ban_the_last_id_after_a_matching_prefix():
    words = [[5], [0, 4], [2, 3], [1, 2, 3, 1]]  # [1, 2, 3, 1] is longer than the output + 1: never applies
    req = S.RequestSampling(temperature=1.0, bad_words=words)
    assert processed(req, LOGITS, history=[0]) == [2.0, -1.0, 0.5, 3.0, NEG, NEG]
    assert processed(req, LOGITS, history=[0, 2]) == [2.0, -1.0, 0.5, NEG, -2.0, NEG]
    assert S.banned_ids([[1, 2, 3]], [9, 1, 2]) == [3] and S.banned_ids([[1, 2, 3]], [1, 2]) == [3]
    assert S.banned_ids([[1, 2, 3]], [2]) == []


def test_min_tokens_suppresses_stop_ids_until_the_position():
    # resolve: 3 tokens still to generate before stop ids (here 1 and the EOS id 4) may come
    sp = SamplingParams(max_tokens=10, temperature=1.0, min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    req = resolve(sp, vocab=6, eos_token_ids=(4,), seq_len=20)
    assert req.stop_ids == [1, 4] and req.min_pos == 24  # positions 21, 22, 23 suppressed
    for pos, suppressed in ((21, True), (23, True), (24, False)):
        out = processed(req, LOGITS, history=[0], next_pos=pos)
        assert (out[1], out[4]) == ((NEG, NEG) if suppressed else (-1.0, -2.0))
        assert out[0] == 2.0


def test_temperature_min_p_top_k_top_p():
    assert kept(S.RequestSampling(temperature=0.5), LOGITS) == [0, 1, 2, 3, 4, 5]
    sampler, rows, _ = sampler_for(S.RequestSampling(temperature=0.5), [0], 6)
    assert sampler.filtered(torch.tensor([LOGITS]), rows, 0)[0][0].tolist() == [v / 0.5 for v in LOGITS]
    # min_p: p >= min_p * p_max  <=>  x - max >= log(min_p)
    assert kept(S.RequestSampling(temperature=1.0, min_p=math.exp(-1.5)), LOGITS) == [0, 3]
    assert kept(S.RequestSampling(temperature=2.0, min_p=math.exp(-1.5)), LOGITS) == [0, 2, 3, 5]  # x / 2 >= 0
    # top_k keeps values >= the k-th largest: ties at it stay
    ties = [1.0, 3.0, 3.0, 2.0, 0.0]
    assert kept(S.RequestSampling(temperature=1.0, top_k=2), ties) == [1, 2]
    assert kept(S.RequestSampling(temperature=1.0, top_k=1), ties) == [1, 2]
    assert kept(S.RequestSampling(temperature=1.0, top_k=3), ties) == [1, 2, 3]
    assert kept(S.RequestSampling(temperature=1.0, top_k=9), ties) == [0, 1, 2, 3, 4]
    # top_p: p = [0.5, 0.3, 0.15, 0.05]; a token stays while the mass above it is below top_p
    probs = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert kept(S.RequestSampling(temperature=1.0, top_p=0.75), probs) == [0, 1]
    assert kept(S.RequestSampling(temperature=1.0, top_p=0.85), probs) == [0, 1, 2]
    assert kept(S.RequestSampling(temperature=1.0, top_p=0.1), probs) == [0]
    # order: min_p, then top_k, then top_p over what is left (renormalised)
    assert kept(S.RequestSampling(temperature=1.0, top_k=2, top_p=0.6), probs) == [0]  # 0.5 / 0.8 above token 1
    assert kept(S.RequestSampling(temperature=1.0, top_k=2, top_p=0.63), probs) == [0, 1]
    assert kept(S.RequestSampling(temperature=1.0, top_k=3, top_p=0.5), probs) == [0]  # 0.5 / 0.95 above token 1
    assert kept(S.RequestSampling(temperature=1.0, top_k=3, top_p=0.53), probs) == [0, 1]
    assert kept(S.RequestSampling(temperature=1.0, min_p=0.2, top_p=0.53), probs) == [0, 1]  # min_p drops 0.05 first


def test_greedy_takes_the_argmax_of_the_processed_logits():
    req = S.RequestSampling(temperature=0.0, repetition_penalty=4.0, prompt_ids=[3])
    sampler, rows, pos = sampler_for(req, [1], 6)
    assert sampler.tokens(torch.tensor([LOGITS]), rows, pos, req.flags)[0] == 0  # 3.0 / 4 < 2.0
    plain = S.RequestSampling(temperature=1e-6, top_k=1)
    assert plain.greedy and plain.flags == S.GREEDY and plain.plain_greedy  # vLLM: < 1e-5 is greedy, filters off


def test_seeded_draws_repeat_differ_by_seed_and_position_and_follow_the_distribution():
    v = 5
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05]))
    req = S.RequestSampling(temperature=1.0, seed=1234)
    sampler, rows, _ = sampler_for(req, [0], v)
    n = 20000
    positions = torch.arange(n) + 7
    draws = sampler.tokens(logits.expand(n, v).contiguous(), rows.expand(n), positions, req.flags)
    again = sampler.tokens(logits.expand(n, v).contiguous(), rows.expand(n), positions, req.flags)
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=v).float() / n
    assert (freq - logits.exp()).abs().max() < 0.015
    other, _, _ = sampler_for(S.RequestSampling(temperature=1.0, seed=99), [0], v)
    assert not torch.equal(draws[:64], other.tokens(logits.expand(64, v).contiguous(), rows.expand(64), positions[:64],
                                                    req.flags))
    # unseeded requests get a fresh random seed each
    seeds = {resolve(SamplingParams(max_tokens=1, temperature=1.0), vocab=v).seed for _ in range(4)}
    assert len(seeds) == 4


def test_philox_is_the_standard_philox4x32_10():
    # Random123's known-answer test for philox4x32-10: counter = key = 0 -> 0x6627e8d5 (first word)
    assert int(S.philox(torch.tensor(0), torch.tensor(0), torch.tensor(0), 0)) == 0x6627E8D5
    u = S.uniform(torch.tensor(5), torch.arange(4096), torch.tensor(3), 0)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


@pytest.mark.parametrize("params, words", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(logit_bias={99: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words_token_ids=[[]]), "bad_words"),
    (dict(repetition_penalty=1.2), "prompt_token_ids"), (dict(min_tokens=-1), "min_tokens"),
])
def test_resolve_rejects_what_vllm_rejects(params, words):
    with pytest.raises(ValueError, match=words):
        resolve(SamplingParams(max_tokens=4, **params), vocab=10)


def test_greedy_verify_accepts_exactly_the_matching_prefix():
    v, k = 6, 3
    target_tokens = torch.tensor([[4, 2, 5, 1], [4, 2, 5, 1], [4, 2, 5, 1]])
    target = torch.nn.functional.one_hot(target_tokens, v).float()
    drafts = torch.tensor([[4, 2, 5], [4, 3, 5], [4, 2, 5]])
    draft = torch.nn.functional.one_hot(drafts, v).float()
    num_valid = torch.tensor([3, 3, 1])
    greedy = torch.tensor([True, True, True])
    n, nxt = verify(target, draft, drafts, num_valid, torch.rand(3, k), torch.ones(3, v), greedy)
    assert n.tolist() == [3, 1, 1] and nxt.tolist() == [1, 2, 2]


def test_speculative_sampling_preserves_the_target_distribution():
    torch.manual_seed(0)
    v, trials = 5, 40000
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1])
    target = p.expand(trials, 2, v).contiguous()
    draft = q.expand(trials, 1, v).contiguous()
    greedy = torch.zeros(trials, dtype=torch.bool)
    drafts = sample(draft, torch.empty(trials, 1, v).exponential_(), greedy)
    n, nxt = verify(target, draft, drafts, torch.ones(trials, dtype=torch.long), torch.rand(trials, 1),
                    torch.empty(trials, v).exponential_(), greedy)
    first = torch.where(n == 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=v).float() / trials
    assert (freq - p).abs().max() < 0.015
    assert abs(float(n.float().mean()) - float(torch.minimum(p, q).sum())) < 0.015


ROW_SHAPES = [(1, 102400), (4, 32768), (2, 1000), (3, 97), (2, 129280)]  # two-stage where it splits, whole where not


@pytest.mark.parametrize("rows,v", ROW_SHAPES)
def test_row_reductions_equal_torchs_whole_row_ones(rows, v):
    """The sampler's two-stage reductions (the whole row in 256/128/64 chunks, then over the chunks) give
    torch's whole-row results: the same maximum and argmax (ties: the lowest index), sums and scans up to
    float32 summation order; -inf entries (removed tokens) stay out of every sum."""
    from services.decode.engine.sampling import row_argmax, row_cumsum, row_max, row_softmax, row_sum

    g = torch.Generator().manual_seed(rows * v)
    x = torch.randn(rows, v, generator=g) * 3
    x[:, ::7] = float("-inf")
    hot = [(r * 7919 + 3) % v for r in range(rows)]
    for r, col in enumerate(hot):
        x[r, col] = 50.0
        x[r, (col + v // 2) % v] = 50.0  # a tie later in the row: the lowest index wins
    want_hot = [min(c, (c + v // 2) % v) for c in hot]
    assert row_argmax(x).tolist() == want_hot == torch.argmax(x, dim=-1).tolist()
    assert torch.equal(row_max(x), x.max(dim=-1, keepdim=True).values)
    e = torch.exp(x - 50.0)
    assert torch.allclose(row_sum(e), e.sum(dim=-1, keepdim=True), rtol=1e-5)
    assert torch.equal(row_sum(x > 0), (x > 0).sum(dim=-1, keepdim=True))
    assert torch.allclose(row_softmax(x), x.softmax(dim=-1), rtol=1e-5, atol=1e-7)
    assert torch.allclose(row_cumsum(e), e.cumsum(dim=-1), rtol=1e-5, atol=1e-6)
