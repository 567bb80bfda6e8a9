"""Batch-1 GEMV kernels (Triton) over FP8 weights with per-output-channel scales.

The FP8 twins of gemv.py's ``gemv`` and ``gemv_silu`` (same tiling: program ``p`` owns ``BLOCK_N``
rows and walks K in ``BLOCK_K`` chunks; each weight byte is read once): the float8_e4m3fn weight is
widened to fp32 in registers, the row sum is multiplied by the row's float32 scale in the epilogue,
then bias, rounding and residual as gemv.py does. Per-tensor scales arrive widened to rows (engine
fp8.py), so one kernel serves compressed-tensors "channel" and "tensor" checkpoints.

``ACT`` (the checkpoint quantizes activations dynamically per token, FP8_DYNAMIC): the input vector
(after the fused RMSNorm, rounded as gemv.py rounds it) goes through vLLM's FP8 rounding with one
scale per token, ``s = max(amax / 448, 1 / (448 * 512))``, ``x = fp8(x / s) * s``, exactly as the
engine's reference step (engine/fp8.quantize_activations) and vLLM's W8A8 prefill do. The QKV and gate/up inputs,
the normed residual, are rounded once a layer by :func:`round_token` (``FastOptions.fp8_round_once``) and their GEMVs
read its FP8 values and scale (``XQ``): the same values, without two reductions in every program. The o and down
GEMVs round their input a K tile at a time with a scale from the largest |value| of each part of it, which the
kernels that write it store beside it (each attention head's merge, each SiLU GEMV program: ``AMAX``,
``FastOptions.fp8_amax_carry``); without it each o / down program reduces the whole input (4-28 KB) itself.

Block-scaled checkpoints (fp8block.BlockFp8: Qwen's FP8 releases, 128 x 128 blocks, activations rounded per 128
features) take the one-token step's other kernels here. With every projection rounding its activations, each GEMV
input is rounded once - by :func:`quant_groups` (QKV's and gate/up's inputs, the norm first), by the attention's merge
(o's, where a head is one group) or by the gate/up kernel's epilogue (down's, where a program's gate rows are one
group) - into FP8 values and a scale a group, and the GEMVs (:func:`gemv_fp8block_xq`, the SiLU and QKV + rope pair
kernels) read those: the same values as a GEMV that rounds its input tile itself, without a reduction in its weight
loop. Weight-only block checkpoints take moe.gemv_rows.

Torch twins: :func:`gemv_fp8_reference`, :func:`gemv_fp8_silu_reference` (block-scaled: fp8block.linear_reference and
quantize_groups); CPU tests run the kernels under ``TRITON_INTERPRET=1`` against them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import gemv, reference, smallops
from . import fp8block
from .fp8block import BlockFp8, fp8_fma_rounded, group_offs, round_groups
from .gemv import _inv_rms, gdc_launch_dependents, gdc_wait, launch_opts, qkv_store
from .kernel_helpers import act_round, act_scale, head_half_rows, rms_scaled, rnd_bf16, round_to_dtype
from .llama import GqaDecoder, folds_norm
from .moe import gemv_rows

FP8_MAX = 448.0
ACT_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@triton.jit
def _prologue(x_ptr, nw_ptr, K, eps, NORM: tl.constexpr, ACT: tl.constexpr, K_POW2: tl.constexpr,
              XQ: tl.constexpr = False, AMAX: tl.constexpr = 0, AMAX_POW2: tl.constexpr = 1):
    # (1/rms, activation scale, its reciprocal) of the input vector; 1.0 where not asked. XQ: the input arrives
    # rounded (x_ptr its FP8 values, nw_ptr its scale: quant_groups over the whole vector), nothing to reduce.
    # AMAX (ACT, no NORM): the largest |x| of each of the AMAX parts the writer's programs made arrive at nw_ptr
    inv_rms = 1.0
    s = 1.0
    inv_s = 1.0
    if XQ:
        s = tl.load(nw_ptr)
    elif AMAX:
        parts = tl.arange(0, AMAX_POW2)
        s = act_scale(tl.max(tl.load(nw_ptr + parts, mask=parts < AMAX, other=0.0), axis=0))
        inv_s = 1.0 / s
    elif NORM or ACT:
        offs = tl.arange(0, K_POW2)
        m = offs < K
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            nw = tl.load(nw_ptr + offs, mask=m, other=0.0)
            x = rnd_bf16(rnd_bf16(x * inv_rms) * nw.to(tl.float32))
        if ACT:
            s = act_scale(tl.max(tl.abs(x), axis=0))
            inv_s = 1.0 / s
    return inv_rms, s, inv_s


@triton.jit
def _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM: tl.constexpr, ACT: tl.constexpr, BLOCK_K: tl.constexpr,
            XQ: tl.constexpr = False):
    offs = k + tl.arange(0, BLOCK_K)
    kmask = offs < K
    x = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
    if XQ:  # FP8 values times their scale: what act_round below gives
        return x * s, offs, kmask
    if NORM:
        nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0)
        x = rnd_bf16(rnd_bf16(x * inv_rms) * nw.to(tl.float32))
    if ACT:
        x = act_round(x, inv_s).to(tl.float32) * s
    return x, offs, kmask


@triton.jit
def _first_tile(w_ptr, rows, rmask, K, BLOCK_K: tl.constexpr):
    # the first BLOCK_K columns of these rows, issued before the PDL wait and the input's prologue so
    # that the weight stream's first DRAM round trip overlaps them (as gemv.py's kernels do)
    k0 = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0[None, :], mask=rmask[:, None] & (k0 < K)[None, :],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def _rows_dot(x_ptr, nw_ptr, w_ptr, rows, rmask, K, inv_rms, s, inv_s, w0, NORM: tl.constexpr, ACT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    x0, _, _ = _x_tile(x_ptr, nw_ptr, 0, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K)
    acc = w0.to(tl.float32) * x0[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, N, K, eps,
                     NORM: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
                     K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr, AMAX: tl.constexpr = 0, AMAX_POW2: tl.constexpr = 1):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w0 = _first_tile(w_ptr, rows, rmask, K, BLOCK_K)
    ws = tl.load(ws_ptr + rows, mask=rmask, other=0.0)
    if BIAS:
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if PDL:  # weights and scales are never written: only x and the outputs wait for the previous kernel
        gdc_wait()
    inv_rms, s, inv_s = _prologue(x_ptr, nw_ptr, K, eps, NORM, ACT, K_POW2, False, AMAX, AMAX_POW2)
    y = _rows_dot(x_ptr, nw_ptr, w_ptr, rows, rmask, K, inv_rms, s, inv_s, w0, NORM, ACT, BLOCK_N, BLOCK_K, STAGES)
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
def _pair_dot(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, inv_rms, s, inv_s, wa0, wb0, NORM: tl.constexpr,
              ACT: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, XQ: tl.constexpr = False):
    # fp32 sums of two row sets (gate/up, or a head's rope halves) against the input, every weight read once
    x0, _, _ = _x_tile(x_ptr, nw_ptr, 0, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K, XQ)
    acc_a = wa0.to(tl.float32) * x0[None, :]
    acc_b = wb0.to(tl.float32) * x0[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _x_tile(x_ptr, nw_ptr, k, K, inv_rms, s, inv_s, NORM, ACT, BLOCK_K, XQ)
        wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wb = tl.load(w_ptr + rows_b[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_a += wa.to(tl.float32) * x[None, :]
        acc_b += wb.to(tl.float32) * x[None, :]
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def _gemv_fp8_silu_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, nw_ptr, I, K, eps,
                          NORM: tl.constexpr, ACT: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, XQ: tl.constexpr = False,
                          amax_ptr=None, AMAX_OUT: tl.constexpr = False):
    # AMAX_OUT: program p's largest |out| into amax_ptr[p] (a plain store: no atomics, nothing to reset), from
    # which the next GEMV takes its activation scale without reducing the whole vector in each of its programs
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # I % BLOCK_N == 0
    all_rows = rows >= 0
    wg0 = _first_tile(w_ptr, rows, all_rows, K, BLOCK_K)
    wu0 = _first_tile(w_ptr, rows + I, all_rows, K, BLOCK_K)
    ws_g = tl.load(ws_ptr + rows)
    ws_u = tl.load(ws_ptr + rows + I)
    if PDL:
        gdc_wait()
    inv_rms, s, inv_s = _prologue(x_ptr, nw_ptr, K, eps, NORM, ACT, K_POW2, XQ)
    g, u = _pair_dot(x_ptr, nw_ptr, w_ptr, rows, rows + I, K, inv_rms, s, inv_s, wg0, wu0, NORM, ACT, BLOCK_K, STAGES,
                     XQ)
    if PDL:
        gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    g = round_to_dtype(g * ws_g, dt)
    u = round_to_dtype(u * ws_u, dt)
    sg = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
    y = (sg * u).to(dt)
    tl.store(out_ptr + rows, y)
    if AMAX_OUT:
        tl.store(amax_ptr + pid, tl.max(tl.abs(y.to(tl.float32)), axis=0))


@triton.jit
def _gemv_fp8_qkv_rope_kernel(x_ptr, w_ptr, ws_ptr, nw_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                              cos_ptr, sin_ptr, K, eps, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, ROPE: tl.constexpr,
                              ACT: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                              POS_EARLY: tl.constexpr, KV_FMT: tl.constexpr, inv_k=1.0, inv_v=1.0,
                              XQ: tl.constexpr = False):
    # gemv.py's _gemv_qkv_rope_kernel over an FP8 wqkv: program = BLOCK_N rows of one head's first half
    # and their rope partners; the epilogue (scale, bias, rounding, rope, q / cache stores) is gemv.qkv_store's
    HALF: tl.constexpr = HEAD_DIM // 2
    head, j, rows_a = head_half_rows(HEAD_DIM, BLOCK_N)
    all_rows = rows_a >= 0
    wa0 = _first_tile(w_ptr, rows_a, all_rows, K, BLOCK_K)
    wb0 = _first_tile(w_ptr, rows_a + HALF, all_rows, K, BLOCK_K)
    ws_a = tl.load(ws_ptr + rows_a)
    ws_b = tl.load(ws_ptr + rows_a + HALF)
    if BIAS:
        bias_a = tl.load(bias_ptr + rows_a).to(tl.float32)
        bias_b = tl.load(bias_ptr + rows_a + HALF).to(tl.float32)
    if POS_EARLY:  # the position and its rope rows before the wait (not in a step's first layer, which
        pos = tl.load(pos_ptr)  # follows the kernel that advances pos)
        if ROPE:
            cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
            sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
    if PDL:
        gdc_wait()
    inv_rms, s, inv_s = _prologue(x_ptr, nw_ptr, K, eps, NORM, ACT, K_POW2, XQ)
    a, b = _pair_dot(x_ptr, nw_ptr, w_ptr, rows_a, rows_a + HALF, K, inv_rms, s, inv_s, wa0, wb0, NORM, ACT,
                     BLOCK_K, STAGES, XQ)
    if PDL:
        gdc_launch_dependents()
    a = a * ws_a
    b = b * ws_b
    if BIAS:
        a += bias_a
        b += bias_b
    if not POS_EARLY:
        pos = tl.load(pos_ptr)
        if ROPE:
            cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
            sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
    if not ROPE:
        cos = 0.0
        sin = 0.0
    qkv_store(a, b, head, j, pos, cos, sin, q_ptr, k_cache_ptr, v_cache_ptr, inv_k, inv_v, NUM_Q_HEADS, NUM_KV_HEADS,
              HEAD_DIM, ROPE, KV_FMT)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, *,
             norm_w: torch.Tensor | None = None, eps: float = 1e-5, residual: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, act: bool = False, block_n: int = 16, block_k: int = 512,
             num_warps: int = 4, stages: int = 1, pdl: bool = False, prefetch: int = 0,
             amax: torch.Tensor | None = None) -> torch.Tensor:
    """out[N] = [residual +] round(scale * (W8[N, K] @ q([rmsnorm(x) * norm_w | x])) [+ bias]); q is the FP8
    activation rounding when ``act``. ``amax`` (act, no norm_w): float32 [P], the largest |x| of each of P parts
    of x, written by the kernel that wrote x (gemv_fp8_silu's ``amax_out``, the attention's ``amax``); their max
    is x's, so each program reduces P values in place of x's K; the same scale. ``prefetch`` is accepted for
    gemv.py's tile kwargs and unused."""
    n, k = w.shape
    if amax is not None and (not act or norm_w is not None):
        raise ValueError("amax gives the activation scale of an un-normed input: act=True without norm_w")
    nw = norm_w if norm_w is not None else (amax if amax is not None else x)
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, w, w_scale, out, residual if residual is not None else out, nw,
        bias if bias is not None else x, n, k, eps, NORM=norm_w is not None, RESIDUAL=residual is not None,
        BIAS=bias is not None, ACT=act, K_POW2=_pow2(k), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        AMAX=amax.numel() if amax is not None else 0, AMAX_POW2=_pow2(amax.numel()) if amax is not None else 1,
        num_warps=num_warps, **launch_opts(pdl))
    return out


