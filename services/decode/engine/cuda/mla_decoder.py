"""The DeepSeek-V3-family decode loop on device: plain step (greedy, or sampled) and MTP draft + verify step.

State lives in device tensors: ``tokens[0]`` (next input token), ``pos`` (its position), ``mtp_hidden``
(the hidden the MTP layer pairs with it: the main model's final-normed hidden one position back),
``out_tokens``/``out_idx`` (emitted tokens) and ``accepted`` (accepted drafts). ``plain_step()`` and
``spec_step(k)`` only read and advance that state, so each is captured once as one CUDA graph.

``plain_step(sample=True)`` (after ``attach_sampler``): the lm_head GEMV into ``logits[1]``, then the
sampling kernels of sampling.py (``FastSampler.finish``, the Llama-family decoder's sampling tail: the
slot's row of the engine's SamplingBuffers, Philox keyed by (seed, position)) pick the token and emit
it as the greedy pick does (out_tokens[out_idx], out_idx += 1, pos += 1; mtp_hidden = the step's hidden).

spec_step(k): k MTP drafts (draft j: token at pos+j and the previous hidden -> next token, in the MTP
cache's row pos+j-1 as vLLM's MTP layer places it; the MTP head is read once per draft), then one
verify forward of the k+1 tokens, greedy acceptance of the longest matching prefix, k+1 candidate
tokens written, n+1 of them kept. Greedy output is exactly the plain steps' output (verify row i is
the plain step at pos+i). ``spec_step(k, sample=True)`` (after ``attach_sampler``): speculative
sampling, the drafts drawn from the draft head's processed distribution and accepted or redrawn
against the verify's (torch ops over the slot's sampling row, captured with the graph).

After the verify, both run the MTP layer over the k+1 verified rows (``_mtp_over_verified``), as the
reference step and vLLM's MTP proposer do: the rows of accepted drafts hold the main model's pairs,
so the draft layer sees the context the reference step's sees and the drafts are the same.

``draft_vocab=N`` restricts the drafts to token ids ``< N`` (byte-level BPE ids are in merge order,
so the first ids are the frequent ones): the draft head reads N rows of the MTP head instead of
all V. Drafts stay verified by the full-vocabulary main model, so output does not change; only a
token outside the first N can never be drafted (that draft is rejected like any wrong one).

``MlaBatchDecoder``: 2..8 slots, one plain step each in one graph (the verify's T-row block with each row
in its own slot at its own position; the rows' control plane and step tail are batch.py's ``RowsDecoder``).
``MlaBatchSpecDecoder``: 2..8 slots, each with its own k drafts + verify (spec_step's step, greedy or speculative
sampling, row by row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import smallops
from . import reference
from .batch import RowControl, RowsDecoder
from .gemv import gemv
from .kernel_helpers import round_to_dtype
from .mla import MlaDims, MlaLayer, MlaStack, MtpWeights
from .moe import MAX_ROWS, gemv_rows
from .sampling import uniform
from .sampling_state import (BIAS, GREEDY, I_FLAGS, I_SEED, MIN_TOKENS, STREAM_ACCEPT, STREAM_DRAFT,
                             STREAM_SAMPLE, TOP_K, TOP_P, row_argmax)


@dataclass
class MlaModel:
    dims: MlaDims
    layers: list[MlaLayer]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    mtp: MtpWeights | None
    dense_inter: int


HEAD_TILE = (32, 256, 4, 4)  # (block_n, block_k, num_warps, stages) of the one-token heads (Llama lm_head's best)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, num_parts, tok_ptr, out_tokens_ptr, out_idx_ptr, pos_ptr, g_ptr, hid_ptr, H,
                 PARTS_POW2: tl.constexpr, H_POW2: tl.constexpr, EMIT: tl.constexpr):
    # greedy pick over the head GEMV's per-block maxima (ties -> lowest id, as torch.argmax) -> tok_ptr[0];
    # EMIT (a plain step): out_tokens[out_idx] = tok, out_idx += 1, pos += 1, g = hid (the MTP's hidden)
    offs = tl.arange(0, PARTS_POW2)
    val = tl.load(val_ptr + offs, mask=offs < num_parts, other=float("-inf"))
    idx = tl.load(idx_ptr + offs, mask=offs < num_parts, other=2147483647)
    tok = tl.min(tl.where(val == tl.max(val, axis=0), idx, 2147483647), axis=0).to(tl.int64)
    tl.store(tok_ptr, tok)
    if EMIT:
        i = tl.load(out_idx_ptr)
        tl.store(out_tokens_ptr + i, tok)
        tl.store(out_idx_ptr, i + 1)
        tl.store(pos_ptr, tl.load(pos_ptr) + 1)
        hh = tl.arange(0, H_POW2)
        tl.store(g_ptr + hh, tl.load(hid_ptr + hh, mask=hh < H), mask=hh < H)


@triton.jit
def _mtp_prologue_kernel(embed_ptr, tokens_ptr, j, g_ptr, enorm_ptr, hnorm_ptr, cat_ptr, pos_ptr, pos_draft_ptr, H,
                         eps, H_POW2: tl.constexpr):
    # draft j's input: cat[:H] = rmsnorm(embed[tokens[j]]) * enorm, cat[H:] = rmsnorm(g) * hnorm (program 0 / 1,
    # the rounding points of smallops.rmsnorm_rows); program 0 also sets pos_draft[j] = pos + j - 1, the MTP
    # row of the pair (hidden one position back, token at pos + j) as vLLM's MTP layer and the reference
    # step place it; at row 0 the token's embedding is zero (vLLM's MTP masks position 0's input)
    half = tl.program_id(0)
    hh = tl.arange(0, H_POW2)
    m = hh < H
    row = tl.maximum(tl.load(pos_ptr) + j - 1, 0)
    if half == 0:
        src = embed_ptr + tl.load(tokens_ptr + j) * H
        w_ptr = enorm_ptr
        tl.store(pos_draft_ptr + j, row)
    else:
        src = g_ptr
        w_ptr = hnorm_ptr
    x = tl.load(src + hh, mask=m, other=0.0).to(tl.float32)
    x = x * ((half != 0) | (row > 0)).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + hh, mask=m, other=0.0)
    xr = round_to_dtype(x * inv, w.dtype)
    tl.store(cat_ptr + half * H + hh, (xr * w.to(tl.float32)).to(w.dtype), mask=m)


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, pos_add, stream, out_ptr, n, ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    # out[row, i] = U(0, 1) of the counter (i, pos[s] + pos_add + r, stream) under seed[s], s = row // ROWS_PER,
    # r = row % ROWS_PER (sampling.py's uniform, sampling_state.uniform's numbers): one launch where torch takes
    # ~275 small ops
    row = tl.program_id(0)
    s = row // ROWS_PER
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    position = tl.load(pos_ptr + s).to(tl.int64) + pos_add + row % ROWS_PER
    tl.store(out_ptr + row * n + offs, uniform(tl.load(seed_ptr + s), offs, position, stream), mask=offs < n)


def uniform_rows(seed: torch.Tensor, pos: torch.Tensor, pos_add: int, stream: int, out: torch.Tensor) -> torch.Tensor:
    """out [rows, n] float32 (contiguous) in S groups of rows / S rows, S = seed.numel(): row r of group s, index i
    -> sampling_state.uniform(seed[s], i, pos[s] + pos_add + r, stream); ``seed`` int64 [S] and ``pos`` [S] on the
    device (read at replay): one slot's rows (S = 1), or each of a batch's slots' own."""
    rows, n = out.shape
    if rows % seed.numel() or pos.numel() != seed.numel():
        raise ValueError(f"uniform_rows: {rows} rows in {seed.numel()} groups, {pos.numel()} positions")
    block = min(1024, triton.next_power_of_2(n))
    _uniform_kernel[(rows, triton.cdiv(n, block))](seed, pos, pos_add, stream, out, n, ROWS_PER=rows // seed.numel(),
                                                   BLOCK=block, num_warps=4)
    return out


