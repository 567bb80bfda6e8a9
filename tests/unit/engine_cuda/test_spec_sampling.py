"""Speculative sampling in the DeepSeek-family fast path's draft + verify step (MlaDecoder.spec_step(k,
sample=True)), on CPU.

The step's model parts (the MTP draft head, the verify forward) are replaced here by fixed logits, and
its random-number kernel by its torch twin (the kernel's numbers are checked against it), so that
thousands of seeded steps run in seconds: the first token a step emits must follow the target's
processed distribution (temperature, top_k) whatever the drafts' distribution, drafts must be accepted
sometimes and rejected sometimes, and the same seed gives the same tokens. The kernels themselves are
covered through the Engine API in test_engine_fast_path_mla_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda.mla_decoder import MlaDecoder
from services.decode.engine.cuda.sampling_state import SamplingBuffers
from services.decode.engine.sampling import resolve
from shared.events import SamplingParams
from tests.unit.engine_cuda.test_steps import ROPE, VOCAB, _mla_caches, _tables, tiny_mla  # noqa: F401 (fixture)

K = 2
CTX = 5


@pytest.fixture
def torch_uniforms(monkeypatch):
    """The step's random numbers from sampling_state.uniform (the kernel's numbers, covered below) instead
    of the interpreted kernel: thousands of steps in seconds."""
    from services.decode.engine.cuda import mla_decoder
    from services.decode.engine.cuda.sampling_state import uniform

    def uniform_rows(seed, pos, pos_add, stream, out):
        rows, n = out.shape
        group = torch.arange(rows) // (rows // seed.numel())  # each seed's rows (one slot's, or a batch's slots')
        at = pos.to(torch.int64)[group] + pos_add + torch.arange(rows) % (rows // seed.numel())
        return out.copy_(uniform(seed[group][:, None], torch.arange(n)[None], at[:, None], stream))

    monkeypatch.setattr(mla_decoder, "uniform_rows", uniform_rows)


def _decoder(model, draft_vocab=None):
    cos, sin = _tables(16, ROPE)
    dec = MlaDecoder(model, _mla_caches(16), cos, sin, max_draft=K, max_steps=8, num_splits=4,
                     draft_vocab=draft_vocab)
    bufs = SamplingBuffers(1, VOCAB, "cpu")
    dec.attach_sampler(bufs.row(0))
    return dec, bufs


def _fixed_parts(dec, target: torch.Tensor, draft: torch.Tensor):
    """The verify forward writes ``target`` [K+1, V] (its hidden untouched), each MTP draft ``draft`` [V];
    the MTP pass over the verified rows (cache rows only) does nothing."""
    def forward(t, parts=True):
        dec.logits[t].copy_(target[:t])

    def mtp_draft(j, pick=True):
        dec.mtp_logits.copy_(draft[None, : dec.mtp_logits.shape[1]])

    dec.forward, dec.mtp_draft, dec._mtp_over_verified = forward, mtp_draft, lambda k, cand: None


def _step(dec, bufs, sp: SamplingParams) -> list[int]:
    bufs.arm(0, resolve(sp, vocab=VOCAB, seq_len=CTX), [3], CTX + 1)
    dec.set_state(3, CTX)
    dec.spec_step(K, sample=True)
    return dec.out_tokens[: int(dec.out_idx)].tolist()


def _kept(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    x = logits / temperature
    x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    return x.softmax(-1)


def _reference_first_tokens(target, draft, seeds: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The first token of a k-draft step, as the reference step draws it (engine.py's ``_draft`` and
    ``_step``: draft j from q at position CTX + 1 + j on STREAM_DRAFT, acceptance uniforms on STREAM_ACCEPT,
    the redraw's noise at CTX + 1), for every seed at once."""
    from services.decode.engine.cuda.sampling_state import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, uniform
    from services.decode.engine.spec import verify

    n, s = len(seeds), seeds[:, None]
    p = torch.stack([_kept(t, temperature, top_k) for t in target])[None].expand(n, -1, -1)
    q = _kept(draft, temperature, top_k)[None, None].expand(n, K, -1)
    idx = torch.arange(VOCAB)[None]
    e = torch.stack([-torch.log(uniform(s, idx, torch.full((n, 1), CTX + 1 + j), STREAM_DRAFT)) for j in range(K)], 1)
    drafts = (q / e).argmax(-1)
    u = uniform(s, torch.zeros(n, K, dtype=torch.int64), CTX + 1 + torch.arange(K)[None], STREAM_ACCEPT)
    noise = -torch.log(uniform(s, idx, torch.full((n, 1), CTX + 1), STREAM_SAMPLE))
    accepted, nxt = verify(p, q, drafts, torch.full((n,), K), u, noise, torch.zeros(n, dtype=torch.bool))
    return torch.where(accepted > 0, drafts[:, 0], nxt)


