"""The GQA (Llama-family) decode step of several slots at once: one CUDA graph per padded batch size.

``GqaBatchDecoder(model, k_caches, v_caches, cos, sin, batch)`` decodes ``batch`` rows per step; row
``b`` decodes slot ``slots[b]`` from token ``token[b]`` at position ``pos[b]``, all three device
tensors, so the rows' slots and positions change between replays with no re-capture. The caches are
the engine's whole per-layer tensors ``[num_slots + 1, max_tokens, Hkv, D]``; a padded row decodes on
the scratch slot (the last), where its writes are harmless.

Per layer, nine launches whatever the batch (weights read once per step for every row):
  1-3. RMSNorm of the rows; QKV GEMV over B rows (+ bias); rope (Qwen3: q/k norm first) + K/V write
       into each row's slot (rmsnorm_rows; rows_gemv; rope_rows). ``FastOptions.batch_fused_rope``
       moves the rope into the GEMV's epilogue (rows_qkv_rope: paired rows d, d + D/2 of a head per
       program, as the batch-1 kernel; not for Qwen3), one launch fewer but 38-48 us slower a 4-row
       step on the H200 (runs F2, B5): off by default
  4-5. split-K attention over each row's own cache and length, merge     (DecodeAttention, slot_ids;
       one launch with ``FastOptions.attn_one_launch``)
  6. o_proj GEMV (+ bias) + residual add                                 (rows_gemv, RESIDUAL)
  7-8. RMSNorm; gate/up GEMV + SiLU-mul                                  (rows_gemv, SILU)
  9. down GEMV + residual add                                            (rows_gemv, RESIDUAL)
The rows' tokens, positions and slots come from the host through ``set_rows`` (one async copy) and
are applied by the step's first kernel, once per ``set_rows``. An FP8 KV cache (``kv_format``, as
GqaDecoder): rope_rows writes each row's K/V as vLLM's FP8 bytes and the attention reads them
(``FastOptions.fp8_kv_attn``'s splits and tile); the fused rope epilogue is not used then. FP8 weights
(``fp8_scales``, fp8.Fp8Scales per layer; ``act_fp8`` for FP8_DYNAMIC checkpoints): each FP8 GEMV's input
rows quantized once (quant_rows, one small launch), then rows_gemv's FP8 mode.
then final norm + lm_head GEMV with per-row block maxima, and the per-row greedy finish (token,
``out_tokens[b, step]``, position + 1, next embedding); or, with ``step(sample=True)``, each row's
sampling kernels (cuda/sampling.py) over its slot's row of the engine's SamplingBuffers (the row
index read from ``slots`` on device).

The GEMVs (``rows_gemv``) load every weight tile once and multiply it with all B rows: tensor-core
dots ``W @ x^T`` with the rows padded to 16 (bf16 in, fp32 sums; fp32 operands under Triton's
interpreter; ``FastOptions.batch_mode``), the same rounding points as the batch-1 kernels of gemv.py
(their torch twins in reference.py). The norms run as their own small launch: a norm prologue in every
GEMV program (each re-reading all B rows before its weight stream) measured 2x slower on the H200, and
normalising the rows on load with statistics the GEMV before left in its epilogue (no re-read, two
launches a layer fewer) made the 4-row step 1.24x slower (run B4): scaling x inside the loop costs the
tensor-core loop its pipelining. The norm by the o / down GEMV's last program to finish (an atomic
count; 64 launches fewer a Llama-3-8B step) made it 1.21x against 1.16x (run B5): one program normalising
every row serially costs more than the launch it saves.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import reference
from .attention import DecodeAttention
from .fp8 import act_round, act_scale
from .fp8block import BlockFp8
from .gemv import gdc_launch_dependents, gdc_wait, interpreting, l2_prefetch_tiles, launch_opts
from .kernel_helpers import prefetch_l2, rms_scaled, rope_pair, round_to_dtype
from .kvfp8 import fp8_kv_load, kv_cache_setup
from .llama import FastOptions, GqaModel, folds_norm
from .moe import gemv_rows, mma
from .smallops import norm_late_rows, norm_rope_cache_head, rmsnorm_rows, rope_cache_head

MAX_BATCH = 8
BATCH_SIZES = (2, 4, 8)  # padded batch sizes, one graph each
DOT_ROWS = 16  # rows padded to one tensor-core tile


def padded_batch(n: int) -> int:
    """The graph size serving n active rows (2, 4 or 8)."""
    for b in BATCH_SIZES:
        if n <= b:
            return b
    raise ValueError(f"{n} rows: the batched step takes at most {MAX_BATCH}")


@triton.jit
def _mma_t(w, x, acc, UPCAST: tl.constexpr):
    """acc + w [N, K] @ x[M, K]^T (the weights as the A operand), as moe.mma."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x.to(w.dtype)), acc)


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, amax_val_ptr, amax_idx_ptr, N, K, eps,
                      stride_x, stride_o, stride_a,
                      T: tl.constexpr, T_PAD: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                      RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, SILU: tl.constexpr, MODE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH: tl.constexpr = 0, ws_ptr=None, xs_ptr=None,
                      FP8: tl.constexpr = False, rs_ptr=None, ROW_SCALE: tl.constexpr = False):
    # MODE 0: acc[T, N] = dot(x, w^T); 1: acc^T[N, T] = dot(w, x^T) (the weights as the A operand);
    # 2: fp32 FMAs into [T, BLOCK_N, BLOCK_K] (T_PAD = next power of two of T, no padding to 16).
    # FP8 (MODE 1): w holds E4M3 bytes with per-row fp32 scales at ws_ptr, read as fp16 (exact); x is fp16 rows
    # from quant_rows (each row over its own scale at xs_ptr); both scales are applied after the dot.
    # ROW_SCALE: each row's sums times rs_ptr[t] after the loop (the folded norm: x = round(x * nw) and rs = 1 / rms
    # from smallops.norm_late_rows, as the one-token GEMVs fold it, gemv._gemv_pair_loop_late_norm)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # SILU: gate rows; the up rows are rows + N
    rmask = rows < N
    t = tl.arange(0, T_PAD)
    tmask = t < T
    if BIAS:  # a weight: loaded before waiting on the previous kernel
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if PREFETCH:  # the first weight tiles into L2 during the previous kernel's tail
        prefetch_l2(w_ptr, rows, rmask, K, PREFETCH, BLOCK_K, 0)
        if SILU:
            prefetch_l2(w_ptr, rows + N, rmask, K, PREFETCH, BLOCK_K, 0)
    if PDL:
        gdc_wait()
    inv = tl.full((T_PAD,), 1.0, tl.float32)
    if NORM:  # RMSNorm statistics per row, tile by tile
        ss = tl.zeros((T_PAD,), tl.float32)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + t[:, None] * stride_x + offs[None, :], mask=tmask[:, None] & (offs < K)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    if FP8:
        x_scale = tl.load(xs_ptr + t, mask=tmask, other=1.0)
        ws = tl.load(ws_ptr + rows, mask=rmask, other=0.0)
        if SILU:
            ws_u = tl.load(ws_ptr + rows + N, mask=rmask, other=0.0)
    acc = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    acc_tu = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    acc3 = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3_u = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK_K)
        kmask = offs < K
        x = tl.load(x_ptr + t[:, None] * stride_x + offs[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0)
            x = rms_scaled(x, inv[:, None], nw[None, :])
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0, eviction_policy="evict_first")
        if FP8:
            w = fp8_kv_load(w, 1)  # Triton's conversion: in the dot operand's layout, fewer moves than unpacking
        if MODE == 0:
            acc = mma(x, w, acc, UPCAST)
        elif MODE == 1:
            acc_t = _mma_t(w, x, acc_t, UPCAST)
        else:
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if SILU:
            wu = tl.load(w_ptr + (rows + N)[:, None].to(tl.int64) * K + offs[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0, eviction_policy="evict_first")
            if FP8:
                wu = fp8_kv_load(wu, 1)
            if MODE == 0:
                acc_u = mma(x, wu, acc_u, UPCAST)
            elif MODE == 1:
                acc_tu = _mma_t(wu, x, acc_tu, UPCAST)
            else:
                acc3_u += wu.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if PDL:
        gdc_launch_dependents()
    if FP8:  # the weights' row scales and the rows' input scales, after the dot
        acc_t = acc_t * ws[:, None] * x_scale[None, :]
        if SILU:
            acc_tu = acc_tu * ws_u[:, None] * x_scale[None, :]
    if MODE == 1:
        acc = tl.trans(acc_t)
        acc_u = tl.trans(acc_tu)
    elif MODE == 2:
        acc = tl.sum(acc3, axis=2)
        acc_u = tl.sum(acc3_u, axis=2)
    if ROW_SCALE:
        inv = tl.load(rs_ptr + t, mask=tmask, other=1.0)
        acc = acc * inv[:, None]
        acc_u = acc_u * inv[:, None]
    dt = out_ptr.dtype.element_ty
    omask = tmask[:, None] & rmask[None, :]
    if SILU:
        g = round_to_dtype(acc, dt)
        s = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
        y = s * round_to_dtype(acc_u, dt)
    else:
        y = acc
        if BIAS:
            y += bias[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + t[:, None] * stride_o + rows[None, :], mask=omask, other=0.0)
            y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
    tl.store(out_ptr + t[:, None] * stride_o + rows[None, :], y.to(dt), mask=omask)
    if ARGMAX:  # greedy, stage 1: each row's best id in this block (ties -> lowest, as torch.argmax)
        yv = tl.where(omask, y.to(dt).to(tl.float32), float("-inf"))
        best = tl.argmax(yv, axis=1, tie_break_left=True)
        tl.store(amax_val_ptr + t * stride_a + pid, tl.max(yv, axis=1), mask=tmask)
        tl.store(amax_idx_ptr + t * stride_a + pid, pid * BLOCK_N + best, mask=tmask)


def rows_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, norm_w: torch.Tensor | None = None,
              eps: float = 1e-5, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              silu: bool = False, argmax_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
              block_n: int = 16, block_k: int = 256, num_warps: int = 4, stages: int = 4,
              pdl: bool = False, mode: int = 0, prefetch: int = 0, w_scale: torch.Tensor | None = None,
              x_scale: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[B, N] = [residual +] round(x'[B, K] @ W[N, K]^T [+ bias]), x' = rmsnorm(x) * norm_w when given;
    ``silu``: W is [2I, K] (gate | up), out[B, I] = silu(gate) * up; ``argmax_parts`` (val fp32, idx int32,
    each [B, >= cdiv(N, block_n)]): every block's max per row, for ``finish_rows``. B <= 16. ``mode``: the
    kernel's accumulation (0: x @ W^T on tensor cores, rows padded to 16; 1: W @ x^T likewise; 2: fp32 FMAs).
    ``w_scale`` (fp32 [N] or [2I]): W is float8_e4m3fn with these row scales (mode 1), and x the fp16 rows of
    :func:`quant_rows` with their scales ``x_scale`` (fp32 [B]). ``row_scale`` (fp32 [B]): each row's sums times it
    before the epilogue; with x and row_scale from smallops.norm_late_rows, the RMSNorm folded as the one-token
    GEMVs fold it (FastOptions.norm_late), its operand and 1 / rms computed once a step."""
    b, k = x.shape
    fp8 = w_scale is not None
    if fp8:
        if mode != 1 or norm_w is not None or argmax_parts is not None or x_scale is None:
            raise ValueError("FP8 weights in rows_gemv: mode 1, x from quant_rows with x_scale, no norm, no argmax")
        w = w.view(torch.uint8)
    n = w.shape[0] // 2 if silu else w.shape[0]
    if b > DOT_ROWS:
        raise ValueError(f"rows_gemv takes at most {DOT_ROWS} rows, got {b}")
    av, ai = argmax_parts if argmax_parts is not None else (out, out)
    _rows_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, residual if residual is not None else out, norm_w if norm_w is not None else x,
        bias if bias is not None else x, av, ai, n, k, eps, x.stride(0), out.stride(0),
        av.stride(0) if argmax_parts is not None else 0, T=b, T_PAD=DOT_ROWS if mode < 2 else triton.next_power_of_2(b),
        NORM=norm_w is not None, BIAS=bias is not None, RESIDUAL=residual is not None,
        ARGMAX=argmax_parts is not None, SILU=silu, MODE=mode,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, UPCAST=interpreting(), PDL=pdl,
        PREFETCH=l2_prefetch_tiles(prefetch, block_k), ws_ptr=w_scale if fp8 else x,
        xs_ptr=x_scale if fp8 else x, FP8=fp8, rs_ptr=row_scale if row_scale is not None else x,
        ROW_SCALE=row_scale is not None, num_warps=num_warps, **launch_opts(pdl))
    return out


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, ACT: tl.constexpr, K_POW2: tl.constexpr,
                       PDL: tl.constexpr):
    b = tl.program_id(0)
    if PDL:  # x comes from the previous kernel; the GEMV after us waits for all of us before reading q
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, K_POW2)
    m = offs < K
    x = tl.load(x_ptr + b * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    if ACT:  # FP8_DYNAMIC: the row's FP8 rounding (fp8.py's per-token scale), held as fp16 (exact)
        s = act_scale(amax)
        q = act_round(x, 1.0 / s)
    else:  # weight-only: the row's bf16 values shifted by a power of two that puts its largest at 2^14..2^15, so
        # that fp16 holds them exactly down to 2^-28 of it (below fp16's normal range a value would lose bits)
        s = tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1e-30))) - 14.0)
        q = x * (1.0 / s)
    tl.store(q_ptr + b * stride_q + offs, q.to(tl.float16), mask=m)
    tl.store(scale_ptr + b, s)


def quant_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, act: bool, pdl: bool = False) -> torch.Tensor:
    """The input rows of an FP8 rows_gemv, once per step and not in every GEMV program: q[b] (fp16) = x[b] over
    its scale ``scale[b]``, through FP8 (``act``: FP8_DYNAMIC activations, as fp8.py's kernels round them per
    token) or a power-of-two shift into fp16's range (weight-only FP8: the bf16 values exact, down to 2^-28 of
    the row's largest)."""
    k = x.shape[-1]
    _quant_rows_kernel[(x.shape[0],)](x, q, scale, k, x.stride(0), q.stride(0), ACT=act,
                                      K_POW2=triton.next_power_of_2(k), PDL=pdl, num_warps=8, **launch_opts(pdl))
    return q


@triton.jit
def _rows_qkv_rope_kernel(x_ptr, w_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                          K, stride_x, stride_q, stride_slot, T: tl.constexpr, T_PAD: tl.constexpr,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                          UPCAST: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0):
    # the QKV GEMV of every row (W @ x^T on tensor cores, as rows_gemv's mode 1) over paired rows d and
    # d + D/2 of one head, so the epilogue ropes them (rounded as rope_cache_head) and writes q, and
    # K/V into each row's slot at its position: rows_gemv + rope_rows in one launch
    HALF: tl.constexpr = HEAD_DIM // 2
    per_head: tl.constexpr = HALF // BLOCK_N
    pid = tl.program_id(0)
    head = pid // per_head
    j = (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)  # index inside the first half
    rows_a = head * HEAD_DIM + j
    t = tl.arange(0, T_PAD)
    tmask = t < T
    if BIAS:  # a weight: loaded before waiting on the previous kernel
        bias_a = tl.load(bias_ptr + rows_a).to(tl.float32)
        bias_b = tl.load(bias_ptr + rows_a + HALF).to(tl.float32)
    # positions and slots: written before the previous kernel ran (host, or the last step's finish)
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    if PREFETCH:  # the first weight tiles into L2 during the previous kernel's tail
        prefetch_l2(w_ptr, rows_a, rows_a >= 0, K, PREFETCH, BLOCK_K, 0)
        prefetch_l2(w_ptr, rows_a + HALF, rows_a >= 0, K, PREFETCH, BLOCK_K, 0)
    if PDL:
        gdc_wait()
    acc_a = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK_K)
        kmask = offs < K
        x = tl.load(x_ptr + t[:, None] * stride_x + offs[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wb = tl.load(w_ptr + (rows_a + HALF)[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :],
                     other=0.0, eviction_policy="evict_first")
        acc_a = _mma_t(wa, x, acc_a, UPCAST)
        acc_b = _mma_t(wb, x, acc_b, UPCAST)
    if PDL:
        gdc_launch_dependents()
    a = tl.trans(acc_a)  # [T_PAD, BLOCK_N]
    b = tl.trans(acc_b)
    if BIAS:
        a += bias_a[None, :]
        b += bias_b[None, :]
    dt = q_ptr.dtype.element_ty
    a = round_to_dtype(a, dt)
    b = round_to_dtype(b, dt)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q and k rotated (bf16 rope, rounded like eager torch); v as projected
        cos = tl.load(cos_ptr + pos[:, None] * HALF + j[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos[:, None] * HALF + j[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        a, b = rope_pair(a, b, cos, sin)
    row = slot * stride_slot + pos * (NUM_KV_HEADS * HEAD_DIM)  # [T_PAD]: each row's cache row in its slot
    if head < NUM_Q_HEADS:
        base = q_ptr + (t * stride_q + head * HEAD_DIM).to(tl.int64)
    elif head < NUM_Q_HEADS + NUM_KV_HEADS:
        base = k_cache_ptr + row + (head - NUM_Q_HEADS) * HEAD_DIM
    else:
        base = v_cache_ptr + row + (head - NUM_Q_HEADS - NUM_KV_HEADS) * HEAD_DIM
    tl.store(base[:, None] + j[None, :], a.to(dt), mask=tmask[:, None])
    tl.store(base[:, None] + HALF + j[None, :], b.to(dt), mask=tmask[:, None])


def rows_qkv_rope(x: torch.Tensor, wqkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  *, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None,
                  block_n: int = 32, block_k: int = 64, num_warps: int = 4, stages: int = 4,
                  pdl: bool = False, prefetch: int = 0) -> None:
    """Per row b of x [B, K]: q/k/v = W x[b] (+ bias), q and k roped at pos[b]; q -> q_out[b], K/V into slot
    slots[b] of the caches [slots, max_tokens, Hkv, D] at pos[b] (rows_gemv + rope_rows, one launch).
    ``block_n`` rows of each half of a head per program: a divisor of head_dim / 2, >= 16."""
    half = head_dim // 2
    if half % block_n or block_n < 16:
        raise ValueError(f"block_n {block_n} must divide head_dim / 2 = {half} and be >= 16")
    num_heads = num_q_heads + 2 * num_kv_heads
    if wqkv.shape[0] != num_heads * head_dim or x.shape[0] > DOT_ROWS:
        raise ValueError(f"wqkv {tuple(wqkv.shape)} / {x.shape[0]} rows: expected (Hq + 2 Hkv) * D rows and <= 16")
    _rows_qkv_rope_kernel[(num_heads * (half // block_n),)](
        x, wqkv, bias if bias is not None else x, q_out, k_cache, v_cache, pos, slots, cos, sin, wqkv.shape[1],
        x.stride(0), q_out.stride(0), k_cache.stride(0), T=x.shape[0], T_PAD=DOT_ROWS, NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, UPCAST=interpreting(), PDL=pdl, PREFETCH=l2_prefetch_tiles(prefetch, block_k), num_warps=num_warps,
        **launch_opts(pdl))


@triton.jit
def _rope_rows_kernel(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                      eps, stride_qkv, stride_q, stride_slot, NUM_Q_HEADS: tl.constexpr,
                      NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
                      KV_FMT: tl.constexpr = 0, inv_k=1.0, inv_v=1.0):
    head = tl.program_id(0)
    b = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.load(slot_ptr + b).to(tl.int64)
    qkv_ptr += b * stride_qkv
    q_ptr += b * stride_q
    k_cache_ptr += slot * stride_slot
    v_cache_ptr += slot * stride_slot
    pos_ptr += b
    if QK_NORM:
        norm_rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                             eps, head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_FMT, inv_k, inv_v)
    else:
        rope_cache_head(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, head, NUM_Q_HEADS,
                        NUM_KV_HEADS, HEAD_DIM, KV_FMT, inv_k, inv_v)


def rope_rows(qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int,
              num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, eps: float = 1e-6, pdl: bool = False, kv_fmt: int = 0,
              inv_k: float = 1.0, inv_v: float = 1.0) -> None:
    """Per row b of qkv [B, (Hq+2Hkv)*D]: [q/k RMSNorm (Qwen3),] rope of q and k, q -> q_out[b], K/V into
    slot slots[b] of the caches [slots, max_tokens, Hkv, D] at pos[b]; ``kv_fmt`` (kvfp8.kv_fmt) > 0: the
    caches hold FP8 bytes, written as value times ``inv_k`` / ``inv_v`` (the layer's 1 / scale)."""
    qk_norm = q_norm is not None
    _rope_rows_kernel[(num_q_heads + 2 * num_kv_heads, qkv.shape[0])](
        qkv, q_out, k_cache, v_cache, pos, slots, cos, sin, q_norm if qk_norm else qkv, k_norm if qk_norm else qkv,
        eps, qkv.stride(0), q_out.stride(0), k_cache.stride(0), NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, QK_NORM=qk_norm, PDL=pdl, KV_FMT=kv_fmt, inv_k=inv_k, inv_v=inv_v, num_warps=1,
        **launch_opts(pdl))


@triton.jit
def _finish_rows_kernel(amax_val_ptr, amax_idx_ptr, num_parts, stride_a, token_ptr, out_tokens_ptr, stride_out,
                        step_idx_ptr, pos_ptr, embed_ptr, h_ptr, stride_h, H, PARTS_POW2: tl.constexpr,
                        H_POW2: tl.constexpr, PDL: tl.constexpr):
    # greedy, stage 2 for row b: the best of its blocks; record it, advance its position, gather its embedding
    b = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, PARTS_POW2)
    val = tl.load(amax_val_ptr + b * stride_a + offs, mask=offs < num_parts, other=float("-inf"))
    idx = tl.load(amax_idx_ptr + b * stride_a + offs, mask=offs < num_parts, other=2147483647)
    tok = tl.min(tl.where(val == tl.max(val, axis=0), idx, 2147483647), axis=0)
    step = tl.load(step_idx_ptr + b)
    tl.store(token_ptr + b, tok.to(tl.int64))
    tl.store(out_tokens_ptr + b * stride_out + step, tok.to(tl.int64))
    tl.store(step_idx_ptr + b, step + 1)
    tl.store(pos_ptr + b, tl.load(pos_ptr + b) + 1)
    hh = tl.arange(0, H_POW2)
    row = tl.load(embed_ptr + tok.to(tl.int64) * H + hh, mask=hh < H)
    tl.store(h_ptr + b * stride_h + hh, row, mask=hh < H)


@triton.jit
def _apply_rows_kernel(ctrl_ptr, token_ptr, pos_ptr, slot_ptr, step_idx_ptr, embed_ptr, h_ptr, stride_h, H,
                       B: tl.constexpr, H_POW2: tl.constexpr, PDL: tl.constexpr):
    # the step's first kernel: when the host armed ctrl (token, position, slot of every row, then a flag;
    # set_rows), each row's device state and embedding from it, and the flag cleared, so that the
    # further replays of an engine step continue on device; one program (it reads, then clears, the flag)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if tl.load(ctrl_ptr + 3 * B) != 0:
        hh = tl.arange(0, H_POW2)
        for b in tl.static_range(B):
            tok = tl.load(ctrl_ptr + b)
            tl.store(token_ptr + b, tok)
            tl.store(pos_ptr + b, tl.load(ctrl_ptr + B + b).to(tl.int32))
            tl.store(slot_ptr + b, tl.load(ctrl_ptr + 2 * B + b).to(tl.int32))
            tl.store(step_idx_ptr + b, tok * 0)
            row = tl.load(embed_ptr + tok * H + hh, mask=hh < H)
            tl.store(h_ptr + b * stride_h + hh, row, mask=hh < H)
        tl.store(ctrl_ptr + 3 * B, tl.zeros((1,), tl.int64).sum(axis=0))


class RowControl:
    """A batched step's control words from the host (each row's token, position, slot, ...): one pinned host buffer
    and one async copy into ``dev``, which the step's first ops read; a write waits until the previous one has left
    the pinned buffer."""

    def __init__(self, n: int, device: torch.device):
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def write(self, values: list[int]) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._host.numpy()[:] = values
        self.dev.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class RowsDecoder:
    """What every family's batched decoder shares: the rows' control plane (``set_rows``: each row's token,
    position and slot, applied by the step's first kernel), the per-row samplers, and the step around the
    family's ``layer(i)``: final norm, lm_head over the rows, the greedy finish or each row's sampling
    kernels, the next input's embedding into ``residual``. ``step()`` is capturable (no host sync, no
    allocation by us). A subclass calls ``_init_rows`` and defines ``layer(i)`` over ``residual``."""

    def _init_rows(self, embed: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
                   num_layers: int, cos: torch.Tensor, sin: torch.Tensor, batch: int, options: FastOptions | None,
                   max_steps: int, scratch_slot: int) -> None:
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be 1..{MAX_BATCH}, got {batch}")
        dev, dt = embed.device, embed.dtype
        if dt != torch.bfloat16:
            raise ValueError(f"the fast CUDA path runs bfloat16 models, got {dt}")
        self.batch, self.scratch_slot, self.num_layers = batch, scratch_slot, num_layers
        self.embed, self.final_norm, self.lm_head, self.eps = embed, final_norm, lm_head, eps
        self.cos, self.sin = cos.to(device=dev, dtype=dt).contiguous(), sin.to(device=dev, dtype=dt).contiguous()
        self.opt = options or FastOptions()
        if self.opt.pdl is None:
            self.opt = replace(self.opt, pdl=dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9)
        h, vocab, b = embed.shape[1], lm_head.shape[0], batch
        self.hidden = h
        self.token = torch.zeros(b, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(b, dtype=torch.int32, device=dev)
        self.slots = torch.full((b,), scratch_slot, dtype=torch.int32, device=dev)
        self.step_idx = torch.zeros(b, dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(b, max_steps, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(b, h, dtype=dt, device=dev)
        self.hn = torch.zeros(b, h, dtype=dt, device=dev)  # the final-normed rows, the lm_head's input
        self.logits = torch.zeros(b, vocab, dtype=torch.float32, device=dev)
        self.num_parts = -(-vocab // self.opt.batch_tiles["lm_head"][0])
        self.amax_val = torch.zeros(b, self.num_parts, dtype=torch.float32, device=dev)
        self.amax_idx = torch.zeros(b, self.num_parts, dtype=torch.int32, device=dev)
        self.samplers: list | None = None
        # set_rows' host -> device write: tokens, positions, slots and an armed flag, one pinned buffer and one
        # async copy; the step's first kernel applies them (once: it clears the flag)
        self._ctrl = RowControl(3 * b + 1, dev)

    def attach_samplers(self, buffers, **kwargs) -> None:
        """Sample in ``step(sample=True)``: row b by the sampling kernels over row ``slots[b]`` of
        ``buffers`` (the engine's SamplingBuffers, read at every replay); kwargs: FastSampler's sizes."""
        from .sampling import FastSampler, candidate_cap

        vocab = self.lm_head.shape[0]
        kwargs.setdefault("cap", candidate_cap(vocab))
        base = buffers.row(0)  # row 0's views start at the buffers' bases; the kernels add slots[b] rows
        self.samplers = [FastSampler(base, vocab, self.logits.device, pdl=self.opt.pdl, row=self.slots[r : r + 1],
                                     **kwargs) for r in range(self.batch)]

    def set_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> None:
        """Host-side (re)start of every row: its next input token, position and slot; rows past the
        lists decode token 0 at position 0 of the scratch slot. One pinned host buffer and one async copy
        (the engine calls it before every batched step); the next ``step()`` applies it in its first kernel,
        so the device tensors (token, pos, slots, step_idx, residual) change only then."""
        pad = self.batch - len(tokens)
        self._ctrl.write([*tokens, *[0] * pad, *positions, *[0] * pad, *slots, *[self.scratch_slot] * pad, 1])

    def _apply_rows(self) -> None:
        h = self.hidden
        _apply_rows_kernel[(1,)](self._ctrl.dev, self.token, self.pos, self.slots, self.step_idx, self.embed,
                                 self.residual, self.residual.stride(0), h, B=self.batch,
                                 H_POW2=triton.next_power_of_2(h), PDL=self.opt.pdl, num_warps=4,
                                 **launch_opts(self.opt.pdl))

    def tile_kwargs(self, name: str) -> dict:
        bn, bk, nw, st = self.opt.batch_tiles[name]
        return dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=self.opt.pdl, mode=self.opt.batch_mode,
                    prefetch=self.opt.prefetch_tiles if self.opt.pdl else 0)

    def layer(self, i: int) -> None:
        raise NotImplementedError

    def step(self, sample: bool = False) -> None:
        """One decode step of every row: logits, next token (greedy argmax, or with ``sample`` the row's
        sampling kernels), out_tokens[b, step_idx[b]], its embedding into residual[b], pos[b] += 1."""
        if sample and self.samplers is None:
            raise ValueError("step(sample=True) needs attach_samplers first")
        self._apply_rows()
        for i in range(self.num_layers):
            self.layer(i)
        rmsnorm_rows(self.residual, self.final_norm, self.hn, self.eps, pdl=self.opt.pdl)
        if sample:
            rows_gemv(self.hn, self.lm_head, self.logits, **self.tile_kwargs("lm_head"))
            for r, sampler in enumerate(self.samplers):
                sampler.finish(self.logits[r], self.token[r : r + 1], self.out_tokens[r], self.step_idx[r : r + 1],
                               self.pos[r : r + 1], self.embed, self.residual[r])
            return
        rows_gemv(self.hn, self.lm_head, self.logits, argmax_parts=(self.amax_val, self.amax_idx),
                  **self.tile_kwargs("lm_head"))
        _finish_rows_kernel[(self.batch,)](
            self.amax_val, self.amax_idx, self.num_parts, self.amax_val.stride(0), self.token, self.out_tokens,
            self.out_tokens.stride(0), self.step_idx, self.pos, self.embed, self.residual, self.residual.stride(0),
            self.hidden, PARTS_POW2=triton.next_power_of_2(self.num_parts), H_POW2=triton.next_power_of_2(self.hidden),
            PDL=self.opt.pdl, num_warps=8, **launch_opts(self.opt.pdl))


class GqaBatchDecoder(RowsDecoder):
    """``batch`` rows of a Llama-family model decoding together (module docstring)."""

    def __init__(self, model: GqaModel, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 cos: torch.Tensor, sin: torch.Tensor, batch: int, options: FastOptions | None = None,
                 max_steps: int = 256, scratch_slot: int | None = None, kv_format: str | None = None,
                 kv_scales: list[tuple[float, float]] | None = None, fp8_scales: list | None = None,
                 act_fp8: bool = False, kv_nearest: bool = False):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self._init_rows(model.embed, model.final_norm, model.lm_head, model.eps, len(model.layers), cos, sin, batch,
                        options, max_steps, k_caches[0].shape[0] - 1 if scratch_slot is None else scratch_slot)
        # FP8 KV cache (as GqaDecoder): rope_rows writes the rows' K/V as FP8 bytes, the attention reads them
        self.kv_fmt, self.kv_scales, self.kv_inv = kv_cache_setup(kv_format, kv_scales, len(model.layers), k_caches,
                                                                  kv_nearest)
        # FP8 weights (fp8.Fp8Scales per layer: a projection with a scale is float8_e4m3fn): rows_gemv's FP8 mode,
        # ``act_fp8``: activations through FP8 per row (FP8_DYNAMIC)
        if fp8_scales is not None and len(fp8_scales) != len(model.layers):
            raise ValueError(f"{len(fp8_scales)} layers of FP8 scales for {len(model.layers)} layers")
        self.fp8_scales, self.act_fp8 = fp8_scales, act_fp8
        if fp8_scales is not None and self.opt.batch_mode != 1:
            raise ValueError("FP8 weights in the batched step need FastOptions.batch_mode 1 (W @ x^T)")
        dev, dt = model.embed.device, model.embed.dtype
        widest = max(model.hidden, model.intermediate, model.num_q_heads * model.head_dim)
        self.xq = torch.zeros(batch, widest if fp8_scales is not None else 0, dtype=torch.float16, device=dev)
        self.xscale = torch.ones(batch, dtype=torch.float32, device=dev)
        blocked = fp8_scales is not None and any(sc.blocked() for sc in fp8_scales)
        self.gate_up_rows = torch.zeros(batch, 2 * model.intermediate if blocked else 0, dtype=dt, device=dev)
        hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
        h, inter = model.hidden, model.intermediate
        b = batch
        self.qkv = torch.zeros(b, (hq + 2 * hkv) * d, dtype=dt, device=dev)
        self.query = torch.zeros(b, hq * d, dtype=dt, device=dev)
        self.attn_out = torch.zeros(b, hq * d, dtype=dt, device=dev)
        self.act = torch.zeros(b, inter, dtype=dt, device=dev)
        self.xn = torch.zeros(b, h, dtype=dt, device=dev)
        self.inv_rms = torch.ones(b, dtype=torch.float32, device=dev)  # norm_late_rows' 1 / rms of each row
        splits, block_s = self.opt.attn_tile(self.kv_fmt)
        self.attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=splits,
                                    block_s=block_s, num_warps=self.opt.attn_num_warps(False), pdl=self.opt.pdl,
                                    device=dev, max_batch=b, one_launch=self.opt.attn_one_launch)
        # rope + K/V write in the QKV GEMV's epilogue (rows_qkv_rope): tensor-core mode and a qkv tile whose
        # half (rows of each rope half per program) divides head_dim / 2; else rows_gemv + rope_rows
        pair_n = self.opt.batch_tiles["qkv"][0] // 2
        self.fused_rope = (self.opt.batch_fused_rope and self.opt.batch_mode == 1 and pair_n >= 16
                           and (d // 2) % pair_n == 0 and not self.kv_fmt  # (its epilogue writes bf16 K/V
                           and fp8_scales is None  # and reads bf16 weights)
                           and not self.opt.norm_late)  # (and takes rows normed before it)

    def gemv(self, i: int, name: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: str, **kw) -> None:
        """rows_gemv of layer i's projection ``name`` over rows x: bf16 weights as they are; FP8 ones over x's
        rows quantized once (quant_rows) into self.xq; block-scaled FP8 (fp8block.BlockFp8, no bias) by the
        DeepSeek family's few-row GEMV (moe.gemv_rows: per-block tensor-core dots, the rows' groups rounded to FP8
        in the kernel), SiLU . up after it in torch."""
        scale = getattr(self.fp8_scales[i], name) if self.fp8_scales is not None else None
        if scale is None:
            rows_gemv(x, w, out, **kw, **self.tile_kwargs(tile))
            return
        if isinstance(scale, BlockFp8):
            if kw.get("bias") is not None or "row_scale" in kw:
                raise ValueError("block-scaled FP8 GEMVs take no bias and no folded norm")
            if not kw.get("silu"):
                gemv_rows(x, scale, out, residual=kw.get("residual"), pdl=self.opt.pdl)
                return
            gu = self.gate_up_rows[:, : scale.shape[0]]
            gemv_rows(x, scale, gu, pdl=self.opt.pdl)
            reference.silu_mul(gu, out=out)
            return
        xq = self.xq[:, : x.shape[1]]
        quant_rows(x, xq, self.xscale, self.act_fp8, pdl=self.opt.pdl)
        rows_gemv(xq, w, out, **kw, **self.tile_kwargs(tile), w_scale=scale, x_scale=self.xscale)

    def _norm_late(self, i: int, name: str) -> bool:
        """Whether layer i's ``name`` ("wqkv" / "w_gate_up") folds its norm into its GEMV: a bf16 projection where
        the one-token step folds it (llama.folds_norm), so that a row decodes the same batched or alone."""
        proj = "qkv" if name == "wqkv" else "gate_up"
        bf16 = self.fp8_scales is None or getattr(self.fp8_scales[i], name) is None
        return bf16 and folds_norm(self.opt, proj, self.model.layers[i].q_norm is not None, self.kv_fmt)

    def layer(self, i: int) -> None:
        m, lw, eps = self.model, self.model.layers[i], self.model.eps
        hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
        kc, vc = self.k_caches[i], self.v_caches[i]
        if self._norm_late(i, "wqkv"):  # the norm folded as the one-token step folds it, its halves computed once
            norm_late_rows(self.residual, lw.attn_norm, self.xn, self.inv_rms, eps, pdl=self.opt.pdl)
            self.gemv(i, "wqkv", self.xn, lw.wqkv, self.qkv, "qkv", bias=lw.bqkv, row_scale=self.inv_rms)
            rope_rows(self.qkv, self.query, kc, vc, self.pos, self.slots, self.cos, self.sin, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=d, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps, pdl=self.opt.pdl,
                      kv_fmt=self.kv_fmt, inv_k=self.kv_inv[i][0], inv_v=self.kv_inv[i][1])
        elif self.fused_rope and lw.q_norm is None:
            rmsnorm_rows(self.residual, lw.attn_norm, self.xn, eps, pdl=self.opt.pdl)
            bn, bk, nw, st = self.opt.batch_tiles["qkv"]
            rows_qkv_rope(self.xn, lw.wqkv, self.query, kc, vc, self.pos, self.slots, self.cos, self.sin,
                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d, bias=lw.bqkv, block_n=bn // 2, block_k=bk,
                          num_warps=nw, stages=st, pdl=self.opt.pdl,
                          prefetch=self.opt.prefetch_tiles if self.opt.pdl else 0)
        else:
            rmsnorm_rows(self.residual, lw.attn_norm, self.xn, eps, pdl=self.opt.pdl)
            self.gemv(i, "wqkv", self.xn, lw.wqkv, self.qkv, "qkv", bias=lw.bqkv)
            rope_rows(self.qkv, self.query, kc, vc, self.pos, self.slots, self.cos, self.sin, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=d, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=eps, pdl=self.opt.pdl,
                      kv_fmt=self.kv_fmt, inv_k=self.kv_inv[i][0], inv_v=self.kv_inv[i][1])
        self.attn(self.query, kc, vc, self.pos, self.attn_out, stride_kt=hkv * d, stride_vt=hkv * d,
                  slot_ids=self.slots, stride_ks=kc.stride(0), stride_vs=vc.stride(0), kv_fmt=self.kv_fmt,
                  k_scale=self.kv_scales[i][0], v_scale=self.kv_scales[i][1])
        self.gemv(i, "wo", self.attn_out, lw.wo, self.residual, "o", residual=self.residual, bias=lw.bo)
        if self._norm_late(i, "w_gate_up"):
            norm_late_rows(self.residual, lw.mlp_norm, self.xn, self.inv_rms, eps, pdl=self.opt.pdl)
            self.gemv(i, "w_gate_up", self.xn, lw.w_gate_up, self.act, "gate_up", silu=True, row_scale=self.inv_rms)
        else:
            rmsnorm_rows(self.residual, lw.mlp_norm, self.xn, eps, pdl=self.opt.pdl)
            self.gemv(i, "w_gate_up", self.xn, lw.w_gate_up, self.act, "gate_up", silu=True)
        self.gemv(i, "w_down", self.act, lw.w_down, self.residual, "down", residual=self.residual)
