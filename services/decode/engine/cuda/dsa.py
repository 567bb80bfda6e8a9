"""DeepSeek Sparse Attention's decode-time selection on CUDA: the lightning indexer's scores and the top-k.

One query token (batch 1), as the engine's reference step computes it (engine/deepseek.py
``_selected``): with the indexer query ``q`` [H, D] (roped), the head weights ``w`` [H] (the weights
projection of the token, times H^-0.5) and the slot's indexer key cache ``k`` [S, D], the score of
cache row t <= pos is ``sum_h w_h * relu(q_h . k_t * D^-0.5)``; rows past pos score -inf. The
attention then reads only the ``top_k`` best rows: ``DecodeAttention(..., sparse=(idx, n))``
(attention.py) takes the list this module writes.

- :func:`indexer_scores`: one Triton kernel, a program per ``BLOCK_T`` cache rows (the [BLOCK_T, D] key
  tile against all H query heads in one tensor-core dot, fp32 accumulate); programs past pos only
  write -inf, so the cost follows the context, not the buffer.
- :class:`RadixTopK`: the set of the k largest scores by a three-round radix select (below).
- :class:`SparseSelect`: preallocated scores, list and count; ``__call__`` = scores + the top-k (radix,
  or ``torch.topk``; unsorted either way: the attention takes the list in any order; rows past pos that
  fill a short context's list are masked there). Fixed shapes: it runs inside a CUDA graph.

Torch twin: :func:`indexer_scores_reference`; CPU tests run the kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .gemv import interpreting


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, stride_kt, scale,
                           H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr,
                           H_PAD: tl.constexpr):
    # H_PAD: the heads as the dot's N (a power of two >= 16, the tensor-core dot's least); padded heads weigh 0
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr)
    offs = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    visible = offs <= pos
    if pid * BLOCK_T > pos:  # the whole block is past pos
        tl.store(out_ptr + offs, tl.full((BLOCK_T,), float("-inf"), tl.float32))
        return
    d = tl.arange(0, D)
    h = tl.arange(0, H_PAD)
    k = tl.load(k_ptr + offs[:, None].to(tl.int64) * stride_kt + d[None, :], mask=visible[:, None], other=0.0)
    q = tl.load(q_ptr + h[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
    if DOT_F32:
        s = tl.dot(k.to(tl.float32), tl.trans(q.to(tl.float32)))  # [BLOCK_T, H]
    else:
        s = tl.dot(k, tl.trans(q))
    w = tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(s * scale, 0.0) * w[None, :], axis=1)
    tl.store(out_ptr + offs, tl.where(visible, score, float("-inf")))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                   block_t: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q [H, D] (contiguous), w [H] float32, k [S, D] rows (row stride ``k.stride(0)``), pos int [1] (last
    visible row), out float32 [S'] with S' a multiple of ``block_t`` (rows >= S must lie past pos)."""
    h, d = q.shape
    if out.numel() % block_t:
        raise ValueError(f"the scores buffer ({out.numel()}) is not a multiple of block_t {block_t}")
    _indexer_scores_kernel[(out.numel() // block_t,)](
        q, w, k, pos, out, k.stride(0), 1.0 / math.sqrt(d), H=h, D=d, BLOCK_T=block_t,
        DOT_F32=interpreting(), H_PAD=max(16, triton.next_power_of_2(h)), num_warps=num_warps)
    return out


def indexer_scores_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pos: int) -> torch.Tensor:
    """The reference step's index (float32) over rows 0..S-1 of k; -inf past pos."""
    d = q.shape[-1]
    scores = torch.relu(q.float() @ k.float().T * d ** -0.5)  # [H, S]
    index = (w.float()[:, None] * scores).sum(0)
    index[pos + 1:] = float("-inf")
    return index


# ---------------------------------------------------------------- top-k by radix select
# The set of the top_k largest scores (no order) in three histogram rounds over the scores' order-preserving
# 32-bit keys (11, 11 and 10 bits): round i counts the rows whose key matches the prefix found so far by
# their next bits, one program finds the bin where the k-th largest falls; the full key of the k-th
# largest is known after round 3. A last pass lists every row above it and as many rows equal to it as
# the list has room for (equal scores: any of them). Seven small launches of fixed shape; each reads the
# scores (4 bytes a row) once.

ROUND_BITS = (11, 11, 10)


@triton.jit
def _key(score):
    """The float32's bits, flipped so that unsigned order is float order."""
    u = score.to(tl.uint32, bitcast=True)
    sign = tl.full(u.shape, 1, tl.uint32) << 31
    return tl.where((u & sign) != 0, ~u, u | sign)


@triton.jit
def _hist_kernel(scores_ptr, st_ptr, hist_ptr, N, ROUND: tl.constexpr, BITS: tl.constexpr,
                 SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    key = _key(tl.load(scores_ptr + offs, mask=inb, other=float("-inf")))
    take = inb
    if ROUND > 0:  # only rows whose higher bits equal the prefix found so far
        prefix = tl.load(st_ptr + 1).to(tl.uint32)
        take = take & ((key >> (SHIFT + BITS)) == prefix)
    bins = tl.where(take, ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32), 0)
    h = tl.histogram(bins, 1 << BITS)
    nb = tl.arange(0, 1 << BITS)
    h = h - tl.where(nb == 0, BLOCK - tl.sum(take.to(tl.int32), axis=0), 0)  # rows not taken were put in bin 0
    tl.atomic_add(hist_ptr + nb, h, mask=h > 0)


