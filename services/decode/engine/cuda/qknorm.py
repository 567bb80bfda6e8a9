"""Qwen3's per-head q/k RMSNorm + rope on whole heads (Triton device functions).

Shared by the QKV GEMV's last program of each head (gemv.py, ``QK_NORM``), the norm + rope + cache-write
kernel (smallops.rope_cache_write), the batched step's rope kernel (batch.py) and the attention kernel's
prologue (attention.py), so every place rounds alike (reference.rms_norm, then neox rope in bf16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_helpers import rnd_bf16
from .kvfp8 import kv_store_row


@triton.jit
def norm_rope_rows(x, xp, w_ptr, cos_ptr, sin_ptr, pos, eps, HEAD_DIM: tl.constexpr):
    # x [R, D]: rows of whole heads as projected (bf16); xp: the same rows with their halves swapped
    # (column d holds x[(d + D/2) % D]), the rope partners, loaded so instead of shuffled in registers.
    # RMSNorm per row (fp32 statistics, rounded, times w: reference.rms_norm), then neox rope, each op
    # rounded like eager bf16 torch; returns fp32 values of bf16 numbers.
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + (d + HALF) % HEAD_DIM).to(tl.float32)
    xn = rnd_bf16(rnd_bf16(xf * inv[:, None]) * w[None, :])
    pn = rnd_bf16(rnd_bf16(xp.to(tl.float32) * inv[:, None]) * wp[None, :])
    cos = tl.load(cos_ptr + pos * HALF + d % HALF).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HALF + d % HALF).to(tl.float32)
    rot = rnd_bf16(pn * sin[None, :])
    return rnd_bf16(rnd_bf16(xn * cos[None, :]) + tl.where(d < HALF, -rot, rot))  # x1 cos - x2 sin | x2 cos + x1 sin



@triton.jit
def norm_rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
                          head, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          KV_FMT: tl.constexpr = 0, inv_k=1.0, inv_v=1.0, CM: tl.constexpr = ""):
    # one head of qkv (as projected, model dtype): q / k normalised + rotated into q_ptr / the K cache at pos,
    # v into the V cache; CM ".cg": qkv was stored by other programs of this launch (read past L1)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]: one row
    pos = tl.load(pos_ptr)
    row = (pos.to(tl.int64) * NUM_KV_HEADS + (head - NUM_Q_HEADS) % NUM_KV_HEADS) * HEAD_DIM
    x = tl.load(qkv_ptr + head * HEAD_DIM + d, cache_modifier=CM)
    dt = x.dtype
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        xp = tl.load(qkv_ptr + head * HEAD_DIM + (d + HALF) % HEAD_DIM, cache_modifier=CM)
        if head < NUM_Q_HEADS:
            y = norm_rope_rows(x, xp, qn_ptr, cos_ptr, sin_ptr, pos, eps, HEAD_DIM)
            tl.store(q_ptr + head * HEAD_DIM + d, y.to(dt))
        else:
            y = norm_rope_rows(x, xp, kn_ptr, cos_ptr, sin_ptr, pos, eps, HEAD_DIM)
            kv_store_row(k_cache_ptr + row + d, y, inv_k, dt, KV_FMT)
    else:
        kv_store_row(v_cache_ptr + row + d, x.to(tl.float32), inv_v, dt, KV_FMT)
