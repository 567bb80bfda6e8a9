"""Triton helpers shared by the fast path's kernels: bf16 rounding points, vLLM's FP8 activation rounding and
paired-row weight loads."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rnd_bf16(x):
    # fp32 -> nearest-even bf16 value, kept in fp32, by integer arithmetic (finite inputs)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_dtype(x, dt):
    # round an fp32 value to the model dtype (bf16: the fast path's only dtype) and keep it in fp32,
    # the rounding points of eager bf16 torch spelled out; a float round trip x.to(bf16).to(fp32) is
    # not used because the compiler may drop it (seen on sm_90)
    return rnd_bf16(x)


@triton.jit
def rms_scaled(x, inv, nw):
    # x normed at HF's RMSNorm rounding points: x / rms rounded to the weight's dtype, times the weight, rounded
    # again (``inv`` and ``nw`` broadcast to x's shape by the caller)
    return round_to_dtype(round_to_dtype(x.to(tl.float32) * inv, nw.dtype) * nw.to(tl.float32), nw.dtype)


@triton.jit
def act_scale(amax):
    # vLLM's dynamic FP8 activation scale of a token (or a group of its features) whose largest |x| is amax
    # (engine/fp8.quantize_activations)
    return tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))


@triton.jit
def act_round(x, inv_s):
    # x over its scale, rounded to FP8 (E4M3, nearest even) as vLLM's W8A8 quantizes activations
    return tl.minimum(tl.maximum(x * inv_s, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def rope_pair(a, b, cos, sin):
    # one rope rotation of the halves (a, b) in fp32 holding bf16 values: each product and sum rounded to
    # bf16 as eager torch rounds x1 * cos - x2 * sin | x2 * cos + x1 * sin
    return rnd_bf16(rnd_bf16(a * cos) - rnd_bf16(b * sin)), rnd_bf16(rnd_bf16(b * cos) + rnd_bf16(a * sin))


@triton.jit
def load_first_pair_tile(w_ptr, rows_a, rows_b, K, BLOCK_K: tl.constexpr):
    # the first BLOCK_K columns of two row sets of W [N, K] (gate/up or rope halves), streamed once
    k0 = tl.arange(0, BLOCK_K)
    wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + k0[None, :], mask=(k0 < K)[None, :], other=0.0,
                 eviction_policy="evict_first")
    wb = tl.load(w_ptr + rows_b[:, None].to(tl.int64) * K + k0[None, :], mask=(k0 < K)[None, :], other=0.0,
                 eviction_policy="evict_first")
    return wa, wb


@triton.jit
def prefetch_l2(w_ptr, rows, rmask, K, TILES: tl.constexpr, BLOCK_K: tl.constexpr, FIRST: tl.constexpr = 1):
    # a hint, no effect on results: weight tiles FIRST..FIRST+TILES-1 of these rows (tile 0 is loaded
    # outright by the batch-1 GEMVs) into L2, one prefetch per 128-byte line, issued before the PDL wait
    # so that the weight stream runs during the previous kernel's tail (needs BLOCK_K >= 64; compiled
    # only, not interpreted)
    LINE: tl.constexpr = 64  # bf16 elements per line
    c = FIRST * BLOCK_K + tl.arange(0, TILES * BLOCK_K // LINE) * LINE
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + c[None, :]
    ptrs = tl.where(rmask[:, None] & (c < K)[None, :], ptrs, w_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def head_half_rows(HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    # a QKV kernel's program: BLOCK_N rows of one head's first half and (+ HEAD_DIM / 2) their rope partners;
    # (head, j: the rows' indices inside the half, rows_a: the first half's rows of wqkv)
    per_head: tl.constexpr = HEAD_DIM // 2 // BLOCK_N
    pid = tl.program_id(0)
    head = pid // per_head
    j = (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
    return head, j, head * HEAD_DIM + j
