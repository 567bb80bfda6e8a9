"""The reference sampler: vLLM's sampling semantics in torch, without host syncs.

Per row, in vLLM's order (vllm/v1/sample/sampler.py and its logits processors):
  1. logits processors, which change greedy rows too: allowed_token_ids (others -inf), bad words
     (-inf; token-id sequences over the output), min_tokens (stop ids -inf while the output is
     shorter), logit_bias (added), then the penalties: repetition (tokens of prompt or output:
     x / r where x > 0, else x * r), frequency (x -= f * count in the output), presence (x -= p if
     in the output);
  2. greedy rows (temperature < 1e-5): the argmax of the processed logits (ties: lowest id);
  3. x = logits / temperature; min_p keeps x - max(x) >= log(min_p) (vLLM: p >= min_p * p_max);
     top_k keeps x >= the k-th largest (ties at it kept); top_p over what is left keeps a token when
     the probability mass strictly above it is below top_p (vLLM: ascending cumulative sum > 1 - p;
     tied tokens are kept or dropped together; the largest always stays);
  4. the token: argmax over kept tokens of x + Gumbel noise from the counter-based generator keyed
     by (seed, position of the sampled token) (cuda/sampling_state.py), i.e. vLLM's argmax(p / E).

The fast path's Triton kernels (cuda/sampling.py) compute the same quantities with the same
formulas and random numbers, so a seeded request gives the same tokens on both paths (up to float32
summation order in the top-p masses). Per-slot parameters live in ``SamplingBuffers`` on the device;
``resolve`` validates a request's SamplingParams and turns them into a ``RequestSampling``.

Speculative steps (spec.py) use ``probs`` (the processed distribution; one-hot for greedy rows) and
``sample`` (argmax(p / E)) on residual distributions.
"""

from __future__ import annotations

import math
import random

import torch

from .cuda.sampling_state import (BAD_WORDS, BIAS, F_FREQ, F_LOG_MIN_P, F_PRES, F_REP, F_TEMP, F_TOP_P, FREQ_PRES,
                                  GREEDY, I_FLAGS, I_MIN_POS, I_SEED, I_TOP_K, MIN_TOKENS, REP, SAMPLING_EPS,
                                  STREAM_SAMPLE, TOP_K, TOP_P, TRACK_COUNTS, RequestSampling, SamplingBuffers,
                                  banned_ids, gumbel, row_argmax, row_cumsum, row_max, row_softmax, row_sum)

__all__ = ["ReferenceSampler", "RequestSampling", "SamplingBuffers", "banned_ids", "resolve", "sample",
           "exponential", "row_argmax", "row_cumsum", "row_max", "row_softmax", "row_sum"]


