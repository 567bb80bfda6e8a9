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
- :class:`SparseSelect`: preallocated scores, list and count; ``__call__`` = scores + ``torch.topk``
  (unsorted: the attention takes the list in any order; rows past pos that fill a short context's
  list are masked there). Fixed shapes: it runs inside a CUDA graph.

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
                           H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr)
    offs = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    visible = offs <= pos
    if pid * BLOCK_T > pos:  # the whole block is past pos
        tl.store(out_ptr + offs, tl.full((BLOCK_T,), float("-inf"), tl.float32))
        return
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    k = tl.load(k_ptr + offs[:, None].to(tl.int64) * stride_kt + d[None, :], mask=visible[:, None], other=0.0)
    q = tl.load(q_ptr + h[:, None] * D + d[None, :])
    if DOT_F32:
        s = tl.dot(k.to(tl.float32), tl.trans(q.to(tl.float32)))  # [BLOCK_T, H]
    else:
        s = tl.dot(k, tl.trans(q))
    w = tl.load(w_ptr + h).to(tl.float32)
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
        DOT_F32=interpreting(), num_warps=num_warps)
    return out


def indexer_scores_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pos: int) -> torch.Tensor:
    """The reference step's index (float32) over rows 0..S-1 of k; -inf past pos."""
    d = q.shape[-1]
    scores = torch.relu(q.float() @ k.float().T * d ** -0.5)  # [H, S]
    index = (w.float()[:, None] * scores).sum(0)
    index[pos + 1:] = float("-inf")
    return index


class SparseSelect:
    """The indexer's top-k of one slot, into a list the sparse attention reads (fixed shapes: graphable)."""

    def __init__(self, *, max_tokens: int, top_k: int, device, block_t: int = 64, num_warps: int = 4):
        self.block_t, self.num_warps, self.top_k = block_t, num_warps, top_k
        rows = triton.cdiv(max_tokens, block_t) * block_t
        if top_k > rows:
            raise ValueError(f"top_k {top_k} exceeds the cache's {max_tokens} rows")
        self.scores = torch.empty(rows, dtype=torch.float32, device=device)
        self.idx = torch.zeros(top_k, dtype=torch.int32, device=device)
        self.count = torch.full((1,), top_k, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(list, count) for ``DecodeAttention(..., sparse=...)``: the top_k rows of k by index score."""
        indexer_scores(q, w, k, pos, self.scores, self.block_t, self.num_warps)
        top = torch.topk(self.scores, self.top_k, sorted=False).indices
        self.idx.copy_(top)
        return self.idx, self.count
