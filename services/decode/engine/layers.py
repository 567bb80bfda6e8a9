"""Building blocks shared by the model families: RMSNorm, SwiGLU MLP, cache write, masked attention.

Shapes: B slots in the step, T query tokens per slot, S cache capacity (tokens), H heads.
Everything here is static-shaped and free of host syncs. RMSNorm and the SwiGLU activation are the
fast path's torch twins (cuda/reference.py): one definition of the math both paths round alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cuda.reference import rms_norm, silu_mul
from .fp8 import linear

__all__ = ["attend", "cached_rows", "causal_mask", "column_major", "lone_run", "rms_norm", "swiglu", "write_cache"]


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused in one [2*I, H] weight (FP8 or not)."""
    return linear(silu_mul(linear(x, w_gate_up)), w_down)


def column_major(weights) -> None:
    """Store each float32 weight [..., N, K] column-major (the same tensor, its last two dims' transpose
    contiguous): a step's ``F.linear(x, W)`` of one token is then ``x @ W^T`` over a row-major matrix, which
    the CPU's BLAS streams faster than the dot products over W's rows (the tiny Llama's nine projections
    ~155 -> ~98 us a step on one core); a stacked [E, N, K] expert weight gives each expert that layout.
    The sums run in another order (fp32; vLLM's CPU build uses oneDNN's, which is neither). FP8 and bf16
    weights, and a weight already laid out (one seen twice), keep their layout. The caller leaves out
    weights that F.embedding gathers rows of (an lm_head tied to the embedding)."""
    for p in weights:
        if p is not None and p.dtype == torch.float32 and p.dim() >= 2 and p.is_contiguous():
            p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def lone_run(slot_ids: torch.Tensor, positions: torch.Tensor) -> tuple[int, int] | None:
    """(slot, first position) as host ints where one slot's step writes consecutive positions and the
    tensors live on the CPU (reading them costs no device sync there); else None. With it the CPU step
    writes its cache rows by slicing (an index_put cost ~6 us a write on the tiny model) and, for one
    token attending to exactly its own prefix, needs no mask."""
    if slot_ids.device.type != "cpu" or slot_ids.numel() != 1 or torch.compiler.is_compiling():
        return None
    p = positions.view(-1).tolist()
    return (int(slot_ids[0]), p[0]) if p == list(range(p[0], p[0] + len(p))) else None


def write_cache(cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                run: tuple[int, int] | None = None) -> None:
    """cache [N, S, ...][slot_ids[b], positions[b, t]] = values[b, t] (``run``: :func:`lone_run`'s answer)."""
    if run is not None:
        cache[run[0], run[1]:run[1] + values.shape[1]] = values[0]
        return
    cache[slot_ids[:, None], positions] = values.to(cache.dtype)


def cached_rows(cache: torch.Tensor, slot_ids: torch.Tensor, num_keys: int,
                run: tuple[int, int] | None = None) -> torch.Tensor:
    """cache [N, S, ...][slot_ids, :num_keys]. On the CPU, where the slots are one run (a lone slot
    always), a view of the cache: the gather's copy was a CPU step's largest cost after the matmuls
    (~12% of a tiny model's step at 500 tokens); the values, and so every result, are the same. Elsewhere
    a gather, free of host syncs (CUDA graphs capture it; so is a traced step, on any device). ``run``:
    :func:`lone_run`'s answer, the one slot's view without reading the ids again."""
    if run is not None:
        return cache[run[0]:run[0] + 1, :num_keys]
    if cache.device.type == "cpu" and not torch.compiler.is_compiling():
        ids = slot_ids.tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return cache[ids[0]:ids[0] + len(ids), :num_keys]
    return cache[:, :num_keys].index_select(0, slot_ids)


def causal_mask(positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, 1, T, S] boolean: cache position s is visible to the query at positions[b, t] iff s <= it."""
    keys = torch.arange(capacity, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, T, Hq, Dv] (GQA by head groups; mask None:
    every key visible to every query)."""
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    if t == 1 and hq != hkv:  # one token: a K/V head's query heads as its rows (half the time of enable_gqa on CPU)
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, -1), k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, hq, 1, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != hq)
    return out.transpose(1, 2)