def gemv_fp8_silu(x: torch.Tensor, w_gate_up: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, *,
                  norm_w: torch.Tensor | None = None, eps: float = 1e-5, act: bool = False, block_n: int = 16,
                  block_k: int = 512, num_warps: int = 4, stages: int = 1, pdl: bool = False,
                  prefetch: int = 0, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                  amax_out: torch.Tensor | None = None) -> torch.Tensor:
    """out[I] = silu(gate) * up of the FP8 [2I, K] weight, as gemv.gemv_silu computes it from bf16. ``xq``: the
    input already normed and rounded per token (:func:`round_token`'s FP8 values and scale) in place of x.
    ``amax_out`` (float32, at least I / block_n): program p's largest |out| into amax_out[p], for the down GEMV's
    ``amax`` (amax_out[:I // block_n])."""
    two_i, k = w_gate_up.shape
    if xq is not None:
        x, norm_w, act = xq[0], xq[1], False
    inter = two_i // 2
    if inter % block_n:
        raise ValueError(f"intermediate size {inter} is not a multiple of block_n {block_n}")
    if amax_out is not None and amax_out.numel() < inter // block_n:
        raise ValueError(f"amax_out holds {amax_out.numel()} values for {inter // block_n} programs")
    _gemv_fp8_silu_kernel[(inter // block_n,)](
        x, w_gate_up, w_scale, out, norm_w if norm_w is not None else x, inter, k, eps,
        NORM=norm_w is not None and xq is None, ACT=act, K_POW2=_pow2(k), BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, PDL=pdl, XQ=xq is not None, amax_ptr=amax_out, AMAX_OUT=amax_out is not None,
        num_warps=num_warps, **launch_opts(pdl))
    return out


def gemv_fp8_qkv_rope(x: torch.Tensor, wqkv: torch.Tensor, w_scale: torch.Tensor, norm_w: torch.Tensor | None,
                      eps: float, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int,
                      num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None, rope: bool = True,
                      act: bool = False, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
                      stages: int = 1, pdl: bool = False, pos_early: bool = False, kv_fmt: int = 0,
                      inv_k: float = 1.0, inv_v: float = 1.0,
                      xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """gemv.gemv_qkv_rope over an FP8 wqkv with per-row scales (and the FP8 activation rounding when ``act``):
    one launch where gemv_fp8 + smallops.rope_cache_write take two, the same values. ``xq``: the input already
    normed and rounded per token (:func:`round_token`'s FP8 values and scale) in place of x."""
    if xq is not None:
        x, norm_w, act = xq[0], xq[1], False
    half = head_dim // 2
    if half % block_n:
        raise ValueError(f"head_dim/2 = {half} is not a multiple of block_n {block_n}")
    num_heads = num_q_heads + 2 * num_kv_heads
    if wqkv.shape[0] != num_heads * head_dim:
        raise ValueError(f"wqkv has {wqkv.shape[0]} rows, expected (Hq + 2*Hkv) * D = {num_heads * head_dim}")
    k = wqkv.shape[1]
    _gemv_fp8_qkv_rope_kernel[(num_heads * (half // block_n),)](
        x, wqkv, w_scale, norm_w if norm_w is not None else x, bias if bias is not None else x, q_out, k_cache,
        v_cache, pos, cos, sin, k, eps, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        NORM=norm_w is not None and xq is None, BIAS=bias is not None, ROPE=rope, ACT=act, K_POW2=_pow2(k),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl, POS_EARLY=pos_early, KV_FMT=kv_fmt, inv_k=inv_k,
        inv_v=inv_v, XQ=xq is not None, num_warps=num_warps, **launch_opts(pdl))


# ---------------------------------------------------------------- block-scaled gate/up + SiLU, one token
@triton.jit
def _x_groups(x_ptr, nw_ptr, offs, K, inv, NORM: tl.constexpr):
    # one token's input columns ``offs`` [G, SK], normed at HF's rounding points when NORM (bf16 values)
    kmask = offs < K
    x = tl.load(x_ptr + offs, mask=kmask, other=0.0)
    if NORM:
        x = rms_scaled(x, inv, tl.load(nw_ptr + offs, mask=kmask, other=0.0))
    return x


@triton.jit
def _rounded_groups(x_ptr, xs_ptr, nw_ptr, offs, k, K, inv, NORM: tl.constexpr, XQ: tl.constexpr, G: tl.constexpr,
                    SK: tl.constexpr):
    # one token's input columns ``offs`` [G, SK] rounded per group (fp8block.round_groups' values): rounded here, or
    # (XQ) as _quant_groups_kernel left them, FP8 values and a scale a group
    if XQ:
        g = k // SK + tl.arange(0, G)
        q = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        return q * tl.load(xs_ptr + g, mask=g * SK < K, other=0.0)[:, None]
    return round_groups(_x_groups(x_ptr, nw_ptr, offs, K, inv, NORM))


@triton.jit
def _block_tile(w_ptr, rows, offs, K):
    # rows x columns ``offs`` [G, SK] of an FP8 W [N, K] (every row valid), streamed once
    return tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + offs[None, :, :], mask=(offs < K)[None, :, :],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def _pair_rows_block(x_ptr, xs_ptr, nw_ptr, w_ptr, s_ptr, rows_a, rows_b, srow_a, srow_b, wa, wb, K, KB, inv,
                     NORM: tl.constexpr, XQ: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, SK: tl.constexpr,
                     STAGES: tl.constexpr):
    # fp32 row sums of two row sets of a block-scaled FP8 W (gate and up, or a head's rope halves; each set in its
    # scale row) against one token's input rounded per group once a K step for both (_rounded_groups); the first
    # tiles wa / wb loaded by the caller (before its wait)
    BLOCK_K: tl.constexpr = G * SK
    xq = _rounded_groups(x_ptr, xs_ptr, nw_ptr, group_offs(0, G, SK), 0, K, inv, NORM, XQ, G, SK)
    acc_a = fp8_fma_rounded(tl.zeros((BLOCK_N, G, SK), tl.float32), wa, xq, s_ptr, srow_a, 0, K, KB, G, SK)
    acc_b = fp8_fma_rounded(tl.zeros((BLOCK_N, G, SK), tl.float32), wb, xq, s_ptr, srow_b, 0, K, KB, G, SK)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        offs = group_offs(k, G, SK)
        wa = _block_tile(w_ptr, rows_a, offs, K)
        wb = _block_tile(w_ptr, rows_b, offs, K)
        xq = _rounded_groups(x_ptr, xs_ptr, nw_ptr, offs, k, K, inv, NORM, XQ, G, SK)
        acc_a = fp8_fma_rounded(acc_a, wa, xq, s_ptr, srow_a, k, K, KB, G, SK)
        acc_b = fp8_fma_rounded(acc_b, wb, xq, s_ptr, srow_b, k, K, KB, G, SK)
    return tl.sum(tl.sum(acc_a, axis=2), axis=1), tl.sum(tl.sum(acc_b, axis=2), axis=1)


@triton.jit
def _quant_groups_kernel(x_ptr, nw_ptr, q_ptr, xs_ptr, K, eps, NORM: tl.constexpr, K_POW2: tl.constexpr,
                         SK: tl.constexpr, PDL: tl.constexpr):
    # program g: input group g ([g SK, (g + 1) SK), normed first when NORM: each program sums the whole input's
    # squares) through vLLM's FP8 rounding: its FP8 values into q_ptr and its scale into xs_ptr[g], the numbers
    # fp8block.round_groups makes of the same group inside a GEMV
    g = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    inv = 1.0
    if NORM:
        inv = _inv_rms(x_ptr, K, eps, K_POW2)
    offs = g * SK + tl.arange(0, SK)
    x = _x_groups(x_ptr, nw_ptr, offs, K, inv, NORM).to(tl.float32)
    sx = act_scale(tl.max(tl.abs(x), axis=0))
    tl.store(q_ptr + offs, act_round(x, 1.0 / sx), mask=offs < K)
    tl.store(xs_ptr + g, sx)


def quant_groups(x: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, group: int, *, norm_w: torch.Tensor | None = None,
                 eps: float = 1e-6, pdl: bool = False) -> None:
    """One token's x [K] ([rmsnorm(x) * norm_w]) rounded to FP8 per ``group`` features as vLLM's W8A8 block path
    rounds a GEMV's input: its FP8 values into q [K] (float8_e4m3fn) and a float32 scale a group into xs
    [ceil(K / group)], for the block-scaled GEMVs that read a rounded input (``xq``)."""
    k = x.shape[-1]
    _quant_groups_kernel[(triton.cdiv(k, group),)](
        x, norm_w if norm_w is not None else x, q, xs, k, eps, NORM=norm_w is not None, K_POW2=_pow2(k), SK=group,
        PDL=pdl, num_warps=4, **launch_opts(pdl))


def round_token(x: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, *, norm_w: torch.Tensor | None = None,
                eps: float = 1e-6, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's x [K] ([rmsnorm(x) * norm_w]) rounded to FP8 with one scale (FP8_DYNAMIC, as the per-channel
    GEMVs' prologue rounds it): :func:`quant_groups` over the whole vector, one program. Returns (q, xs[:1]), the
    ``xq`` of gemv_fp8_silu / gemv_fp8_qkv_rope."""
    k = x.shape[-1]
    quant_groups(x, q[:k], xs[:1], _pow2(k), norm_w=norm_w, eps=eps, pdl=pdl)
    return q[:k], xs[:1]


@triton.jit
def _gemv_fp8block_xq_kernel(q_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, res_ptr, N, K, KB, RESIDUAL: tl.constexpr,
                             BLOCK_N: tl.constexpr, G: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr,
                             STAGES: tl.constexpr, PDL: tl.constexpr):
    # moe.gemv_rows' one-token grouped tile over a block-scaled FP8 W [N, K] (rows of a program in one scale row),
    # its input arriving rounded (q_ptr FP8 values, xs_ptr a scale a group): the GEMV streams weights from its wait
    BLOCK_K: tl.constexpr = G * SK
    pid = tl.program_id(0)
    srow = (pid * BLOCK_N) // SG
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    offs = group_offs(0, G, SK)
    w = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + offs[None, :, :],
                mask=rmask[:, None, None] & (offs < K)[None, :, :], other=0.0, eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    xq = _rounded_groups(q_ptr, xs_ptr, q_ptr, offs, 0, K, 1.0, False, True, G, SK)
    acc = fp8_fma_rounded(tl.zeros((BLOCK_N, G, SK), tl.float32), w, xq, s_ptr, srow, 0, K, KB, G, SK)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        offs = group_offs(k, G, SK)
        w = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + offs[None, :, :],
                    mask=rmask[:, None, None] & (offs < K)[None, :, :], other=0.0, eviction_policy="evict_first")
        xq = _rounded_groups(q_ptr, xs_ptr, q_ptr, offs, k, K, 1.0, False, True, G, SK)
        acc = fp8_fma_rounded(acc, w, xq, s_ptr, srow, k, K, KB, G, SK)
    if PDL:
        gdc_launch_dependents()
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if RESIDUAL:
        r = tl.load(res_ptr + rows, mask=rmask, other=0.0)
        y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


def gemv_fp8block_xq(q: torch.Tensor, xs: torch.Tensor, w: BlockFp8, out: torch.Tensor, *,
                     residual: torch.Tensor | None = None, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
                     stages: int = 3, pdl: bool = False) -> torch.Tensor:
    """out[N] = [residual +] W x of one token over a block-scaled FP8 W whose input :func:`quant_groups` rounded
    (q its FP8 values, xs a scale a group of ``w.cols``): gemv_rows' values over the same K tile. ``block_n`` rows a
    program (cut to the scale rows), ``block_k`` a whole number of groups."""
    if not w.act:
        raise ValueError("gemv_fp8block_xq: the input is rounded per group only where the checkpoint does (act)")
    n, k = w.shape
    block_n, block_k = min(block_n, w.rows), max(w.cols, block_k // w.cols * w.cols)
    _gemv_fp8block_xq_kernel[(triton.cdiv(n, block_n),)](
        q, xs, w.w, w.scale, out, residual if residual is not None else out, n, k, w.scale.shape[-1],
        RESIDUAL=residual is not None, BLOCK_N=block_n, G=block_k // w.cols, SK=w.cols, SG=w.rows, STAGES=stages,
        PDL=pdl, num_warps=num_warps, **launch_opts(pdl))
    return out


@triton.jit
def _gemv_fp8block_xq_qkv_rope_kernel(q_ptr, xs_ptr, w_ptr, s_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                                      cos_ptr, sin_ptr, K, KB, NUM_Q_HEADS: tl.constexpr,
                                      NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                                      G: tl.constexpr, SK: tl.constexpr, SG: tl.constexpr, STAGES: tl.constexpr,
                                      PDL: tl.constexpr, POS_EARLY: tl.constexpr, KV_FMT: tl.constexpr, inv_k=1.0,
                                      inv_v=1.0):
    # _gemv_fp8block_xq_kernel over wqkv as the per-channel _gemv_fp8_qkv_rope_kernel reads it: a program takes
    # BLOCK_N rows of one head's first half and their rope partners (each set in its scale row), the epilogue is
    # gemv.qkv_store's (rounding, rope, q and the K / V rows at pos)
    HALF: tl.constexpr = HEAD_DIM // 2
    head, j, rows_a = head_half_rows(HEAD_DIM, BLOCK_N)
    first = head * HEAD_DIM + (tl.program_id(0) % (HALF // BLOCK_N)) * BLOCK_N  # rows_a's first row
    srow_a = first // SG
    srow_b = (first + HALF) // SG
    offs = group_offs(0, G, SK)
    wa = _block_tile(w_ptr, rows_a, offs, K)
    wb = _block_tile(w_ptr, rows_a + HALF, offs, K)
    if POS_EARLY:  # the position and its rope rows before the wait (not in a step's first layer)
        pos = tl.load(pos_ptr)
        cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
    if PDL:
        gdc_wait()
    a, b = _pair_rows_block(q_ptr, xs_ptr, q_ptr, w_ptr, s_ptr, rows_a, rows_a + HALF, srow_a, srow_b, wa, wb, K, KB,
                            1.0, False, True, BLOCK_N, G, SK, STAGES)
    if PDL:
        gdc_launch_dependents()
    if not POS_EARLY:
        pos = tl.load(pos_ptr)
        cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
    qkv_store(a, b, head, j, pos, cos, sin, q_out_ptr, k_cache_ptr, v_cache_ptr, inv_k, inv_v, NUM_Q_HEADS,
              NUM_KV_HEADS, HEAD_DIM, True, KV_FMT)


def gemv_fp8block_xq_qkv_rope(q: torch.Tensor, xs: torch.Tensor, wqkv: BlockFp8, q_out: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                              block_n: int = 16, block_k: int = 512, num_warps: int = 4, stages: int = 3,
                              pdl: bool = False, pos_early: bool = False, kv_fmt: int = 0, inv_k: float = 1.0,
                              inv_v: float = 1.0) -> None:
    """gemv_fp8block_xq over wqkv with the rope and the q / K / V stores in its epilogue (a model without q/k norm):
    one launch where gemv_fp8block_xq + smallops.rope_cache_write take two, the same values. ``block_n`` rows of a
    head's half a program, cut to divide head_dim / 2 and the scale rows."""
    if not wqkv.act:
        raise ValueError("gemv_fp8block_xq_qkv_rope: the input is rounded per group only where the checkpoint does")
    half = head_dim // 2
    block_n = math.gcd(min(block_n, wqkv.rows), half)
    num_heads = num_q_heads + 2 * num_kv_heads
    if wqkv.shape[0] != num_heads * head_dim:
        raise ValueError(f"wqkv has {wqkv.shape[0]} rows, expected (Hq + 2*Hkv) * D = {num_heads * head_dim}")
    k = wqkv.shape[1]
    block_k = max(wqkv.cols, block_k // wqkv.cols * wqkv.cols)
    _gemv_fp8block_xq_qkv_rope_kernel[(num_heads * (half // block_n),)](
        q, xs, wqkv.w, wqkv.scale, q_out, k_cache, v_cache, pos, cos, sin, k, wqkv.scale.shape[-1],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n,
        G=block_k // wqkv.cols, SK=wqkv.cols, SG=wqkv.rows, STAGES=stages, PDL=pdl, POS_EARLY=pos_early,
        KV_FMT=kv_fmt, inv_k=inv_k, inv_v=inv_v, num_warps=num_warps, **launch_opts(pdl))


@triton.jit
def _gemv_fp8block_silu_kernel(x_ptr, w_ptr, s_ptr, out_ptr, nw_ptr, I, K, KB, eps, NORM: tl.constexpr,
                               K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, SK: tl.constexpr,
                               SG: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, XQ: tl.constexpr = False,
                               xs_ptr=None, QUANT: tl.constexpr = False, q_out_ptr=None, xs_out_ptr=None):
    # program p: gate rows [p BLOCK_N, (p + 1) BLOCK_N) and their up rows (+ I), each set in one scale row; the
    # input's groups rounded once a K step for both (moe.gemv_rows' grouped tile and arithmetic otherwise). XQ: the
    # input arrives rounded (x_ptr its FP8 values, xs_ptr a scale a group: _quant_groups_kernel). QUANT: the
    # program's BLOCK_N outputs are one activation group of the next GEMV: also rounded, into q_out_ptr / xs_out_ptr
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # I % BLOCK_N == 0
    srow_g = (pid * BLOCK_N) // SG
    srow_u = (pid * BLOCK_N + I) // SG
    # the first tiles before the wait: weights are never written, only x comes from the previous kernel
    offs = group_offs(0, G, SK)
    wg = _block_tile(w_ptr, rows, offs, K)
    wu = _block_tile(w_ptr, rows + I, offs, K)
    if PDL:
        gdc_wait()
    inv = 1.0
    if NORM:
        inv = _inv_rms(x_ptr, K, eps, K_POW2)
    g, u = _pair_rows_block(x_ptr, xs_ptr, nw_ptr, w_ptr, s_ptr, rows, rows + I, srow_g, srow_u, wg, wu, K, KB, inv,
                            NORM, XQ, BLOCK_N, G, SK, STAGES)
    if PDL:
        gdc_launch_dependents()
    # gemv_rows' row sums and bf16 outputs, then torch's silu(gate) * up rounding points (reference.silu_mul)
    g = rnd_bf16(g)
    u = rnd_bf16(u)
    sg = rnd_bf16(g / (1.0 + tl.exp(-g)))
    out = (sg * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, out)
    if QUANT:
        of = out.to(tl.float32)
        sx = act_scale(tl.max(tl.abs(of), axis=0))
        tl.store(q_out_ptr + rows, act_round(of, 1.0 / sx))
        tl.store(xs_out_ptr + pid, sx)


def gemv_fp8block_silu(x: torch.Tensor, w: BlockFp8, out: torch.Tensor, *, norm_w: torch.Tensor | None = None,
                       eps: float = 1e-6, block_n: int = 64, block_k: int = 128, num_warps: int = 4, stages: int = 4,
                       pdl: bool = False, xs: torch.Tensor | None = None,
                       quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[I] = silu(gate) * up of one token over a block-scaled FP8 gate/up [2I, K] whose activations are rounded per
    group (W8A8 block checkpoints: Qwen's FP8 releases): one launch where ``gemv_rows`` + ``reference.silu_mul`` take
    three, the same values (with the same K tile). ``block_n`` gate rows (and as many up rows) a program, cut to the
    scale rows; ``block_k`` cut as fp8block.tile cuts it for two accumulators. With ``xs``, x is the input as
    :func:`quant_groups` rounded it (FP8 values, ``xs`` a scale a group; no ``norm_w``: the rounding normed it).
    ``quant=(q, xs_out)``: out also rounded in groups of ``block_n`` (the down GEMV's input, when its block width is a
    program's rows), what quant_groups would make of it."""
    if not w.act:
        raise ValueError("gemv_fp8block_silu: weight-only block FP8 takes gemv_rows (its weights dequantized to bf16)")
    if xs is not None and norm_w is not None:
        raise ValueError("gemv_fp8block_silu: a rounded input (xs) was normed when it was rounded: no norm_w")
    two_i, k = w.shape
    inter = two_i // 2
    block_n, block_k = fp8block.tile(w, min(block_n, w.rows), block_k, dot=False, accumulators=2,
                                     act_rows=min(block_n, w.rows))
    if inter % block_n:
        raise ValueError(f"intermediate size {inter} is not a multiple of {block_n} rows a program")
    if quant is not None and quant[1].numel() != inter // block_n:
        raise ValueError(f"quant's scales hold {quant[1].numel()} groups: {inter // block_n} of {block_n} rows a "
                         "program are written")
    _gemv_fp8block_silu_kernel[(inter // block_n,)](
        x, w.w, w.scale, out, norm_w if norm_w is not None else x, inter, k, w.scale.shape[-1], eps,
        NORM=norm_w is not None, K_POW2=_pow2(k), BLOCK_N=block_n, G=block_k // w.cols, SK=w.cols, SG=w.rows,
        STAGES=stages, PDL=pdl, XQ=xs is not None, xs_ptr=xs, QUANT=quant is not None,
        q_out_ptr=quant[0] if quant is not None else None, xs_out_ptr=quant[1] if quant is not None else None,
        num_warps=num_warps, **launch_opts(pdl))
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


# ---------------------------------------------------------------- the FP8 batch-1 Llama-family step
class Fp8Scales:
    """One layer's per-row float32 scales (None: that projection is bf16, e.g. ``ignore``d), or, for a
    block-scaled checkpoint (the ``fp8`` method with ``weight_block_size``, as Qwen's and DeepSeek's FP8 releases
    ship), the projection itself as fp8block.BlockFp8 (its bytes and block scales)."""

    def __init__(self, wqkv=None, wo=None, w_gate_up=None, w_down=None):
        self.wqkv, self.wo, self.w_gate_up, self.w_down = wqkv, wo, w_gate_up, w_down

    def blocked(self) -> bool:
        return any(isinstance(v, BlockFp8) for v in vars(self).values())


class Fp8GqaDecoder(GqaDecoder):
    """GqaDecoder whose projections with a scale run the FP8 GEMVs above. Per layer: FP8 QKV GEMV
    (norm, bias, rope and the q / K / V stores fused, as the bf16 step's; with ``FastOptions.fp8_qkv_rope``
    off, or Qwen3's q/k norm over an FP8 KV cache, the GEMV + one small rope/q-k-norm/cache-write kernel),
    attention, FP8 o_proj (+ residual), FP8 gate/up +
    SiLU, FP8 down (+ residual); the lm_head stays bf16 (compressed-tensors ``ignore: [lm_head]``). With FP8_DYNAMIC
    activations the QKV and gate/up inputs are normed and rounded once before their GEMVs (round_token).
    ``act_fp8``: activations through FP8 per token (the checkpoint's FP8_DYNAMIC scheme)."""

    def __init__(self, model, k_caches, v_caches, cos, sin, options=None, max_steps: int = 4096, *,
                 scales: list[Fp8Scales], act_fp8: bool, kv_format: str | None = None,
                 kv_scales: list[tuple[float, float]] | None = None, kv_nearest: bool = False):
        if len(scales) != len(model.layers):
            raise ValueError(f"{len(scales)} layers of FP8 scales for {len(model.layers)} layers")
        self.scales, self.act_fp8 = scales, act_fp8  # before the base's set-up, which asks _norms_in_attention
        super().__init__(model, k_caches, v_caches, cos, sin, options, max_steps, kv_format, kv_scales,
                         kv_nearest=kv_nearest)
        # the rounded inputs' buffers (_xq_buffers; the per-channel step's round_token uses the first pair), before any
        # graph capture: two pairs of FP8 values and a scale a group (groups of 16 features at least), as long as the
        # longest GEMV input
        self._xq_pairs = None
        if any(sc.blocked() for sc in scales) or self._rounds_once():
            n = max(model.hidden, model.intermediate, model.num_q_heads * model.head_dim)
            self._xq_pairs = [(torch.zeros(n, dtype=torch.float8_e4m3fn, device=model.embed.device),
                               torch.zeros(-(-n // fp8block.MIN_ROWS), dtype=torch.float32, device=model.embed.device))
                              for _ in range(2)]
        # FastOptions.fp8_amax_carry: the largest |value| of each attention head's output (o's input) and of each
        # SiLU GEMV program's rows (down's), written by those kernels, read by the o / down GEMV of the same layer
        self._amax = None
        if self._carries_amax():
            parts = model.intermediate // self.opt.fp8_tiles["gate_up"][0]
            self._amax = (torch.zeros(model.num_q_heads, dtype=torch.float32, device=model.embed.device),
                          torch.zeros(parts, dtype=torch.float32, device=model.embed.device))

    def fp8_tile_kwargs(self, name: str) -> dict:
        """tile_kwargs for projection ``name`` in FP8 (FastOptions.fp8_tiles)."""
        bn, bk, nw, st = self.opt.fp8_tiles[name]
        return dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=self.opt.pdl)

    def _norms_in_attention(self, i: int) -> bool:
        if self.scales[i].wqkv is None:
            return super()._norms_in_attention(i)
        if isinstance(self.scales[i].wqkv, BlockFp8):
            return False  # the block-scaled QKV's rope kernel norms q/k (_block_layer)
        return (self.model.layers[i].q_norm is not None and self.opt.fp8_qkv_rope
                and self.opt.qk_norm_in in ("attention", "qkv") and not self.kv_fmt)  # no last-program norm in FP8

    def _rounds_once(self) -> bool:
        """Whether the per-channel step rounds its QKV and gate/up inputs once (FastOptions.fp8_round_once)."""
        return self.act_fp8 and self.opt.fp8_round_once

    def _carries_amax(self) -> bool:
        """Whether the o and down GEMVs take their input's scale from the per-part maxima their input's writer left
        (FastOptions.fp8_amax_carry): FP8_DYNAMIC activations and the attention in two launches (its merge writes
        o's)."""
        return self.act_fp8 and self.opt.fp8_amax_carry and not self.attn.one_launch

    def _rounded(self, norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residual normed and rounded once for the next GEMV (FastOptions.fp8_round_once), or None."""
        if not self._rounds_once():
            return None
        return round_token(self.residual, *self._xq_pairs[0], norm_w=norm_w, eps=self.model.eps, pdl=self.opt.pdl)

    def _qkv(self, i: int):
        sc = self.scales[i]
        if sc.wqkv is None:
            return super()._qkv(i)
        m, lw, eps = self.model, self.model.layers[i], self.model.eps
        if self.opt.fp8_qkv_rope and (lw.q_norm is None or self._norms_in_attention(i)):
            # one launch; Qwen3's q/k norm + rope then run in the attention (as the bf16 step does). A
            # program's rows lie in one head half: the tile's block_n cut to divide head_dim / 2
            tile = self.fp8_tile_kwargs("qkv")
            tile["block_n"] = math.gcd(tile["block_n"], m.head_dim // 2)
            gemv_fp8_qkv_rope(self.residual, lw.wqkv, sc.wqkv, lw.attn_norm, eps, self.query, self.k_caches[i],
                              self.v_caches[i], self.pos, self.cos, self.sin, num_q_heads=m.num_q_heads,
                              num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, bias=lw.bqkv,
                              rope=lw.q_norm is None, act=self.act_fp8, pos_early=i > 0, **tile,
                              xq=self._rounded(lw.attn_norm), **self.kv_kwargs(i))
            return (lw.q_norm, lw.k_norm, eps, self.cos, self.sin) if lw.q_norm is not None else None
        qkv = gemv_fp8(self.residual, lw.wqkv, sc.wqkv, self.tmp[: lw.wqkv.shape[0]], norm_w=lw.attn_norm,
                       eps=eps, bias=lw.bqkv, act=self.act_fp8, **self.fp8_tile_kwargs("qkv"))
        smallops.rope_cache_write(qkv, self.query, self.k_caches[i], self.v_caches[i], self.pos, self.cos,
                                  self.sin, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                                  head_dim=m.head_dim, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps,
                                  pdl=self.opt.pdl, **self.kv_kwargs(i))
        return None

    def layer(self, i: int) -> None:
        sc = self.scales[i]
        if sc.wqkv is None and sc.wo is None and sc.w_gate_up is None and sc.w_down is None:
            return super().layer(i)
        if sc.blocked():
            return self._block_layer(i)
        lw, eps, act = self.model.layers[i], self.model.eps, self.act_fp8
        # the o / down GEMVs' input scale from the per-part maxima their writer leaves (_carries_amax), where both
        # the writer and the reader are this step's FP8 kernels
        o_amax = self._amax[0] if self._amax is not None and sc.wo is not None else None
        down_amax = self._amax[1] if self._amax is not None and sc.w_gate_up is not None and sc.w_down is not None \
            else None
        qk_norm = self._qkv(i)
        self.attend(i, qk_norm, amax=o_amax)
        if sc.wo is not None:
            gemv_fp8(self.attn_out, lw.wo, sc.wo, self.residual, residual=self.residual, bias=lw.bo, act=act,
                     amax=o_amax, **self.fp8_tile_kwargs("o"))
        else:
            gemv.gemv(self.attn_out, lw.wo, self.residual, residual=self.residual, bias=lw.bo, **self.tile_kwargs("o"))
        if sc.w_gate_up is not None:
            gemv_fp8_silu(self.residual, lw.w_gate_up, sc.w_gate_up, self.act, norm_w=lw.mlp_norm, eps=eps, act=act,
                          xq=self._rounded(lw.mlp_norm), amax_out=down_amax, **self.fp8_tile_kwargs("gate_up"))
        else:
            gemv.gemv_silu(self.residual, lw.w_gate_up, self.act, norm_w=lw.mlp_norm, eps=eps,
                           norm_late=folds_norm(self.opt, "gate_up", False, self.kv_fmt), **self.tile_kwargs("gate_up"))
        if sc.w_down is not None:
            gemv_fp8(self.act, lw.w_down, sc.w_down, self.residual, residual=self.residual, act=act, amax=down_amax,
                     **self.fp8_tile_kwargs("down"))
        else:
            gemv.gemv(self.act, lw.w_down, self.residual, residual=self.residual, **self.tile_kwargs("down"))


    # block-scaled FP8 (one token): the DeepSeek-family block's GEMV (moe.gemv_rows: the FP8 bytes, the block scales
    # and the per-128-feature activation rounding in the kernel), each with its norm in the prologue and the
    # residual in the epilogue; rope, q/k norm and the cache write in one small kernel; gate/up and SiLU . up in
    # one launch (weight-only checkpoints: SiLU . up in torch)
    # each projection's (block_n, block_k, warps, stages): the DeepSeek-family one-token projections' tile; and
    # with activations rounded per group, the fewest rows a program (gemv_rows' fp8_rows). gate/up: 128 rows (one
    # scale row) over one 128-wide block a K step, each program's group rounding shared by 4x the rows (H100, run
    # G35: a Llama-3-8B step 5.515 -> 4.622 ms, 0.49 -> 0.59 of roofline; 64 x 256 4.907). QKV, o and down keep 32
    # rows: at 8, 16 or 64 their steps were slower (runs G30-G33; 128 x 128 for all four +44%)
    BLOCK_TILES: dict[str, tuple[int, int, int, int]] = {
        "wqkv": (8, 512, 4, 3), "wo": (8, 512, 4, 3), "w_gate_up": (8, 128, 4, 4), "w_down": (8, 512, 4, 3)}
    BLOCK_ACT_ROWS: dict[str, int] = {"wqkv": 32, "wo": 32, "w_gate_up": 128, "w_down": 32}
    # gate/up with activations rounded per group: one launch with the SiLU (gemv_fp8block_silu), 64 gate and 64 up
    # rows a program over one 128-wide block a K step (w_gate_up's 128 rows, split between the halves), where
    # gemv_rows + torch's silu and mul took three; None: those three (bench A/B)
    SILU_TILE: tuple[int, int, int, int] | None = (64, 128, 4, 4)

    def _block_gemv(self, name: str, x: torch.Tensor, w, out: torch.Tensor, **kw) -> None:
        bn, bk, nw, st = self.BLOCK_TILES[name]
        gemv_rows(x.view(1, -1), w, out.view(1, -1), block_n=bn, block_k=bk, num_warps=nw, stages=st,
                  pdl=self.opt.pdl, fp8_rows=self.BLOCK_ACT_ROWS[name], **kw)

    # every projection block-scaled with activations rounded per group (Qwen's FP8 releases): each GEMV input
    # rounded once, by quant_groups (norm included), the attention's merge (o's) or the gate/up kernel (down's), not
    # by every program of the GEMV a K step; the GEMVs then stream from their wait (H100, run G38: a Llama-3-8B step
    # 4.533 -> 3.809 ms; gate/up at 128 gate rows a program on 8 warps, which rounds down's input, 3.567).
    # (block_n, block_k, warps, stages) of the GEMVs over a rounded input; None: the rounding in the GEMVs
    XQ_TILES: dict[str, tuple[int, int, int, int]] | None = {
        "wqkv": (16, 512, 4, 3), "wo": (16, 512, 4, 3), "w_gate_up": (128, 128, 8, 3), "w_down": (16, 1024, 4, 3)}

    XQ_IN_ATTENTION = True  # o's input rounded by the attention's merge where a head is one group
    # without q/k norm: rope + q / K / V stores in the QKV GEMV (gemv_fp8block_xq_qkv_rope), one launch a layer less
    # (H100, run G39: 3.628 / 3.632 ms against the rope kernel's 3.675 / 3.685 in alternated rounds)
    XQ_QKV_ROPE = True

    def _xq_buffers(self, k: int, group: int, alt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A rounded input's FP8 values [k] and scales [ceil(k / group)]: two pairs of buffers, each reused by the
        step's GEMVs (a rounding runs after the GEMV that read the pair's last one); ``alt``, the second pair, for
        the down GEMV's input when the gate/up kernel, which reads the first, rounds it."""
        q, xs = self._xq_pairs[int(alt)]
        return q[:k], xs[: -(-k // group)]

    def _xq_gemv(self, name: str, x: torch.Tensor, w: BlockFp8, out: torch.Tensor | None, norm_w=None,
                 residual: torch.Tensor | None = None, rounded: bool = False, round_down: bool = False,
                 rope_layer: int | None = None) -> None:
        # ``rounded``: the kernel that wrote x rounded it (the attention's merge into the first pair, the gate/up
        # kernel into the second); ``round_down``: the gate/up kernel rounds the down GEMV's input (a program's gate
        # rows are one of its groups); ``rope_layer``: QKV with the rope and the q / K / V stores of that layer in its
        # epilogue (no ``out``)
        q, xs = self._xq_buffers(x.numel(), w.cols, rounded and name == "w_down")
        if not rounded:
            quant_groups(x, q, xs, w.cols, norm_w=norm_w, eps=self.model.eps, pdl=self.opt.pdl)
        bn, bk, nw, st = self.XQ_TILES[name]
        tile = dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=self.opt.pdl)
        if name == "w_gate_up":
            gemv_fp8block_silu(q, w, out, xs=xs, quant=self._xq_buffers(out.numel(), min(bn, w.rows), True)
                               if round_down else None, **tile)
        elif rope_layer is not None:
            m, i = self.model, rope_layer
            gemv_fp8block_xq_qkv_rope(q, xs, w, self.query, self.k_caches[i], self.v_caches[i], self.pos, self.cos,
                                      self.sin, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                                      head_dim=m.head_dim, pos_early=i > 0, **tile, **self.kv_kwargs(i))
        else:
            gemv_fp8block_xq(q, xs, w, out, residual=residual, **tile)

    def _block_layer(self, i: int) -> None:
        m, lw, sc, eps = self.model, self.model.layers[i], self.scales[i], self.model.eps
        pick = {n: getattr(sc, n) if getattr(sc, n) is not None else getattr(lw, n)
                for n in ("wqkv", "wo", "w_gate_up", "w_down")}
        if self.XQ_TILES is not None and all(isinstance(w, BlockFp8) and w.act for w in pick.values()):
            wqkv = pick["wqkv"]
            if lw.q_norm is None and self.XQ_QKV_ROPE:  # rope and the stores in the QKV GEMV's epilogue
                self._xq_gemv("wqkv", self.residual, wqkv, None, norm_w=lw.attn_norm, rope_layer=i)
            else:  # Qwen3's q/k norm in the rope kernel
                qkv = self.tmp[: wqkv.shape[0]]
                self._xq_gemv("wqkv", self.residual, wqkv, qkv, norm_w=lw.attn_norm)
                smallops.rope_cache_write(qkv, self.query, self.k_caches[i], self.v_caches[i], self.pos, self.cos,
                                          self.sin, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                                          head_dim=m.head_dim, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps,
                                          pdl=self.opt.pdl, **self.kv_kwargs(i))
            # o's input rounded by the attention's merge where a head is one activation group (Llama-3, Qwen3: 128)
            merged = self.XQ_IN_ATTENTION and m.head_dim == pick["wo"].cols and not self.attn.one_launch
            self.attend(i, None, quant=self._xq_buffers(self.attn_out.numel(), pick["wo"].cols) if merged else None)
            self._xq_gemv("wo", self.attn_out, pick["wo"], self.residual, residual=self.residual, rounded=merged)
            # down's input rounded by the gate/up kernel where its programs' gate rows (the tile's, cut to the scale
            # rows as gemv_fp8block_silu cuts them) are one of down's groups
            gu = pick["w_gate_up"]
            round_down = min(self.XQ_TILES["w_gate_up"][0], gu.rows) == pick["w_down"].cols
            self._xq_gemv("w_gate_up", self.residual, gu, self.act, norm_w=lw.mlp_norm, round_down=round_down)
            self._xq_gemv("w_down", self.act, pick["w_down"], self.residual, residual=self.residual,
                          rounded=round_down)
            return
        qkv = self.tmp[: pick["wqkv"].shape[0]]
        self._block_gemv("wqkv", self.residual, pick["wqkv"], qkv, norm_w=lw.attn_norm, eps=eps)
        smallops.rope_cache_write(qkv, self.query, self.k_caches[i], self.v_caches[i], self.pos, self.cos, self.sin,
                                  num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                  q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps, pdl=self.opt.pdl, **self.kv_kwargs(i))
        self.attend(i, None)
        self._block_gemv("wo", self.attn_out, pick["wo"], self.residual, residual=self.residual.view(1, -1))
        gw = pick["w_gate_up"]
        if self.SILU_TILE is not None and isinstance(gw, BlockFp8) and gw.act:
            bn, bk, nw, st = self.SILU_TILE
            gemv_fp8block_silu(self.residual, gw, self.act, norm_w=lw.mlp_norm, eps=eps, block_n=bn, block_k=bk,
                               num_warps=nw, stages=st, pdl=self.opt.pdl)
        else:
            gu = self.tmp[: gw.shape[0]]
            self._block_gemv("w_gate_up", self.residual, gw, gu, norm_w=lw.mlp_norm, eps=eps)
            reference.silu_mul(gu, out=self.act)
        self._block_gemv("w_down", self.act, pick["w_down"], self.residual, residual=self.residual.view(1, -1))


def fp8_bytes_per_step(model, scales: list[Fp8Scales]) -> int:
    """Bytes one batch-1 step reads from weights: GqaModel.weight_bytes (FP8 weights at one byte, bf16
    modules at two) plus the FP8 scales."""
    def scale_bytes(t) -> int:
        t = t.scale if isinstance(t, BlockFp8) else t
        return t.numel() * t.element_size()

    return model.weight_bytes() + sum(scale_bytes(t) for sc in scales for t in vars(sc).values() if t is not None)