def test_speculative_sampling_keeps_the_target_distribution_whatever_the_drafts(tiny_mla, torch_uniforms):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(K + 1, VOCAB, generator=g) * 2
    # drafts over the target's kept ids, their preferences reversed: accepted sometimes, rejected often
    top = target[0].topk(8).indices
    draft = torch.full((VOCAB,), -30.0)
    draft[top] = target[0][top.flip(0)]
    dec, bufs = _decoder(tiny_mla)
    _fixed_parts(dec, target, draft)
    n, first, accepted = 1000, [], 0
    for seed in range(n):
        out = _step(dec, bufs, SamplingParams(temperature=0.8, top_k=8, seed=seed, max_tokens=8))
        first.append(out[0])
        accepted += len(out) - 1
    # the reference step's positions, streams and acceptance rule, seed by seed
    assert first == _reference_first_tokens(target, draft, torch.arange(n), 0.8, 8).tolist()
    want = _kept(target[0], 0.8, 8)
    tv = 0.5 * (torch.bincount(torch.tensor(first), minlength=VOCAB) / n - want).abs().sum().item()
    assert tv < 0.08, tv  # 0.067 for these seeds; ~0.002 over 200K seeds
    drafts_only = _kept(draft, 0.8, 8)  # what keeping every draft would give: far from the target
    assert 0.5 * (drafts_only - want).abs().sum().item() > 0.3
    assert 0 < accepted < K * n  # both acceptance and rejection ran
    assert all(want[t] > 0 for t in first)  # nothing top_k removed


def test_a_seed_gives_the_same_tokens_and_greedy_keeps_the_processed_argmax(tiny_mla, torch_uniforms):
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(K + 1, VOCAB, generator=g), torch.randn(VOCAB, generator=g)
    dec, bufs = _decoder(tiny_mla)
    _fixed_parts(dec, target, draft)
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
    assert _step(dec, bufs, sp) == _step(dec, bufs, sp)
    outs = {tuple(_step(dec, bufs, SamplingParams(temperature=1.0, seed=s, max_tokens=8))) for s in range(20)}
    assert len(outs) > 1
    bias = {int(target[0].argmin()): 100.0}  # a logits processor: greedy rows sample their processed argmax
    out = _step(dec, bufs, SamplingParams(temperature=0.0, logit_bias=bias, max_tokens=8))
    assert out[0] == int(target[0].argmin()) and len(out) >= 1


def test_drafts_outside_the_draft_vocabulary_are_not_verified(tiny_mla, torch_uniforms):
    """allowed_token_ids all past a reduced draft vocabulary: the draft distribution is empty, no draft is
    accepted, and the token comes from the target's allowed ids."""
    g = torch.Generator().manual_seed(2)
    target, draft = torch.randn(K + 1, VOCAB, generator=g), torch.randn(VOCAB, generator=g)
    dec, bufs = _decoder(tiny_mla, draft_vocab=VOCAB // 2)
    _fixed_parts(dec, target, draft)
    allowed = list(range(VOCAB // 2, VOCAB))
    for seed in range(20):
        out = _step(dec, bufs, SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=allowed, max_tokens=8))
        assert len(out) == 1 and out[0] in allowed
        assert int(dec.accepted) == 0


def test_the_uniform_kernel_draws_the_reference_generators_numbers():
    from services.decode.engine.cuda.mla_decoder import uniform_rows
    from services.decode.engine.cuda.sampling_state import seed_i64, uniform

    for seed, pos, add, stream, rows, n in ((7, 5, 1, 2, 1, 40), (seed_i64(2**64 - 3), 70_000, 1, 1, 3, 1),
                                           (seed_i64(12345678901234), 3, 2, 0, 2, 1500)):
        s, p = torch.tensor([seed]), torch.tensor([pos], dtype=torch.int32)
        got = uniform_rows(s, p, add, stream, torch.empty(rows, n))
        idx, at = torch.arange(n)[None], pos + add + torch.arange(rows)[:, None]
        assert torch.equal(got, uniform(s[:, None], idx, at, stream))
    # a batch's slots, each its own seed and position, two rows each (a batched step's acceptance uniforms)
    s, p = torch.tensor([7, seed_i64(2**64 - 3), 11]), torch.tensor([5, 70_000, 0], dtype=torch.int32)
    got = uniform_rows(s, p, 1, 1, torch.empty(6, 3))
    for slot in range(3):
        at = p[slot].long() + 1 + torch.arange(2)[:, None]
        assert torch.equal(got[2 * slot:2 * slot + 2], uniform(s[slot:slot + 1, None], torch.arange(3)[None], at, 1))
    with pytest.raises(ValueError, match="groups"):
        uniform_rows(s, p, 1, 1, torch.empty(4, 3))
