"""Batch-1 GEMV kernels (Triton) over FP8 weights with per-output-channel scales.

The FP8 twins of gemv.py's ``gemv`` and ``gemv_silu`` (same tiling: program ``p`` owns ``BLOCK_N``
rows and walks K in ``BLOCK_K`` chunks; each weight byte is read once): the float8_e4m3fn weight is
widened to fp32 in registers, the row sum is multiplied by the row's float32 scale in the epilogue,
then bias, rounding and residual as gemv.py does. Per-tensor scales arrive widened to rows (engine
fp8.py), so one kernel serves compressed-tensors "channel" and "tensor" checkpoints.

``ACT`` (the checkpoint quantizes activations dynamically per token, FP8_DYNAMIC): the input vector
(after the fused RMSNorm, rounded as gemv.py rounds it) goes through vLLM's FP8 rounding with one
scale per token, ``s = max(amax / 448, 1 / (448 * 512))``, ``x = fp8(x / s) * s``, exactly as the
engine's reference step (engine/fp8.quantize_activations) and vLLM's W8A8 prefill do; every program
computes the vector's amax itself from L2 (the vector is 4-28 KB), so there is no extra launch.

Torch twins: :func:`gemv_fp8_reference`, :func:`gemv_fp8_silu_reference`; CPU tests run the kernels
under ``TRITON_INTERPRET=1`` against them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import gdc_launch_dependents, gdc_wait, launch_opts
from .kernel_helpers import rnd_bf16, round_to_dtype
from . import reference

FP8_MAX = 448.0
ACT_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@triton.jit
def _prologue(x_ptr, nw_ptr, K, eps, NORM: tl.constexpr, ACT: tl.constexpr, K_POW2: tl.constexpr):
    # (1/rms, activation scale, its reciprocal) of the input vector; 1.0 where not asked
    inv_rms = 1.0
    s = 1.0
    inv_s = 1.0
    if NORM or ACT:
        offs = tl.arange(0, K_POW2)
        m = offs < K
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            nw = tl.load(nw_ptr + offs, mask=m, other=0.0)
            x = rnd_bf16(rnd_bf16(x * inv_rms) * nw.to(tl.float32))
        if ACT:
            s = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.0 / (448.0 * 512.0))
            inv_s = 1.0 / s
    return inv_rms, s, inv_s


@triton.jit
def _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM: tl.constexpr, ACT: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = k + tl.arange(0, BLOCK_K)
    kmask = offs < K
    x = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0)
        x = rnd_bf16(rnd_bf16(x * inv_rms) * nw.to(tl.float32))
    if ACT:
        q = tl.minimum(tl.maximum(x * inv_s, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        x = q.to(tl.float32) * s
    return x, offs, kmask


@triton.jit
def _rows_dot(x_ptr, nw_ptr, w_ptr, rows, rmask, K, inv_rms, s, inv_s, NORM: tl.constexpr, ACT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, N, K, eps,
                     NORM: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
                     K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    ws = tl.load(ws_ptr + rows, mask=rmask, other=0.0)
    if BIAS:
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if PDL:  # weights and scales are never written: only x and the outputs wait for the previous kernel
        gdc_wait()
    inv_rms, s, inv_s = _prologue(x_ptr, nw_ptr, K, eps, NORM, ACT, K_POW2)
    y = _rows_dot(x_ptr, nw_ptr, w_ptr, rows, rmask, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_N, BLOCK_K, STAGES)
    if PDL:
        gdc_launch_dependents()
    y = y * ws
    if BIAS:
        y += bias
    if RESIDUAL:
        r = tl.load(res_ptr + rows, mask=rmask, other=0.0)
        y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _gemv_fp8_silu_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, nw_ptr, I, K, eps,
                          NORM: tl.constexpr, ACT: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # I % BLOCK_N == 0
    ws_g = tl.load(ws_ptr + rows)
    ws_u = tl.load(ws_ptr + rows + I)
    if PDL:
        gdc_wait()
    inv_rms, s, inv_s = _prologue(x_ptr, nw_ptr, K, eps, NORM, ACT, K_POW2)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K)
        wg = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(w_ptr + (rows + I)[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_g += wg.to(tl.float32) * x[None, :]
        acc_u += wu.to(tl.float32) * x[None, :]
    if PDL:
        gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    g = round_to_dtype(tl.sum(acc_g, axis=1) * ws_g, dt)
    u = round_to_dtype(tl.sum(acc_u, axis=1) * ws_u, dt)
    sg = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + rows, (sg * u).to(dt))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, *,
             norm_w: torch.Tensor | None = None, eps: float = 1e-5, residual: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, act: bool = False, block_n: int = 16, block_k: int = 512,
             num_warps: int = 4, stages: int = 1, pdl: bool = False, prefetch: int = 0) -> torch.Tensor:
    """out[N] = [residual +] round(scale * (W8[N, K] @ q([rmsnorm(x) * norm_w | x])) [+ bias]); q is the FP8
    activation rounding when ``act``. ``prefetch`` is accepted for gemv.py's tile kwargs and unused."""
    n, k = w.shape
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, w, w_scale, out, residual if residual is not None else out, norm_w if norm_w is not None else x,
        bias if bias is not None else x, n, k, eps, NORM=norm_w is not None, RESIDUAL=residual is not None,
        BIAS=bias is not None, ACT=act, K_POW2=_pow2(k), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        num_warps=num_warps, **launch_opts(pdl))
    return out


def gemv_fp8_silu(x: torch.Tensor, w_gate_up: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, *,
                  norm_w: torch.Tensor | None = None, eps: float = 1e-5, act: bool = False, block_n: int = 16,
                  block_k: int = 512, num_warps: int = 4, stages: int = 1, pdl: bool = False,
                  prefetch: int = 0) -> torch.Tensor:
    """out[I] = silu(gate) * up of the FP8 [2I, K] weight, as gemv.gemv_silu computes it from bf16."""
    two_i, k = w_gate_up.shape
    inter = two_i // 2
    if inter % block_n:
        raise ValueError(f"intermediate size {inter} is not a multiple of block_n {block_n}")
    _gemv_fp8_silu_kernel[(inter // block_n,)](
        x, w_gate_up, w_scale, out, norm_w if norm_w is not None else x, inter, k, eps, NORM=norm_w is not None,
        ACT=act, K_POW2=_pow2(k), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl, num_warps=num_warps,
        **launch_opts(pdl))
    return out


# ---------------------------------------------------------------- torch twins
def quantize_act(x: torch.Tensor) -> torch.Tensor:
    """vLLM's dynamic per-token FP8 rounding of a vector, back in fp32."""
    xf = x.float()
    s = (xf.abs().max() / FP8_MAX).clamp(min=ACT_MIN_SCALE)
    return (xf * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


def _input(x, norm_w, eps, act):
    xn = reference.rms_norm(x, norm_w, eps) if norm_w is not None else x
    return quantize_act(xn) if act else xn.float()


def gemv_fp8_reference(x, w, w_scale, *, norm_w=None, eps=1e-5, residual=None, bias=None, act=False,
                       dtype=torch.bfloat16) -> torch.Tensor:
    y = (w.float() @ _input(x, norm_w, eps, act)) * w_scale
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    return residual + y if residual is not None else y


def gemv_fp8_silu_reference(x, w_gate_up, w_scale, *, norm_w=None, eps=1e-5, act=False,
                            dtype=torch.bfloat16) -> torch.Tensor:
    gu = ((w_gate_up.float() @ _input(x, norm_w, eps, act)) * w_scale).to(dtype)
    return reference.silu_mul(gu)