@triton.jit
def _scan_kernel(st_ptr, hist_ptr, cnt_ptr, ROUND: tl.constexpr, BITS: tl.constexpr, K: tl.constexpr):
    # st: [need (rows still to pick among the prefix's), prefix (the k-th largest's bits so far)]
    nb = tl.arange(0, 1 << BITS)
    h = tl.load(hist_ptr + nb)
    tl.store(hist_ptr + nb, tl.zeros_like(h))  # ready for the next call
    if ROUND == 0:
        need = K
        prefix = 0
        tl.store(cnt_ptr + tl.arange(0, 2), tl.zeros((2,), tl.int32))  # this call's list counters
    else:
        need = tl.load(st_ptr)
        prefix = tl.load(st_ptr + 1)
    total = tl.sum(h, axis=0)
    at_or_above = total - tl.cumsum(h, axis=0) + h  # rows in bins >= b
    b = tl.max(tl.where(at_or_above >= need, nb, 0), axis=0)
    above = tl.sum(tl.where(nb == b, at_or_above - h, 0), axis=0)
    tl.store(st_ptr, need - above)
    tl.store(st_ptr + 1, (prefix << BITS) | b)


@triton.jit
def _list_kernel(scores_ptr, st_ptr, cnt_ptr, idx_ptr, N, K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    key = _key(tl.load(scores_ptr + offs, mask=inb, other=float("-inf")))
    need = tl.load(st_ptr)  # rows equal to the k-th largest to list
    kth = tl.load(st_ptr + 1).to(tl.uint32)
    above = inb & (key > kth)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    base = tl.atomic_add(cnt_ptr, n_above)
    at = base + tl.cumsum(above.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + at, offs, mask=above)
    equal = inb & (key == kth)
    n_equal = tl.sum(equal.to(tl.int32), axis=0)
    ebase = tl.atomic_add(cnt_ptr + 1, n_equal)
    j = ebase + tl.cumsum(equal.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + (K - need) + j, offs, mask=equal & (j < need))


class RadixTopK:
    """The set of the ``k`` largest of ``n`` float32 scores into ``idx`` (int32 [k], any order); graphable."""

    def __init__(self, n: int, k: int, device, block: int = 1024, num_warps: int = 4):  # run D1: the best tile
        if k > n:
            raise ValueError(f"k {k} exceeds the {n} scores")
        self.n, self.k, self.block, self.num_warps = n, k, block, num_warps
        self.st = torch.zeros(2, dtype=torch.int32, device=device)
        self.cnt = torch.zeros(2, dtype=torch.int32, device=device)
        self.hists = [torch.zeros(1 << b, dtype=torch.int32, device=device) for b in ROUND_BITS]

    def __call__(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        grid = (triton.cdiv(self.n, self.block),)
        shift = 32
        for i, (bits, hist) in enumerate(zip(ROUND_BITS, self.hists)):
            shift -= bits
            _hist_kernel[grid](scores, self.st, hist, self.n, ROUND=i, BITS=bits, SHIFT=shift, BLOCK=self.block,
                               num_warps=self.num_warps)
            _scan_kernel[(1,)](self.st, hist, self.cnt, ROUND=i, BITS=bits, K=self.k, num_warps=self.num_warps)
        _list_kernel[grid](scores, self.st, self.cnt, idx, self.n, K=self.k, BLOCK=self.block,
                           num_warps=self.num_warps)
        return idx


class SparseSelect:
    """The indexer's top-k of one slot, into a list the sparse attention reads (fixed shapes: graphable)."""

    def __init__(self, *, max_tokens: int, top_k: int, device, block_t: int = 64, num_warps: int = 4,
                 radix: bool = True):
        self.block_t, self.num_warps, self.top_k = block_t, num_warps, top_k
        rows = triton.cdiv(max_tokens, block_t) * block_t
        if top_k > rows:
            raise ValueError(f"top_k {top_k} exceeds the cache's {max_tokens} rows")
        self.scores = torch.empty(rows, dtype=torch.float32, device=device)
        self.idx = torch.zeros(top_k, dtype=torch.int32, device=device)
        self.count = torch.full((1,), top_k, dtype=torch.int32, device=device)
        # radix: RadixTopK (seven small launches); else torch.topk (a sort-based select)
        self.radix = RadixTopK(rows, top_k, device) if radix else None

    def __call__(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(list, count) for ``DecodeAttention(..., sparse=...)``: the top_k rows of k by index score."""
        indexer_scores(q, w, k, pos, self.scores, self.block_t, self.num_warps)
        if self.radix is not None:
            self.radix(self.scores, self.idx)
        else:
            self.idx.copy_(torch.topk(self.scores, self.top_k, sorted=False).indices)
        return self.idx, self.count