def mtp_input_rows(mt: MtpWeights, tokens: torch.Tensor, hidden: torch.Tensor, emb: torch.Tensor, cat: torch.Tensor,
                   x: torch.Tensor, eps: float, keep: torch.Tensor | None = None) -> None:
    """The MTP layer's input for T rows, each pairing a main-model hidden with the token after it: x = eh_proj(
    [enorm . embed(tokens), hnorm . hidden]) (``emb``, ``cat``: the rows' buffers; ``keep`` [T] 0/1: rows whose token
    embedding counts, as vLLM's MTP masks position 0's)."""
    hd = hidden.shape[1]
    torch.index_select(mt.embed, 0, tokens, out=emb)
    if keep is not None:
        emb.mul_(keep[:, None])
    smallops.rmsnorm_rows(emb, mt.enorm, cat[:, :hd], eps)
    smallops.rmsnorm_rows(hidden, mt.hnorm, cat[:, hd:], eps)
    gemv_rows(cat, mt.eh_proj, x)


class MlaDecoder:
    """Slot state and step functions over per-layer caches [max_tokens, r + rope] (MTP cache last)."""

    LM_HEAD_DOT_TILE: tuple[int, int, int, int] = (16, 128, 2, 6)  # the verify's lm_head (T > 1; H200 sweep)

    def __init__(self, model: MlaModel, caches: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 max_draft: int = 3, max_steps: int = 4096, num_splits: int = 16, draft_vocab: int | None = None,
                 index_caches: list[torch.Tensor | None] | None = None, kv_scales: list[float] | None = None):
        """``index_caches``: sparse attention's indexer key cache [max_tokens, index_dim] of each layer with an
        indexer (MTP layer last, as ``caches``), None for the others. uint8 ``caches`` hold an FP8 latent (E4M3),
        ``kv_scales`` each layer's k_scale (default 1.0)."""
        self.model, self.caches = model, caches
        self.k_scales = list(kv_scales) if kv_scales is not None else [1.0] * len(caches)
        d, dev, bf = model.dims, model.embed.device, torch.bfloat16
        self.index_caches = index_caches or [None] * len(caches)
        self.cos, self.sin = cos.to(device=dev, dtype=bf).contiguous(), sin.to(device=dev, dtype=bf).contiguous()
        vocab, hdim = model.lm_head.shape
        self.stacks = {t: MlaStack(d, t, dev, num_splits=num_splits, dense_inter=model.dense_inter,
                                   max_tokens=caches[0].shape[0])
                       for t in range(1, max_draft + 2)}
        self.residual = {t: torch.zeros(t, hdim, dtype=bf, device=dev) for t in self.stacks}
        self.hid = {t: torch.zeros(t, hdim, dtype=bf, device=dev) for t in self.stacks}
        self.logits = {t: torch.zeros(t, vocab, dtype=torch.float32, device=dev) for t in self.stacks}
        self.tokens = torch.zeros(max_draft + 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.pos_draft = torch.zeros(max_draft, 1, dtype=torch.int32, device=dev)
        self.mtp_hidden = torch.zeros(1, hdim, dtype=bf, device=dev)
        self.mtp_cat = torch.zeros(1, 2 * hdim, dtype=bf, device=dev)
        self.mtp_x = torch.zeros(1, hdim, dtype=bf, device=dev)
        # the MTP layer over a verify's k + 1 rows (_mtp_over_verified): token embeddings, normed input, x
        self.mtp_emb_rows = {t: torch.zeros(t, hdim, dtype=bf, device=dev) for t in self.stacks if t > 1}
        self.mtp_cat_rows = {t: torch.zeros(t, 2 * hdim, dtype=bf, device=dev) for t in self.stacks if t > 1}
        self.mtp_x_rows = {t: torch.zeros(t, hdim, dtype=bf, device=dev) for t in self.stacks if t > 1}
        if draft_vocab is not None and not 0 < draft_vocab <= vocab:
            raise ValueError(f"draft_vocab must be in 1..{vocab} (the vocabulary size), got {draft_vocab}")
        self.draft_vocab = draft_vocab or vocab
        self.draft_head = model.mtp.head[: self.draft_vocab] if model.mtp is not None else None  # a view: no copy
        # the draft head's logits: the first draft_vocab ids of a whole-vocabulary row whose other ids stay
        # -inf (what a sampled draft's distribution is taken over)
        self.mtp_logits_v = torch.full((1, vocab), float("-inf"), dtype=torch.float32, device=dev)
        self.mtp_logits = self.mtp_logits_v[:, : self.draft_vocab]
        self.draft_q = torch.zeros(max(max_draft, 1), vocab, dtype=torch.float32, device=dev)  # sampled drafts' q
        self.noise = torch.zeros(1, vocab, dtype=torch.float32, device=dev)  # their uniforms, and the verify's
        self.accept_u = torch.zeros(max(max_draft, 1), 1, dtype=torch.float32, device=dev)
        bn = HEAD_TILE[0]
        self.parts_main = (torch.zeros(triton.cdiv(vocab, bn), dtype=torch.float32, device=dev),
                           torch.zeros(triton.cdiv(vocab, bn), dtype=torch.int32, device=dev))
        self.parts_draft = (torch.zeros(triton.cdiv(self.draft_vocab, bn), dtype=torch.float32, device=dev),
                            torch.zeros(triton.cdiv(self.draft_vocab, bn), dtype=torch.int32, device=dev))
        self.out_tokens = torch.zeros(max_steps + max_draft + 1, dtype=torch.int64, device=dev)
        self.out_idx = torch.zeros(1, dtype=torch.int64, device=dev)
        self.accepted = torch.zeros(1, dtype=torch.int64, device=dev)
        self.arange = torch.arange(max_draft + 1, device=dev)
        self.sampler = None  # sampling.FastSampler over the slot's sampling row (attach_sampler)
        self.spec_sampler = None  # (engine ReferenceSampler over that row, its rows: all): sampled drafts

    def attach_sampler(self, state, **kwargs) -> None:
        """Sample in ``plain_step(sample=True)`` with the request parameters held in ``state`` (a
        sampling_state.SlotSampling, the slot's row of the engine's SamplingBuffers, read at every
        replay); kwargs: FastSampler's sizes (as the Llama-family decoder's attach_sampler)."""
        from .sampling import FastSampler, candidate_cap

        vocab = self.model.lm_head.shape[0]
        kwargs.setdefault("cap", candidate_cap(vocab))
        self.sampler = FastSampler(state, vocab, self.logits[1].device, **kwargs)
        try:  # the engine's sampler (engine/sampling.py): not there when this package is loaded on its own
            from ..sampling import ReferenceSampler
        except ImportError:
            return
        self.spec_sampler = (ReferenceSampler(_RowBuffers(state)), slice(None))  # the one row, as views

    def set_state(self, token_id: int, pos: int, prev_hidden: torch.Tensor | None = None) -> None:
        """Host-side (re)start: next token, its position, and the hidden one position back (for MTP)."""
        self.tokens[0] = token_id
        self.pos.fill_(pos)
        self.out_idx.zero_()
        self.accepted.zero_()
        self.mtp_hidden.copy_(prev_hidden.view(1, -1) if prev_hidden is not None else torch.zeros_like(self.mtp_hidden))

    def forward(self, t: int, parts: bool = True) -> None:
        """Main model over tokens[:t] at pos..pos+t-1 -> logits[t] [t, V] fp32, hid[t] (final-normed);
        ``parts`` (t = 1): also each head block's maximum, for _pick_kernel."""
        m, h = self.model, self.residual[t]
        torch.index_select(m.embed, 0, self.tokens[:t], out=h)
        layers = list(m.layers)
        for i, lw in enumerate(layers):
            self.stacks[t].block(lw, h, self.caches[i], self.pos, self.cos, self.sin, self.index_caches[i],
                                 k_scale=self.k_scales[i], next_lw=layers[i + 1] if i + 1 < len(layers) else None)
        smallops.rmsnorm_rows(h, m.final_norm, self.hid[t], m.dims.eps)
        if t == 1:  # with each block's maximum, for _pick_kernel
            self._head(self.hid[1][0], m.lm_head, self.logits[1][0], self.parts_main if parts else None)
        else:
            gemv_rows(self.hid[t], m.lm_head, self.logits[t], block_n=16, block_k=256, dot_tile=self.LM_HEAD_DOT_TILE)

    @staticmethod
    def _head(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, parts) -> None:
        bn, bk, nw, st = HEAD_TILE
        gemv(x, w, out, block_n=bn, block_k=bk, num_warps=nw, stages=st, argmax_parts=parts)

    def _pick(self, parts, tok: torch.Tensor, emit: bool) -> None:
        h = self.mtp_hidden.shape[1]
        _pick_kernel[(1,)](parts[0], parts[1], parts[0].numel(), tok, self.out_tokens, self.out_idx, self.pos,
                           self.mtp_hidden, self.hid[1], h, PARTS_POW2=triton.next_power_of_2(parts[0].numel()),
                           H_POW2=triton.next_power_of_2(h), EMIT=emit, num_warps=4)

    def mtp_draft(self, j: int, pick: bool = True) -> None:
        """Draft j: MTP(embed(tokens[j]), mtp_hidden) in the MTP cache's row pos + j - 1 -> the draft head's
        logits (``mtp_logits``) and, with ``pick``, their argmax in tokens[j+1]; mtp_hidden becomes the
        recycled hidden."""
        mt, eps, hd = self.model.mtp, self.model.dims.eps, self.mtp_hidden.shape[1]
        _mtp_prologue_kernel[(2,)](mt.embed, self.tokens, j, self.mtp_hidden, mt.enorm, mt.hnorm, self.mtp_cat,
                                   self.pos, self.pos_draft, hd, eps, H_POW2=triton.next_power_of_2(hd), num_warps=8)
        gemv_rows(self.mtp_cat, mt.eh_proj, self.mtp_x)
        n = len(self.model.layers)
        self.stacks[1].block(mt.layer, self.mtp_x, self.caches[n], self.pos_draft[j], self.cos, self.sin,
                             self.index_caches[n], k_scale=self.k_scales[n])
        smallops.rmsnorm_rows(self.mtp_x, mt.head_norm, self.mtp_hidden, eps)
        self._head(self.mtp_hidden[0], self.draft_head, self.mtp_logits[0], self.parts_draft if pick else None)
        if pick:
            self._pick(self.parts_draft, self.tokens[j + 1:j + 2], emit=False)

    def plain_step(self, sample: bool = False, mtp_row: bool = False) -> None:
        """One token: forward(1), the greedy pick (or with ``sample`` the attached sampler's token), emit,
        advance; with ``mtp_row`` then the MTP layer's cache row of the pair it leaves (``mtp_row()``)."""
        if sample and self.sampler is None:
            raise ValueError("plain_step(sample=True) needs attach_sampler first")
        self.forward(1, parts=not sample)
        if not sample:
            self._pick(self.parts_main, self.tokens[:1], emit=True)
        else:
            # token -> tokens[0], out_tokens[out_idx], out_idx += 1, pos += 1 (the next input's embedding is
            # forward's own gather); then the MTP's hidden, as _pick_kernel's EMIT
            self.sampler.finish(self.logits[1][0], self.tokens[:1], self.out_tokens, self.out_idx, self.pos)
            self.mtp_hidden.copy_(self.hid[1])
        if mtp_row:
            self.mtp_row()

    @property
    def mtp_rows_ok(self) -> bool:
        """Whether plain steps can keep the MTP layer's cache (``mtp_row``): an MTP layer with dense attention."""
        mt = self.model.mtp
        return mt is not None and mt.layer.index is None and not mt.layer.sparse

    def mtp_row(self) -> None:
        """The MTP layer's cache row a draft would write for the state a plain step leaves (the main model's hidden
        at pos - 1 with the token at pos, in row pos - 1, as the next step's first draft and the verify's MTP pass
        place it), so that drafts after steps that did not draft attend over the rows a drafting step would have
        written: the draft prologue and eh_proj, then only the latent of the MTP block (MlaStack.latent); no
        attention, no MLP, no head (V2-Lite: ~19 MB and four launches, against ~4.9 GB a step)."""
        mt, eps, hd = self.model.mtp, self.model.dims.eps, self.mtp_hidden.shape[1]
        _mtp_prologue_kernel[(2,)](mt.embed, self.tokens, 0, self.mtp_hidden, mt.enorm, mt.hnorm, self.mtp_cat,
                                   self.pos, self.pos_draft, hd, eps, H_POW2=triton.next_power_of_2(hd), num_warps=8)
        gemv_rows(self.mtp_cat, mt.eh_proj, self.mtp_x)
        n = len(self.model.layers)
        self.stacks[1].latent(mt.layer, self.mtp_x, self.caches[n], self.pos_draft[0], self.cos, self.sin,
                              k_scale=self.k_scales[n])

    def spec_step(self, k: int, sample: bool = False) -> None:
        """k drafts + one verify of k+1 tokens; keeps the longest greedy-matching prefix plus one (with
        ``sample``: speculative sampling, ``_spec_sampled``)."""
        if sample:
            self._spec_sampled(k)
            return
        for j in range(k):
            self.mtp_draft(j)
        self.forward(k + 1)
        a = row_argmax(self.logits[k + 1])  # [k+1]: the model's token after each input (two-stage)
        n = torch.cumprod((a[:k] == self.tokens[1:k + 1]).long(), dim=0).sum().view(1)  # accepted drafts
        self._keep(k, a, n)  # a[:n] are the accepted drafts, a[n] the step's token

    def _keep(self, k: int, cand: torch.Tensor, n: torch.Tensor) -> None:
        """After a verify: ``cand`` [k+1] (the n accepted drafts, then the step's token) written out, n + 1
        of them kept; the MTP pass over the verified rows; the next step starts from cand[n]."""
        self.out_tokens.index_copy_(0, self.out_idx + self.arange[:k + 1], cand)
        self._mtp_over_verified(k, cand)
        self.out_idx.add_(n + 1)
        self.accepted.add_(n)
        self.mtp_hidden.copy_(self.hid[k + 1].index_select(0, n))
        self.tokens[:1].copy_(cand.index_select(0, n))
        self.pos.add_((n + 1).to(torch.int32))

    def _mtp_over_verified(self, k: int, cand: torch.Tensor) -> None:
        """The MTP layer over the verify's k + 1 rows, as the reference step and vLLM's MTP proposer run it
        after a verify: MTP row pos + i pairs the main model's hidden at pos + i with the token at pos + i
        + 1 (``cand``: the accepted drafts, then the step's token, then rejected drafts, whose rows are
        rewritten when reached). So the rows of accepted drafts hold the main model's pairs, not the draft
        chain's, and the next step's drafts see what the reference step's see. The cache rows only: the
        next step's first draft recomputes row pos + n from the same pair."""
        t = k + 1
        mt = self.model.mtp
        if mt is None or t not in self.mtp_x_rows:
            return
        mtp_input_rows(mt, cand, self.hid[t], self.mtp_emb_rows[t], self.mtp_cat_rows[t], self.mtp_x_rows[t],
                       self.model.dims.eps)
        n = len(self.model.layers)
        self.stacks[t].block(mt.layer, self.mtp_x_rows[t], self.caches[n], self.pos, self.cos, self.sin,
                             self.index_caches[n], k_scale=self.k_scales[n])

    def _spec_sampled(self, k: int) -> None:
        """Speculative sampling (engine/spec.py) with the reference step's distributions and random numbers
        (after attach_sampler): draft j is drawn from q_j, the slot's processed distribution of the draft
        head's logits at position pos + 1 + j (stream STREAM_DRAFT); the verify's k + 1 target
        distributions p_i (positions pos + 1 + i) accept draft i when u_i * q_i(d_i) < p_i(d_i) (u keyed by
        position, stream STREAM_ACCEPT), the first rejection draws from max(0, p - q) renormalised, and
        all-accepted from p (Exp noise at pos + 1): the output keeps the target distribution whatever the
        drafts. Torch ops over the slot's sampling row, captured with the graph: every processor the
        drafting requests can carry (bias and allowed ids, min_tokens, temperature, min_p, top_k, top_p;
        penalties and bad words read the output and never draft). A draft whose distribution is empty
        (every allowed id outside a reduced draft vocabulary) and the drafts after it are not verified."""
        if self.spec_sampler is None:
            raise ValueError("spec_step(k, sample=True) needs attach_sampler first, within the engine package "
                             "(services.decode.engine: its sampler and speculative acceptance)")
        ref, rows = self.spec_sampler
        iparams = ref.bufs.iparams[0]
        seeds, greedy = iparams[I_SEED:I_SEED + 1], (iparams[I_FLAGS:I_FLAGS + 1] & GREEDY) != 0
        for j in range(k):
            self.mtp_draft(j, pick=False)
            token, q = draw_draft(ref, self.mtp_logits_v, rows, self.pos, j, seeds, greedy, self.noise)
            self.tokens[j + 1:j + 2].copy_(token)
            self.draft_q[j].copy_(q[0])
        self.forward(k + 1, parts=False)
        at = self.pos.to(torch.int64) + 1 + self.arange[:k + 1]  # of the token after each verified input
        p = ref.probs(self.logits[k + 1], rows, at, SPEC_SAMPLING_FLAGS)
        n, cand = accept_drafts(p[None], self.draft_q[None, :k], self.tokens[None, 1:k + 1], None, seeds, self.pos,
                                self.accept_u[:k], self.noise, greedy)
        self._keep(k, cand[0], n)  # accepted drafts, the draw


# every processor a drafting request can carry, each applied per row by its own flag (the reference
# sampler's flags_any: a superset changes nothing), so one captured graph serves every such request
SPEC_SAMPLING_FLAGS = BIAS | MIN_TOKENS | TOP_K | TOP_P


def draw_draft(sampler, logits: torch.Tensor, rows, pos: torch.Tensor, j: int, seeds: torch.Tensor,
               greedy: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft j of each of R rows by speculative sampling, as the reference step's ``_draft``: q, the row's processed
    distribution of the draft head's whole-vocabulary ``logits`` [R, V] at position pos + 1 + j (``sampler``: the
    engine's ReferenceSampler, ``rows`` its buffer rows), and the token drawn from q with Exp noise of stream
    STREAM_DRAFT there (``noise`` [R, V]: the uniforms' buffer): (tokens [R], q [R, V])."""
    from ..sampling import sample

    q = sampler.probs(logits, rows, pos.to(torch.int64) + 1 + j, SPEC_SAMPLING_FLAGS)
    uniform_rows(seeds, pos, 1 + j, STREAM_DRAFT, noise)
    return sample(q, -torch.log(noise), greedy), q


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_valid: torch.Tensor | None,
                  seeds: torch.Tensor, pos: torch.Tensor, accept_u: torch.Tensor, noise: torch.Tensor,
                  greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's acceptance of R rows' k drafts (spec.verify with the reference step's random numbers:
    uniforms of stream STREAM_ACCEPT at pos + 1 + i into ``accept_u`` [R * k, 1], the draw's Exp noise at pos + 1
    into ``noise`` [R, V]): ``p`` [R, k + 1, V] the verify's targets, ``q`` [R, k, V] the drafts' distributions,
    ``num_valid`` [R] drafts each row verifies at most (None: all). A draft whose distribution is empty (every
    allowed id outside a reduced draft vocabulary) and the ones after it are not verified. (accepted [R],
    candidates [R, k + 1]: the accepted drafts, the draw after them, then rejected drafts)."""
    from ..spec import verify

    r, k = drafts.shape
    drawn = (q.sum(dim=-1) > 0).to(torch.int64).cumprod(dim=1).sum(dim=1)
    valid = drawn if num_valid is None else torch.minimum(num_valid, drawn)
    u = uniform_rows(seeds, pos, 1, STREAM_ACCEPT, accept_u).view(r, k)
    uniform_rows(seeds, pos, 1, STREAM_SAMPLE, noise)
    n, nxt = verify(p, q, drafts, valid, u, -torch.log(noise), greedy)
    return n, torch.cat([drafts, nxt[:, None]], dim=1).scatter(1, n[:, None], nxt[:, None])


class MlaBatchDecoder(RowsDecoder):
    """``batch`` slots of a DeepSeek-family model decoding one token each in one step (one CUDA graph per
    padded batch size, as the Llama family's GqaBatchDecoder, whose control plane and step it shares:
    ``set_rows``, ``step(sample=)``, ``out_tokens[b, step]``). The block is a T-row stack (norms,
    tensor-core projections, the absorbed q and w_uv by bmm, the routed rows through the grouped expert
    GEMVs, every expert's weights read once for all rows; ``MlaStack.BATCH_CHAIN``: the absorbed q and
    merge + w_uv by the one-token block's kernels over every row, on sm_90 one chain on programmatic
    dependent launch, not yet measured) with each row at its own
    position in its own slot: the latent written by ``_mla_prep_kernel``'s batch form, the attention with
    ``slot_ids``.
    ``caches``: the engine's whole per-layer latent caches [num_slots + 1, max_tokens, r + rope] (the
    main model's layers; padded rows decode on the scratch slot). Plain steps (a batch that drafts:
    MlaBatchSpecDecoder), no sparse attention (its indexer decodes one slot per step).
    ``mtp_cache`` (the MTP layer's, as ``caches``; kv_scales then has its scale last): ``step(mtp_row=True)`` also
    writes each row's MTP cache row of the pair its step leaves (MlaDecoder.mtp_row, row by row), so that a slot's
    drafts after plain batched steps attend over the rows drafting would have written."""

    def __init__(self, model: MlaModel, caches: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 batch: int, options=None, max_steps: int = 256, scratch_slot: int | None = None,
                 num_splits: int = 16, kv_scales: list[float] | None = None, mtp_cache: torch.Tensor | None = None):
        if len(caches) != len(model.layers):
            raise ValueError(f"{len(caches)} caches for {len(model.layers)} layers")
        self.model, self.caches = model, caches
        self.k_scales = list(kv_scales) if kv_scales is not None else [1.0] * (len(caches) + 1)  # uint8 caches: FP8
        d, dev, bf = model.dims, model.embed.device, torch.bfloat16
        self._init_rows(model.embed, model.final_norm, model.lm_head, d.eps, len(model.layers), cos, sin, batch,
                        options, max_steps, caches[0].shape[0] - 1 if scratch_slot is None else scratch_slot)
        self.stack = MlaStack(d, batch, dev, num_splits=num_splits, dense_inter=model.dense_inter,
                              max_tokens=caches[0].shape[1], batch=True)
        self.mtp_cache = mtp_cache
        if mtp_cache is not None and model.mtp is not None:  # the MTP layer's input rows and their positions
            hd = model.lm_head.shape[1]
            self.mtp_emb = torch.zeros(batch, hd, dtype=bf, device=dev)
            self.mtp_cat = torch.zeros(batch, 2 * hd, dtype=bf, device=dev)
            self.mtp_x = torch.zeros(batch, hd, dtype=bf, device=dev)
            self.mtp_pos = torch.zeros(batch, dtype=torch.int32, device=dev)

    @property
    def mtp_rows_ok(self) -> bool:
        """Whether ``step(mtp_row=True)`` can keep the MTP layer's cache: its cache given, dense attention."""
        mt = self.model.mtp
        return self.mtp_cache is not None and mt is not None and mt.layer.index is None and not mt.layer.sparse

    def step(self, sample: bool = False, mtp_row: bool = False) -> None:
        """RowsDecoder.step; with ``mtp_row`` then every row's MTP cache row of the pair it leaves: the step's
        final-normed hidden (at the input's position p) with the token it picked, in MTP row p of the row's slot (the
        draft prologue, eh_proj and the MTP block's latent alone: MlaStack.latent)."""
        if mtp_row and not self.mtp_rows_ok:
            raise ValueError("step(mtp_row=True) needs the MTP layer's cache and a dense-attention MTP layer")
        super().step(sample)
        if mtp_row:
            mt, n = self.model.mtp, len(self.caches)
            torch.sub(self.pos, 1, out=self.mtp_pos)  # the input's position: pos has moved past it
            mtp_input_rows(mt, self.token, self.hn, self.mtp_emb, self.mtp_cat, self.mtp_x, self.model.dims.eps)
            self.stack.latent(mt.layer, self.mtp_x, self.mtp_cache, self.mtp_pos, self.cos, self.sin,
                              k_scale=self.k_scales[n], slots=self.slots)

    def layer(self, i: int) -> None:
        layers = self.model.layers
        self.stack.block(layers[i], self.residual, self.caches[i], self.pos, self.cos, self.sin,
                         slots=self.slots, k_scale=self.k_scales[i],
                         next_lw=layers[i + 1] if i + 1 < len(layers) else None)


# rows of a batch that drafts (slots x (drafts + 1)): gemv_rows' most (moe.MAX_ROWS)
MAX_SPEC_ROWS = MAX_ROWS


class MlaBatchSpecDecoder:
    """``batch`` slots of a DeepSeek-family model, each with ``k`` MTP drafts and one verify of its k + 1 tokens, in
    one step (one CUDA graph per padded batch size and k): MlaDecoder.spec_step's greedy step, row by row (or its
    speculative sampling: ``step(sample=True)``, below).

    Row b decodes slot ``slots[b]`` from token ``tokens[b, 0]`` at ``pos[b]``, its MTP input ``mtp_hidden[b]``
    (the main model's final-normed hidden one position back), verifying at most ``num_valid[b]`` of its drafts
    (a slot asking for fewer than k, or none, in a batch that drafts). A step: k drafts, each the MTP layer over
    the B rows (MTP cache row pos + j - 1 of each slot, as the one-slot step places it) and the draft head's
    argmax; the verify, the main model over B x (k + 1) rows (row (b, i): token i of slot b at pos[b] + i, every
    row's latent written before any row attends, so each sees its slot's earlier rows of this step); each slot's
    longest greedy-matching prefix; the MTP layer over every verified row (MTP row pos[b] + i pairs the main
    model's hidden there with the token after it, the reference step's rows); each slot's hidden before its next
    token into ``mtp_hidden``. ``out[b]`` = [accepted drafts n, then the k + 1 candidate tokens: the n accepted,
    the step's token, rejected drafts' replacements]; the host keeps n + 1 of them.

    ``set_rows(tokens, positions, slots, num_valid)`` (host, before each step; one pinned buffer, one async copy)
    and the caller's writes into ``mtp_hidden`` are applied by the step's first ops. Rows past the lists decode
    on the scratch slot.

    ``step(sample=True)`` (after ``attach_sampler(buffers)``, the engine's SamplingBuffers): speculative sampling,
    MlaDecoder._spec_sampled's step row by row, each row by its own slot's sampling row (parameters, seed): draft j
    drawn from the slot's processed distribution of the draft head's logits at position pos + 1 + j, the verify's
    k + 1 target distributions accepting or redrawing (spec.verify), greedy rows one-hot (their drafts and tokens
    the argmax, as the greedy step's). Torch ops captured with the graph; padded rows sample the scratch slot's row,
    which the caller keeps greedy."""

    def __init__(self, model: MlaModel, caches: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 batch: int, k: int, scratch_slot: int | None = None, num_splits: int = 16,
                 draft_vocab: int | None = None, kv_scales: list[float] | None = None):
        """``caches``: the engine's whole per-layer latent caches [num_slots + 1, max_tokens, r + rope], the main
        model's layers then the MTP layer's."""
        if model.mtp is None:
            raise ValueError("a batch that drafts needs the model's MTP layer")
        if len(caches) != len(model.layers) + 1:
            raise ValueError(f"{len(caches)} caches for {len(model.layers)} layers and the MTP layer")
        rows = batch * (k + 1)
        if k < 1 or batch < 2 or rows > MAX_SPEC_ROWS:
            raise ValueError(f"a batch that drafts has 2 or more slots, 1 or more drafts and at most "
                             f"{MAX_SPEC_ROWS} rows (slots x (drafts + 1)), got {batch} slots x {k} drafts")
        d, dev, bf = model.dims, model.embed.device, torch.bfloat16
        self.model, self.caches, self.batch, self.k = model, caches, batch, k
        self.k_scales = list(kv_scales) if kv_scales is not None else [1.0] * len(caches)
        self.scratch_slot = caches[0].shape[0] - 1 if scratch_slot is None else scratch_slot
        self.cos, self.sin = cos.to(device=dev, dtype=bf).contiguous(), sin.to(device=dev, dtype=bf).contiguous()
        vocab, hd = model.lm_head.shape
        self.draft_head = model.mtp.head[: draft_vocab or vocab]  # a view: no copy
        stack = dict(num_splits=num_splits, dense_inter=model.dense_inter, max_tokens=caches[0].shape[1], batch=True)
        self.draft_stack = MlaStack(d, batch, dev, **stack)  # the MTP layer over one draft of every slot
        self.stack = MlaStack(d, rows, dev, **stack)  # the verify's rows (main layers, then the MTP layer)
        self.tokens = torch.zeros(batch, k + 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((batch,), self.scratch_slot, dtype=torch.int32, device=dev)
        self.num_valid = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.pos_draft = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.pos_rows = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.slot_rows = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.steps = torch.arange(k + 1, dtype=torch.int32, device=dev)
        self.first_rows = torch.arange(batch, device=dev) * (k + 1)
        self.mtp_hidden = torch.zeros(batch, hd, dtype=bf, device=dev)
        self.emb = torch.zeros(batch, hd, dtype=bf, device=dev)
        self.cat = torch.zeros(batch, 2 * hd, dtype=bf, device=dev)
        self.mtp_x = torch.zeros(batch, hd, dtype=bf, device=dev)
        # the draft head's logits: the first draft_vocab ids of whole-vocabulary rows whose other ids stay -inf (what
        # a sampled draft's distribution is taken over)
        self.draft_logits_v = torch.full((batch, vocab), float("-inf"), dtype=torch.float32, device=dev)
        self.draft_logits = self.draft_logits_v[:, : self.draft_head.shape[0]]
        self.residual = torch.zeros(rows, hd, dtype=bf, device=dev)
        self.hid = torch.zeros(rows, hd, dtype=bf, device=dev)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)
        self.emb_rows = torch.zeros(rows, hd, dtype=bf, device=dev)
        self.cat_rows = torch.zeros(rows, 2 * hd, dtype=bf, device=dev)
        self.mtp_x_rows = torch.zeros(rows, hd, dtype=bf, device=dev)
        self.out = torch.zeros(batch, k + 2, dtype=torch.int64, device=dev)
        self._ctrl = RowControl(4 * batch, dev)
        self.sampler = None  # the engine's ReferenceSampler over its SamplingBuffers (attach_sampler)

    def attach_sampler(self, buffers) -> None:
        """Sample in ``step(sample=True)`` with each row's request parameters in row ``slots[b]`` of ``buffers``
        (the engine's SamplingBuffers, read at every replay)."""
        from ..sampling import ReferenceSampler

        vocab, dev = self.logits.shape[1], self.logits.device
        self.sampler = ReferenceSampler(buffers)
        self.draft_q = torch.zeros(self.batch, self.k, vocab, dtype=torch.float32, device=dev)  # each draft's q
        self.noise = torch.zeros(self.batch, vocab, dtype=torch.float32, device=dev)  # a draw's uniforms
        self.accept_u = torch.zeros(self.batch * self.k, 1, dtype=torch.float32, device=dev)

    def set_rows(self, tokens: list[int], positions: list[int], slots: list[int], num_valid: list[int]) -> None:
        """Every row's next input token, position, slot and drafts to verify (rows past the lists: token 0 at
        position 0 of the scratch slot, nothing verified); applied by the next ``step()``."""
        pad = self.batch - len(tokens)
        valid = [min(max(n, 0), self.k) for n in num_valid]
        self._ctrl.write([*tokens, *[0] * pad, *positions, *[0] * pad, *slots, *[self.scratch_slot] * pad,
                          *valid, *[0] * pad])

    def step(self, sample: bool = False) -> None:
        """One step of every row (capturable: no host sync); ``sample``: speculative sampling (class docstring)."""
        if sample and self.sampler is None:
            raise ValueError("step(sample=True) needs attach_sampler first")
        b, c = self.batch, self._ctrl.dev
        self.tokens[:, 0].copy_(c[:b])
        self.pos.copy_(c[b:2 * b])
        self.slots.copy_(c[2 * b:3 * b])
        self.num_valid.copy_(c[3 * b:])
        draw = None
        if sample:  # each row's sampling row, seed and greedy flag (its slot's)
            rows = self.slots.long()
            iparams = self.sampler.bufs.iparams[rows]
            draw = (rows, iparams[:, I_SEED].contiguous(), (iparams[:, I_FLAGS] & GREEDY) != 0)
        for j in range(self.k):
            self._draft(j, draw)
        self._verify(draw)

    def _draft(self, j: int, draw: tuple | None = None) -> None:
        """Draft j of every row: MTP(embed(tokens[:, j]), mtp_hidden) in MTP row pos + j - 1 -> tokens[:, j + 1]
        (the argmax; with ``draw`` = (sampling rows, seeds, greedy) drawn from the slot's processed distribution,
        kept in draft_q[:, j]); mtp_hidden becomes the recycled hidden (at row 0 the token's embedding is zero,
        as vLLM's MTP masks it)."""
        mt, eps = self.model.mtp, self.model.dims.eps
        torch.add(self.pos, j - 1, out=self.pos_draft).clamp_(min=0)
        mtp_input_rows(mt, self.tokens[:, j], self.mtp_hidden, self.emb, self.cat, self.mtp_x, eps,
                       keep=(self.pos_draft > 0).to(self.emb.dtype))
        n = len(self.model.layers)
        self.draft_stack.block(mt.layer, self.mtp_x, self.caches[n], self.pos_draft, self.cos, self.sin,
                               slots=self.slots, k_scale=self.k_scales[n])
        smallops.rmsnorm_rows(self.mtp_x, mt.head_norm, self.mtp_hidden, eps)
        gemv_rows(self.mtp_hidden, self.draft_head, self.draft_logits, block_n=16, block_k=256,
                  dot_tile=MlaDecoder.LM_HEAD_DOT_TILE)
        if draw is None:
            self.tokens[:, j + 1].copy_(row_argmax(self.draft_logits))
            return
        token, q = draw_draft(self.sampler, self.draft_logits_v, draw[0], self.pos, j, *draw[1:], self.noise)
        self.tokens[:, j + 1].copy_(token)
        self.draft_q[:, j].copy_(q)

    def _verify(self, draw: tuple | None = None) -> None:
        """The main model over every row, each slot's acceptance (greedy, or with ``draw`` speculative sampling), the
        MTP layer over every verified row, each slot's next MTP input."""
        m, k, eps = self.model, self.k, self.model.dims.eps
        mt, n = m.mtp, len(m.layers)
        torch.add(self.pos[:, None], self.steps[None], out=self.pos_rows.view(self.batch, k + 1))
        self.slot_rows.view(self.batch, k + 1).copy_(self.slots[:, None].expand(-1, k + 1))
        torch.index_select(m.embed, 0, self.tokens.view(-1), out=self.residual)
        for i, lw in enumerate(m.layers):
            self.stack.block(lw, self.residual, self.caches[i], self.pos_rows, self.cos, self.sin, slots=self.slot_rows,
                             k_scale=self.k_scales[i], next_lw=m.layers[i + 1] if i + 1 < n else None)
        smallops.rmsnorm_rows(self.residual, m.final_norm, self.hid, eps)
        gemv_rows(self.hid, m.lm_head, self.logits, block_n=16, block_k=256, dot_tile=MlaDecoder.LM_HEAD_DOT_TILE)
        if draw is None:
            a = row_argmax(self.logits).view(self.batch, k + 1)  # the model's token after each input
            ok = (a[:, :k] == self.tokens[:, 1:]) & (self.steps[None, :k] < self.num_valid[:, None])
            accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
        else:  # speculative sampling against each row's targets (its slot's sampling row at each position)
            p = self.sampler.probs(self.logits, self.slot_rows.long(), self.pos_rows.long() + 1, SPEC_SAMPLING_FLAGS)
            accepted, a = accept_drafts(p.view(self.batch, k + 1, -1), self.draft_q, self.tokens[:, 1:],
                                        self.num_valid, draw[1], self.pos, self.accept_u, self.noise, draw[2])
        self.out[:, 0].copy_(accepted)
        self.out[:, 1:].copy_(a)
        # the MTP layer over every verified row (MlaDecoder._mtp_over_verified's pairs, each slot's own)
        mtp_input_rows(mt, a.reshape(-1), self.hid, self.emb_rows, self.cat_rows, self.mtp_x_rows, eps)
        self.stack.block(mt.layer, self.mtp_x_rows, self.caches[n], self.pos_rows, self.cos, self.sin,
                         slots=self.slot_rows, k_scale=self.k_scales[n])
        torch.index_select(self.hid, 0, self.first_rows + accepted, out=self.mtp_hidden)


class _RowBuffers:
    """One slot's row of the engine's SamplingBuffers (a sampling_state.SlotSampling) as [1, ...]
    buffers for the reference sampler: views, so a replay reads the request armed now."""

    def __init__(self, row):
        for name in ("fparams", "iparams", "bias", "prompt_mask", "counts", "stop_mask"):
            setattr(self, name, getattr(row, name)[None])


# ---- torch reference of one block and one step (the kernels' twins, same rounding points) ----

def reference_block(d: MlaDims, lw: MlaLayer, h: torch.Tensor, cache: torch.Tensor, pos: int,
                    cos: torch.Tensor, sin: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
    """One block on h [T, H] at positions pos..; writes cache rows; returns the new h. A uint8 ``cache``: an
    FP8 latent (rows written as E4M3 bytes of row / k_scale, attended over in fp32 as fp8 * k_scale)."""
    t, nh, r, nope = h.shape[0], d.num_heads, d.kv_lora_rank, d.nope
    nq = nh * (nope + d.rope)
    xa = reference.rms_norm(h, lw.attn_norm, d.eps)
    if lw.wq_b is None:
        qkv = reference.linear(xa, lw.wqkv_a)  # [q | c, k_pe]
    else:  # q LoRA: [c, k_pe | q_a] in one projection, q = q_b(RMSNorm(q_a)) in front
        a = reference.linear(xa, lw.wqkv_a)
        q = reference.linear(reference.rms_norm(a[:, r + d.rope:], lw.q_a_norm, d.eps), lw.wq_b)
        qkv = torch.cat([q, a], dim=-1)
    q = qkv[:, :nq].view(t, nh, nope + d.rope)
    cp, sp = cos[pos:pos + t].to(h.dtype), sin[pos:pos + t].to(h.dtype)
    q_pe = reference.rope_interleave(q[..., nope:], cp[:, None], sp[:, None])
    k_pe = reference.rope_interleave(qkv[:, nq + r:nq + r + d.rope], cp, sp)
    row = torch.cat([reference.rms_norm(qkv[:, nq:nq + r], lw.kv_a_norm, d.eps), k_pe], dim=-1)
    q_c = torch.matmul(q[..., :nope].transpose(0, 1), lw.w_uk).transpose(0, 1)  # [T, Hq, r]
    query = torch.cat([q_c, q_pe], dim=-1)
    if cache.dtype == torch.uint8:
        cache[pos:pos + t] = reference.fp8_latent_bytes(row, k_scale)
        kv = reference.fp8_latent_values(cache[:pos + t], k_scale)
        o_lat = reference.attention(query.float(), kv[:, None], kv[:, None, :r], pos, d.sm_scale).to(h.dtype)
    else:
        cache[pos:pos + t] = row
        o_lat = reference.attention(query, cache[:, None], cache[:, None, :r], pos, d.sm_scale)
    o = torch.matmul(o_lat.transpose(0, 1), lw.w_uv_t).transpose(0, 1).reshape(t, -1)
    h = h + reference.linear(o, lw.wo)
    xn = reference.rms_norm(h, lw.mlp_norm, d.eps)
    # the shared MLP split in experts of the routed size (as laid out for the kernel), summed in fp32
    shared = sum(reference.matmul_f32(reference.silu_mul(reference.linear(xn, lw.shared_gate_up[s])), lw.shared_down[s])
                 for s in range(lw.shared_gate_up.shape[0])).to(h.dtype)
    if not lw.is_moe:
        return h + shared
    ids, wts = reference.router(xn, lw.router, lw.router_bias, d.top_k, d.routed_scale, d.n_group, d.topk_group)
    return h + (reference.moe(xn, ids, wts, lw.gate_up, lw.down) + shared)


def reference_forward(model: MlaModel, caches: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                      tokens: list[int], pos: int, kv_scales: list[float] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V] fp32, final-normed hidden [T, H]) of the main model over tokens at pos.. (uint8 caches: an
    FP8 latent, ``kv_scales`` each layer's k_scale)."""
    h = model.embed[torch.tensor(tokens, device=model.embed.device)]
    for i, lw in enumerate(model.layers):
        h = reference_block(model.dims, lw, h, caches[i], pos, cos, sin, kv_scales[i] if kv_scales else 1.0)
    hid = reference.rms_norm(h, model.final_norm, model.dims.eps)
    return hid.float() @ model.lm_head.float().T, hid
