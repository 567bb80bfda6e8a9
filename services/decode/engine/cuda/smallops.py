"""Small fused Triton ops for the steps whose GEMVs run on cuBLAS: RMSNorm, rope + cache write, SiLU-mul.

Each has the same rounding points as the fused GEMV epilogues in ``gemv.py`` (and their torch twins),
so every backend mix computes the same numbers up to fp32 summation order. Qwen3's per-head q/k
RMSNorm + rope on whole heads (``norm_rope_rows``, ``norm_rope_cache_head``) lives in qknorm.py, shared
with the QKV GEMV and the attention kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import gdc_launch_dependents, gdc_wait, launch_opts
from .kernel_helpers import rope_pair, round_to_dtype
from .kvfp8 import kv_store_row
from .qknorm import norm_rope_cache_head, norm_rope_rows  # noqa: F401 (attention.py, batch.py)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, K, eps, stride_x, stride_o, K_POW2: tl.constexpr,
                    PDL: tl.constexpr = False, inv_ptr=None, LATE: tl.constexpr = False):
    # LATE: the folded form's two halves, out = round(x * w) and inv_ptr[row] = 1 / rms (norm_late_rows)
    row = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x_ptr += row * stride_x
    out_ptr += row * stride_o
    offs = tl.arange(0, K_POW2)
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if LATE:
        tl.store(out_ptr + offs, round_to_dtype(x * w.to(tl.float32), w.dtype).to(w.dtype), mask=mask)
        tl.store(inv_ptr + row, inv)
    else:
        xr = round_to_dtype(x * inv, w.dtype)
        tl.store(out_ptr + offs, (xr * w.to(tl.float32)).to(w.dtype), mask=mask)


@triton.jit
def _rope_cache_kernel(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       QK_NORM: tl.constexpr, PDL: tl.constexpr, KV_FMT: tl.constexpr = 0, inv_k=1.0, inv_v=1.0):
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0)
    if PDL:  # qkv comes from the previous kernel; the next one (attention) may start its prologue
        gdc_wait()
        gdc_launch_dependents()
    if QK_NORM:  # Qwen3: whole heads, normalised then rotated
        norm_rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                              eps, head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_FMT, inv_k, inv_v)
    else:
        rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, head, NUM_Q_HEADS,
                        NUM_KV_HEADS, HEAD_DIM, KV_FMT, inv_k, inv_v)


@triton.jit
def rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, head,
                    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    KV_FMT: tl.constexpr = 0, inv_k=1.0, inv_v=1.0):
    # one head of qkv: q rotated into q_ptr, k rotated and v as projected into the caches at pos (KV_FMT
    # 1 / 2: as FP8 bytes of value / scale, kvfp8.fp8_kv_bits; inv_k / inv_v: the layer's 1 / scale)
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF)
    a_raw = tl.load(qkv_ptr + head * HEAD_DIM + j)
    b_raw = tl.load(qkv_ptr + head * HEAD_DIM + HALF + j)
    dt = a_raw.dtype
    a = a_raw.to(tl.float32)
    b = b_raw.to(tl.float32)
    pos = tl.load(pos_ptr)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
        a1, b1 = rope_pair(a, b, cos, sin)
        a1, b1 = a1.to(dt), b1.to(dt)
        if head < NUM_Q_HEADS:
            tl.store(q_ptr + head * HEAD_DIM + j, a1.to(dt))
            tl.store(q_ptr + head * HEAD_DIM + HALF + j, b1.to(dt))
        else:
            base = k_cache_ptr + pos.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_Q_HEADS) * HEAD_DIM
            kv_store_row(base + j, a1.to(tl.float32), inv_k, dt, KV_FMT)
            kv_store_row(base + HALF + j, b1.to(tl.float32), inv_k, dt, KV_FMT)
    else:
        base = v_cache_ptr + pos.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_Q_HEADS - NUM_KV_HEADS) * HEAD_DIM
        kv_store_row(base + j, a, inv_v, dt, KV_FMT)
        kv_store_row(base + HALF + j, b, inv_v, dt, KV_FMT)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + I + offs, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = round_to_dtype(gf / (1.0 + tl.exp(-gf)), dt)
    tl.store(out_ptr + offs, (s * u.to(tl.float32)).to(dt), mask=mask)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """out = rmsnorm(x) * w for one vector x [K]."""
    k = x.numel()
    _rmsnorm_kernel[(1,)](x, w, out, k, eps, 0, 0, K_POW2=triton.next_power_of_2(k), num_warps=8)
    return out


def rmsnorm_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """out[t] = rmsnorm(x[t]) * w for x [T, K] (rows may be strided views)."""
    k = x.shape[-1]
    _rmsnorm_kernel[(x.shape[0],)](x, w, out, k, eps, x.stride(0), out.stride(0),
                                   K_POW2=triton.next_power_of_2(k), PDL=pdl, num_warps=8, **launch_opts(pdl))
    return out


def norm_late_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, inv: torch.Tensor, eps: float,
                   pdl: bool = False) -> torch.Tensor:
    """The folded RMSNorm's two halves for each row of x [T, K], once a step (the batched step's GEMVs read them
    instead of each program recomputing them): out[t] = round(x[t] * w), the GEMV's operand, and inv[t] =
    1 / rms(x[t]) (fp32), its ``row_scale`` (batch.rows_gemv): the norm as the one-token GEMVs fold it."""
    k = x.shape[-1]
    _rmsnorm_kernel[(x.shape[0],)](x, w, out, k, eps, x.stride(0), out.stride(0), K_POW2=triton.next_power_of_2(k),
                                   PDL=pdl, inv_ptr=inv, LATE=True, num_warps=8, **launch_opts(pdl))
    return out


def rope_cache_write(qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 1e-6, pdl: bool = False, kv_fmt: int = 0,
                     inv_k: float = 1.0, inv_v: float = 1.0) -> None:
    """Split qkv [(Hq+2Hkv)*D], [per-head RMSNorm q and k with q_norm/k_norm [D] (Qwen3), then] rope q and k,
    write q to q_out and k/v into the caches at pos[0] (``kv_fmt`` 1 / 2: FP8 bytes of k * inv_k, v * inv_v,
    as kvquant.quantize writes them)."""
    qk_norm = q_norm is not None
    _rope_cache_kernel[(num_q_heads + 2 * num_kv_heads,)](
        qkv, q_out, k_cache, v_cache, pos, cos, sin, q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, QK_NORM=qk_norm, PDL=pdl,
        KV_FMT=kv_fmt, inv_k=inv_k, inv_v=inv_v, num_warps=1, **launch_opts(pdl))


def silu_mul(gu: torch.Tensor, out: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """out[I] = silu(gu[:I]) * gu[I:]."""
    inter = gu.numel() // 2
    _silu_mul_kernel[(triton.cdiv(inter, block),)](gu, out, inter, BLOCK=block, num_warps=4)
    return out