def resolve(sp, *, vocab: int, eos_token_ids: tuple[int, ...] = (), seq_len: int = 0,
            prompt_ids: list[int] | None = None) -> RequestSampling:
    """A request's SamplingParams (shared.events), validated with vLLM's ranges, as a RequestSampling.

    ``seq_len``: tokens in the slot's cache (the first token, pending, is at that position);
    ``prompt_ids``: the prompt the engine prefilled itself, used when the params carry none.
    Raises ValueError naming the first parameter out of range.
    """
    def bad(msg: str):
        raise ValueError(f"invalid sampling parameters: {msg}")

    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        bad(f"temperature must be a finite number >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        bad(f"top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k < -1:
        bad(f"top_k must be 0 or -1 (off) or >= 1, got {sp.top_k}")
    if not 0 <= sp.min_p <= 1:
        bad(f"min_p must be in [0, 1], got {sp.min_p}")
    if not (math.isfinite(sp.repetition_penalty) and sp.repetition_penalty > 0):
        bad(f"repetition_penalty must be a finite number > 0, got {sp.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            bad(f"{name} must be in [-2, 2], got {getattr(sp, name)}")
    if sp.max_tokens < 0:
        bad(f"max_tokens must be >= 0, got {sp.max_tokens}")
    if sp.min_tokens < 0:
        bad(f"min_tokens must be >= 0, got {sp.min_tokens}")

    def check_ids(name: str, ids) -> None:
        for t in ids:
            if not 0 <= t < vocab:
                bad(f"{name}: token id {t} is outside the vocabulary (0..{vocab - 1})")

    check_ids("logit_bias", sp.logit_bias)
    for v in sp.logit_bias.values():
        if not math.isfinite(v):
            bad(f"logit_bias values must be finite, got {v}")
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            bad("allowed_token_ids is empty")
        check_ids("allowed_token_ids", sp.allowed_token_ids)
    for word in sp.bad_words_token_ids:
        if not word:
            bad("bad_words_token_ids holds an empty sequence")
        check_ids("bad_words_token_ids", word)
    check_ids("stop_token_ids", sp.stop_token_ids)
    prompt = sp.prompt_token_ids if sp.prompt_token_ids is not None else prompt_ids
    if sp.repetition_penalty != 1.0 and prompt is None:
        bad("repetition_penalty needs the prompt's token ids (prompt_token_ids) on a node that did not "
            "prefill the prompt")
    if prompt is not None:
        check_ids("prompt_token_ids", prompt)
    check_ids("output_token_ids", sp.output_token_ids)
    seed = random.getrandbits(64) if sp.seed is None else sp.seed & ((1 << 64) - 1)
    greedy = sp.temperature < SAMPLING_EPS
    return RequestSampling(
        temperature=sp.temperature, top_k=max(0, sp.top_k) if not greedy else 0,
        top_p=sp.top_p if not greedy else 1.0, min_p=sp.min_p if not greedy else 0.0,
        repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, logit_bias=dict(sp.logit_bias),
        allowed_token_ids=list(sp.allowed_token_ids) if sp.allowed_token_ids is not None else None,
        bad_words=[list(w) for w in dict.fromkeys(tuple(w) for w in sp.bad_words_token_ids)],
        # vLLM's min_tokens suppresses every stop id and the EOS ids, ignore_eos or not
        stop_ids=sorted(set(sp.stop_token_ids) | set(eos_token_ids)), seed=seed,
        prompt_ids=list(prompt) if prompt is not None else None,
        min_pos=seq_len + 1 + sp.min_tokens if sp.min_tokens else 0,
        first_out_pos=seq_len - len(sp.output_token_ids))


def exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """[N, vocab] Exp(1) noise of the counter-based generator: row i keyed by (seeds[i], positions[i])."""
    from .cuda.sampling_state import uniform

    idx = torch.arange(vocab, device=seeds.device)[None]
    return -torch.log(uniform(seeds[:, None], idx, positions[:, None], stream))


def sample(probs: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """probs [B, ..., V], exponential noise of the same shape, greedy [B] -> tokens [B, ...] (argmax(p / E))."""
    g = greedy.view(-1, *([1] * (probs.dim() - 2)))
    return torch.where(g, row_argmax(probs), row_argmax(probs / noise))


class ReferenceSampler:
    """vLLM's sampler over rows of logits whose requests sit in ``bufs`` rows (module docstring)."""

    def __init__(self, bufs: SamplingBuffers):
        self.bufs = bufs

    def processed(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, flags_any: int,
                  banned: list[list[int]] | None = None) -> torch.Tensor:
        """Step 1 on float32 logits [N, V]: ``rows`` [N] buffer rows (or ``slice(None)`` over buffers of
        one row, whose parameters broadcast over the N logits rows: views, no gathers), ``positions`` [N]
        of the sampled tokens, ``flags_any`` the OR of the rows' flags (skips what no row uses),
        ``banned`` the ids each row's bad words ban now (host side, ``banned_ids``)."""
        b = self.bufs
        if not flags_any & (BIAS | BAD_WORDS | MIN_TOKENS | REP | FREQ_PRES):
            return logits
        l = logits.clone()
        flags = b.iparams[rows, I_FLAGS]
        on = lambda f: (flags & f) != 0  # noqa: E731
        if flags_any & BIAS:
            l = torch.where(on(BIAS)[:, None], l + b.bias[rows], l)
        if flags_any & BAD_WORDS and banned:
            r = [i for i, ids in enumerate(banned) for _ in ids]
            if r:
                l[torch.tensor(r, device=l.device), torch.tensor([t for ids in banned for t in ids], device=l.device)] = float("-inf")
        if flags_any & MIN_TOKENS:
            active = on(MIN_TOKENS) & (positions < b.iparams[rows, I_MIN_POS])
            l = torch.where(active[:, None] & (b.stop_mask[rows] != 0), float("-inf"), l)
        if flags_any & TRACK_COUNTS:
            counts = b.counts[rows]
            if flags_any & REP:
                pen = b.fparams[rows, F_REP][:, None]
                hit = on(REP)[:, None] & ((b.prompt_mask[rows] != 0) | (counts > 0))
                l = torch.where(hit, torch.where(l > 0, l / pen, l * pen), l)
            if flags_any & FREQ_PRES:
                c = counts.to(torch.float32)
                fp = l - b.fparams[rows, F_FREQ][:, None] * c
                fp = fp - b.fparams[rows, F_PRES][:, None] * (counts > 0).to(torch.float32)
                l = torch.where(on(FREQ_PRES)[:, None], fp, l)
        return l

    def filtered(self, l: torch.Tensor, rows: torch.Tensor, flags_any: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3 without the draw: (x [N, V] = l / temperature with every removed token -inf, greedy [N])."""
        b = self.bufs
        flags = b.iparams[rows, I_FLAGS]
        greedy = (flags & GREEDY) != 0
        temp = torch.where(greedy, 1.0, b.fparams[rows, F_TEMP])
        x = l / temp[:, None]
        m = row_max(x)
        s0 = (x > float("-inf")) & ((x - m) >= b.fparams[rows, F_LOG_MIN_P][:, None])
        xs = x.masked_fill(~s0, float("-inf"))
        if not flags_any & (TOP_K | TOP_P):
            return xs, greedy
        vals, order = xs.sort(dim=-1, descending=True, stable=True)
        v = x.shape[-1]
        k_on = (flags & TOP_K) != 0
        k = b.iparams[rows, I_TOP_K].clamp(min=1, max=v)
        kth = vals.gather(-1, (k - 1)[:, None].expand(vals.shape[0], 1))  # rows may be one broadcast row
        keep = s0 & (~k_on[:, None] | (xs >= kth))
        p_on = (flags & TOP_P) != 0
        if flags_any & TOP_P:
            keep_sorted = keep.gather(-1, order)  # a prefix of the sorted order
            e = torch.where(keep_sorted, torch.exp(vals - m), 0.0)
            z = row_sum(e)
            excl = torch.cat([torch.zeros_like(e[:, :1]), row_cumsum(e)[:, :-1]], dim=-1)
            target = b.fparams[rows, F_TOP_P][:, None] * z
            last = row_sum((excl < target) & keep_sorted).clamp(min=1) - 1
            tau = vals.gather(-1, last)
            keep = keep & (~p_on[:, None] | (xs >= tau))
        return x.masked_fill(~keep, float("-inf")), greedy

    def draw(self, x: torch.Tensor, l: torch.Tensor, greedy: torch.Tensor, rows: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        """Step 2 / 4: greedy rows argmax(l), the others argmax(x + Gumbel(seed, position, id))."""
        seeds = self.bufs.iparams[rows, I_SEED]
        idx = torch.arange(x.shape[-1], device=x.device)[None]
        score = x + gumbel(seeds[:, None], idx, positions[:, None], STREAM_SAMPLE)
        return torch.where(greedy, row_argmax(l), row_argmax(score))

    def tokens(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, flags_any: int,
               banned: list[list[int]] | None = None) -> torch.Tensor:
        """One token per row of float32 logits [N, V] (steps 1-4)."""
        l = self.processed(logits, rows, positions, flags_any, banned)
        x, greedy = self.filtered(l, rows, flags_any)
        return self.draw(x, l, greedy, rows, positions)

    def probs(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, flags_any: int,
              banned: list[list[int]] | None = None) -> torch.Tensor:
        """The distribution each row samples from [N, V]: softmax of the kept x, one-hot at the argmax of
        the processed logits for greedy rows (speculative acceptance is then exact for them)."""
        l = self.processed(logits, rows, positions, flags_any, banned)
        x, greedy = self.filtered(l, rows, flags_any)
        probs = row_softmax(x)
        one_hot = torch.zeros_like(probs).scatter(-1, row_argmax(l)[..., None], 1.0)
        return torch.where(greedy[:, None], one_hot, probs)
