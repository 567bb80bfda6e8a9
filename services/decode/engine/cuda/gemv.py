"""Batch-1 GEMV kernels (Triton) with the decode step's small ops fused in.

Every kernel reads each weight element exactly once: program ``p`` owns ``BLOCK_N`` output rows and
walks the full K dimension in ``BLOCK_K`` chunks (16-byte row loads, fp32 accumulation).

Fusions (all optional, compile-time flags):
- prologue ``NORM``: RMSNorm of the input vector (fp32 statistics, rounded to the model dtype, times
  the norm weight; HF's rounding points), recomputed per program from L2 (the vector is 4-8 KB);
- epilogue ``BIAS``: ``round(W @ x + b)``, the bias added to the fp32 sum before the one rounding
  (as a bf16 ``F.linear`` with bias rounds; Qwen2's q/k/v bias, an o_proj bias);
- epilogue ``RESIDUAL``: ``out = res + round(W @ x [+ b])`` (the residual add of o_proj and down_proj);
- paired rows (``gemv_silu``): rows ``n`` and ``n + I`` of ``w_gate_up`` in one program, writes
  ``round(silu(round(g)) * round(u))``;
- paired rows (``gemv_qkv_rope``): rows ``d`` and ``d + D/2`` of one head of ``wqkv``, applies
  rotary embedding (neox pairing) to q and k heads and writes q to a buffer, k and v straight into
  the KV cache at the position held in a device tensor (no host sync). Without ``ROPE`` (Qwen3: its
  per-head q/k RMSNorm needs the whole head) q and k are written as projected (+ bias) and the attention
  kernel normalises and rotates them, or (``qk_norm``) the last of a head's programs to finish does.

Their torch twins (same rounding order) are in reference.py; CPU tests run the kernels under
``TRITON_INTERPRET=1`` against them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kernel_helpers import head_half_rows, load_first_pair_tile, prefetch_l2, rms_scaled, rope_pair, round_to_dtype
from .kvfp8 import kv_store_row
from .qknorm import norm_rope_cache_head

try:  # programmatic dependent launch (sm_90): the next kernel starts its weight loads during our tail
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (tests)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret) or os.environ.get("TRITON_INTERPRET") == "1"


def launch_opts(pdl: bool) -> dict:
    """Launch kwargs for programmatic dependent launch (only when asked: older Triton lacks it)."""
    return {"launch_pdl": True} if pdl else {}  # CPU tests: Triton interpreter (no bf16 tl.dot there)


@triton.jit
def _inv_rms(x_ptr, K, eps, K_POW2: tl.constexpr):
    offs = tl.arange(0, K_POW2)
    x = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)


@triton.jit
def _load_x(x_ptr, nw_ptr, k, K, inv_rms, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = k + tl.arange(0, BLOCK_K)
    kmask = offs < K
    x = tl.load(x_ptr + offs, mask=kmask, other=0.0)
    if NORM:
        nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0)
        x = rms_scaled(x, inv_rms, nw)
    return x.to(tl.float32), offs, kmask


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, amax_val_ptr, amax_idx_ptr, N, K, eps,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr, ARGMAX: tl.constexpr,
                 K_POW2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr = 0):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    # first weight tile issued before the x/norm loads so they overlap
    k0 = tl.arange(0, BLOCK_K)
    w0 = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0[None, :], mask=rmask[:, None] & (k0 < K)[None, :],
                 other=0.0, eviction_policy="evict_first")
    if BIAS:  # a weight too: loaded now, not after the weight stream
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if PREFETCH:
        prefetch_l2(w_ptr, rows, rmask, K, PREFETCH, BLOCK_K)
    if PDL:  # weights are never written: only x and the outputs wait for the previous kernel
        gdc_wait()
    inv_rms = 1.0
    if NORM:
        inv_rms = _inv_rms(x_ptr, K, eps, K_POW2)
    x0, _, _ = _load_x(x_ptr, nw_ptr, 0, K, inv_rms, NORM, BLOCK_K)
    acc = w0.to(tl.float32) * x0[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _load_x(x_ptr, nw_ptr, k, K, inv_rms, NORM, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    if PDL:  # our weight stream is done: let the next kernel start loading its own
        gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if BIAS:
        y += bias
    if RESIDUAL:
        r = tl.load(res_ptr + rows, mask=rmask, other=0.0)
        y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)
    if ARGMAX:  # greedy sampling, stage 1: this block's best row (ties -> lowest index, as torch.argmax)
        y = tl.where(rmask, y.to(out_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
        best = tl.argmax(y, axis=0, tie_break_left=True)
        tl.store(amax_val_ptr + pid, tl.max(y, axis=0))
        tl.store(amax_idx_ptr + pid, pid * BLOCK_N + best)


@triton.jit
def _greedy_finish_kernel(amax_val_ptr, amax_idx_ptr, num_parts, token_ptr, out_tokens_ptr, step_idx_ptr, pos_ptr,
                          embed_ptr, h_ptr, H, PARTS_POW2: tl.constexpr, H_POW2: tl.constexpr, PDL: tl.constexpr):
    # greedy sampling, stage 2: the best of the blocks; record it, advance the position, gather its embedding
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, PARTS_POW2)
    val = tl.load(amax_val_ptr + offs, mask=offs < num_parts, other=float("-inf"))
    idx = tl.load(amax_idx_ptr + offs, mask=offs < num_parts, other=2147483647)
    best = tl.max(val, axis=0)
    tok = tl.min(tl.where(val == best, idx, 2147483647), axis=0)
    step = tl.load(step_idx_ptr)
    tl.store(token_ptr, tok.to(tl.int64))
    tl.store(out_tokens_ptr + step, tok.to(tl.int64))
    tl.store(step_idx_ptr, step + 1)
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)
    hh = tl.arange(0, H_POW2)
    row = tl.load(embed_ptr + tok.to(tl.int64) * H + hh, mask=hh < H)
    tl.store(h_ptr + hh, row, mask=hh < H)


def greedy_finish(amax_val: torch.Tensor, amax_idx: torch.Tensor, num_parts: int, token: torch.Tensor,
                  out_tokens: torch.Tensor, step_idx: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
                  h: torch.Tensor, pdl: bool = False) -> None:
    """token = argmax over the GEMV blocks' partial maxima; out_tokens[step_idx] = token; step_idx, pos += 1;
    h = embed[token] (the next step's input)."""
    _greedy_finish_kernel[(1,)](amax_val, amax_idx, num_parts, token, out_tokens, step_idx, pos, embed, h,
                                embed.shape[1], PARTS_POW2=triton.next_power_of_2(num_parts),
                                H_POW2=triton.next_power_of_2(embed.shape[1]), PDL=pdl, num_warps=8,
                                **launch_opts(pdl))


@triton.jit
def _gemv_pair_loop(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, inv_rms, wa0, wb0,
                    NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    x0, _, _ = _load_x(x_ptr, nw_ptr, 0, K, inv_rms, NORM, BLOCK_K)
    acc_a = wa0.to(tl.float32) * x0[None, :]
    acc_b = wb0.to(tl.float32) * x0[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        x, offs, kmask = _load_x(x_ptr, nw_ptr, k, K, inv_rms, NORM, BLOCK_K)
        wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wb = tl.load(w_ptr + rows_b[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_a += wa.to(tl.float32) * x[None, :]
        acc_b += wb.to(tl.float32) * x[None, :]
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def _gemv_pair_loop_late_norm(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, eps, wa0, wb0,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # RMSNorm folded into the stream: W @ round(x * nw) and sum(x^2) in the same loop, the sums scaled by
    # 1 / rms after it, so the weight stream starts without waiting on a reduction of x. Not HF's rounding
    # points (x * nw is rounded to the model dtype, x * inv_rms is not): results move by ~1 ulp. The batched
    # step's GEMVs take the same operand and scale (smallops.norm_late_rows), so a row decodes as it does alone
    k0 = tl.arange(0, BLOCK_K)
    m0 = k0 < K
    x0 = tl.load(x_ptr + k0, mask=m0, other=0.0)
    xr = x0.to(tl.float32)
    ss = xr * xr
    xw = round_to_dtype(xr * tl.load(nw_ptr + k0, mask=m0, other=0.0).to(tl.float32), x0.dtype)
    acc_a = wa0.to(tl.float32) * xw[None, :]
    acc_b = wb0.to(tl.float32) * xw[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        offs = k + k0
        kmask = offs < K
        xr = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        ss += xr * xr
        xw = round_to_dtype(xr * tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32), x0.dtype)
        wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wb = tl.load(w_ptr + rows_b[:, None].to(tl.int64) * K + offs[None, :], mask=kmask[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_a += wa.to(tl.float32) * xw[None, :]
        acc_b += wb.to(tl.float32) * xw[None, :]
    inv_rms = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    return tl.sum(acc_a, axis=1) * inv_rms, tl.sum(acc_b, axis=1) * inv_rms


@triton.jit
def _pair_gemv(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, eps, wa0, wb0, NORM: tl.constexpr, NORM_LATE: tl.constexpr,
               K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # the paired-row GEMV after the PDL wait: the norm first (HF's rounding points) or folded into the stream
    if NORM and NORM_LATE:
        a, b = _gemv_pair_loop_late_norm(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, eps, wa0, wb0, BLOCK_N, BLOCK_K,
                                         STAGES)
    else:
        inv_rms = 1.0
        if NORM:
            inv_rms = _inv_rms(x_ptr, K, eps, K_POW2)
        a, b = _gemv_pair_loop(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, K, inv_rms, wa0, wb0, NORM, BLOCK_N, BLOCK_K,
                               STAGES)
    return a, b


@triton.jit
def _gemv_silu_kernel(x_ptr, w_ptr, out_ptr, nw_ptr, I, K, eps,
                      NORM: tl.constexpr, K_POW2: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                      PREFETCH: tl.constexpr = 0, NORM_LATE: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # I % BLOCK_N == 0
    wa0, wb0 = load_first_pair_tile(w_ptr, rows, rows + I, K, BLOCK_K)
    if PREFETCH:
        prefetch_l2(w_ptr, rows, rows < I, K, PREFETCH, BLOCK_K)
        prefetch_l2(w_ptr, rows + I, rows < I, K, PREFETCH, BLOCK_K)
    if PDL:
        gdc_wait()
    g, u = _pair_gemv(x_ptr, nw_ptr, w_ptr, rows, rows + I, K, eps, wa0, wb0, NORM, NORM_LATE, K_POW2, BLOCK_N,
                      BLOCK_K, STAGES)
    if PDL:
        gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    g = round_to_dtype(g, dt)
    s = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + rows, (s * round_to_dtype(u, dt)).to(dt))


@triton.jit
def _gemv_qkv_rope_kernel(x_ptr, w_ptr, nw_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                          cos_ptr, sin_ptr, K, eps,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          NORM: tl.constexpr, BIAS: tl.constexpr, ROPE: tl.constexpr, K_POW2: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                          POS_EARLY: tl.constexpr = False, PREFETCH: tl.constexpr = 0, KV_FMT: tl.constexpr = 0,
                          inv_k=1.0, inv_v=1.0, raw_ptr=None, count_ptr=None, qn_ptr=None, kn_ptr=None,
                          QK_NORM: tl.constexpr = False, NORM_LATE: tl.constexpr = False):
    # QK_NORM (Qwen3, no ROPE): q and k heads go as projected to raw_ptr; the last program of a head to finish
    # (count_ptr[head], atomically counted and reset) normalises + rotates the whole head into q / the K cache
    HALF: tl.constexpr = HEAD_DIM // 2
    per_head: tl.constexpr = HALF // BLOCK_N
    head, j, rows_a = head_half_rows(HEAD_DIM, BLOCK_N)  # j: index inside the first half
    wa0, wb0 = load_first_pair_tile(w_ptr, rows_a, rows_a + HALF, K, BLOCK_K)
    if BIAS:  # a weight: loaded with the first tile, not after the weight stream
        bias_a = tl.load(bias_ptr + rows_a).to(tl.float32)
        bias_b = tl.load(bias_ptr + rows_a + HALF).to(tl.float32)
    if PREFETCH:
        prefetch_l2(w_ptr, rows_a, rows_a >= 0, K, PREFETCH, BLOCK_K)
        prefetch_l2(w_ptr, rows_a + HALF, rows_a >= 0, K, PREFETCH, BLOCK_K)
    if POS_EARLY:  # the position (and its rope row) before the wait: no kernel between the step's finish and us
        pos = tl.load(pos_ptr)
        if ROPE:
            cos = tl.load(cos_ptr + pos * HALF + j).to(tl.float32)
            sin = tl.load(sin_ptr + pos * HALF + j).to(tl.float32)
    if PDL:
        gdc_wait()
    a, b = _pair_gemv(x_ptr, nw_ptr, w_ptr, rows_a, rows_a + HALF, K, eps, wa0, wb0, NORM, NORM_LATE, K_POW2,
                      BLOCK_N, BLOCK_K, STAGES)
    if PDL:
        gdc_launch_dependents()
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
    if QK_NORM:
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            dt = raw_ptr.dtype.element_ty
            tl.store(raw_ptr + head * HEAD_DIM + j, a.to(dt))
            tl.store(raw_ptr + head * HEAD_DIM + HALF + j, b.to(dt))
            tl.debug_barrier()  # every thread's rows stored before the count
            done = tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu")
            if done == per_head - 1:
                tl.store(count_ptr + head, 0)  # reset for the next layer / step
                norm_rope_cache_head(raw_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr,
                                     kn_ptr, eps, head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_FMT, inv_k, inv_v,
                                     ".cg")
        else:
            qkv_store(a, b, head, j, pos, cos, sin, q_ptr, k_cache_ptr, v_cache_ptr, inv_k, inv_v, NUM_Q_HEADS,
                      NUM_KV_HEADS, HEAD_DIM, ROPE, KV_FMT)
    else:
        qkv_store(a, b, head, j, pos, cos, sin, q_ptr, k_cache_ptr, v_cache_ptr, inv_k, inv_v, NUM_Q_HEADS,
                  NUM_KV_HEADS, HEAD_DIM, ROPE, KV_FMT)


@triton.jit
def qkv_store(a, b, head, j, pos, cos, sin, q_ptr, k_cache_ptr, v_cache_ptr, inv_k, inv_v,
              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
              KV_FMT: tl.constexpr):
    # the QKV GEMVs' epilogue: fp32 sums (a, b) of rows j and j + D/2 of ``head`` (bias added) rounded to the
    # model dtype, rotated for q and k heads (cos / sin: this position's rows at j), q to q_ptr, k / v into the
    # caches at pos (an FP8 cache: bytes of x * inv_scale)
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = q_ptr.dtype.element_ty
    a = round_to_dtype(a, dt)
    b = round_to_dtype(b, dt)
    row = pos.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + ((head - NUM_Q_HEADS) % NUM_KV_HEADS) * HEAD_DIM
    if ROPE:  # q and k heads rotated; v heads (and q/k without ROPE) stored as projected
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            a, b = rope_pair(a, b, cos, sin)  # bf16 rope, rounded like eager torch
    if head < NUM_Q_HEADS:  # each branch stores through its own pointer (an FP8 cache is uint8)
        tl.store(q_ptr + head * HEAD_DIM + j, a.to(dt))
        tl.store(q_ptr + head * HEAD_DIM + HALF + j, b.to(dt))
    elif head < NUM_Q_HEADS + NUM_KV_HEADS:
        kv_store_row(k_cache_ptr + row + j, a, inv_k, dt, KV_FMT)
        kv_store_row(k_cache_ptr + row + HALF + j, b, inv_k, dt, KV_FMT)
    else:
        kv_store_row(v_cache_ptr + row + j, a, inv_v, dt, KV_FMT)
        kv_store_row(v_cache_ptr + row + HALF + j, b, inv_v, dt, KV_FMT)


INTERPRETED_PROGRAMS = 4  # interpreted_rows' programs a launch at most (0: every launch keeps its tile)


def interpreted_rows(block_n: int, n: int) -> int:
    """Rows a program of a row-tiled GEMV over ``n`` rows whose rows are independent (each row's sum its own,
    nothing shared between a program's rows): ``block_n`` on a GPU. Triton's interpreter (the CPU tests) runs the
    programs one after another, each op at a fixed cost whatever its tile's size, so there the rows of several
    programs go to one: at most INTERPRETED_PROGRAMS programs, still more than one where ``n`` spans several
    tiles. Every row gets the same arithmetic in the same order as with ``block_n``."""
    programs = INTERPRETED_PROGRAMS
    if not programs or not interpreting() or n <= block_n * programs:
        return block_n
    return max(block_n, triton.next_power_of_2(triton.cdiv(n, programs)))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, norm_w: torch.Tensor | None = None,
         eps: float = 1e-5, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         block_n: int = 16, block_k: int = 512, num_warps: int = 4, stages: int = 1, pdl: bool = False,
         argmax_parts: tuple[torch.Tensor, torch.Tensor] | None = None, prefetch: int = 0) -> torch.Tensor:
    """out[N] = [residual +] round(W[N, K] @ [rmsnorm(x) * norm_w | x][K] [+ bias]); with argmax_parts (val
    fp32, idx int32, each >= cdiv(N, block_n)) also each block's max and its row, for ``greedy_finish``."""
    n, k = w.shape
    av, ai = argmax_parts if argmax_parts is not None else (out, out)
    if argmax_parts is None:  # (with them: a part a program, as greedy_finish reads them)
        block_n = interpreted_rows(block_n, n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, residual if residual is not None else out, norm_w if norm_w is not None else x,
        bias if bias is not None else x, av, ai, n, k, eps, NORM=norm_w is not None, RESIDUAL=residual is not None,
        BIAS=bias is not None, ARGMAX=argmax_parts is not None, K_POW2=_pow2(k),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl, PREFETCH=l2_prefetch_tiles(prefetch, block_k),
        num_warps=num_warps, **launch_opts(pdl))
    return out


def l2_prefetch_tiles(tiles: int, block_k: int) -> int:
    """Weight tiles to prefetch into L2 before the PDL wait (``prefetch``: 0, 1, 2 or 4): none when
    interpreted or with tiles under one 128-byte line a row."""
    if tiles not in (0, 1, 2, 4):
        raise ValueError(f"prefetch takes 0, 1, 2 or 4 tiles, got {tiles}")
    return 0 if interpreting() or block_k < 64 else tiles


def gemv_silu(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor, *, norm_w: torch.Tensor | None = None,
              eps: float = 1e-5, block_n: int = 16, block_k: int = 512, num_warps: int = 4, stages: int = 1,
              pdl: bool = False, prefetch: int = 0, norm_late: bool = False) -> torch.Tensor:
    """out[I] = silu(W[:I] @ x') * (W[I:] @ x'), x' = rmsnorm(x) * norm_w when norm_w is given (``norm_late``:
    the norm folded into the weight stream, _gemv_pair_loop_late_norm)."""
    two_i, k = w_gate_up.shape
    inter = two_i // 2
    if inter % block_n:
        raise ValueError(f"intermediate size {inter} is not a multiple of block_n {block_n}")
    if inter % (wide := interpreted_rows(block_n, inter)) == 0:
        block_n = wide
    _gemv_silu_kernel[(inter // block_n,)](
        x, w_gate_up, out, norm_w if norm_w is not None else x, inter, k, eps,
        NORM=norm_w is not None, K_POW2=_pow2(k), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        PREFETCH=l2_prefetch_tiles(prefetch, block_k), NORM_LATE=norm_late, num_warps=num_warps, **launch_opts(pdl))
    return out


def gemv_qkv_rope(x: torch.Tensor, wqkv: torch.Tensor, norm_w: torch.Tensor | None, eps: float,
                  q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  bias: torch.Tensor | None = None, rope: bool = True, block_n: int = 16, block_k: int = 512,
                  num_warps: int = 4, stages: int = 1, pdl: bool = False, pos_early: bool = False,
                  prefetch: int = 0, kv_fmt: int = 0, inv_k: float = 1.0, inv_v: float = 1.0,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  norm_late: bool = False) -> None:
    """Fused norm + QKV projection (+ bias) + rope; q -> q_out[Hq*D], k/v -> caches [max_tokens, Hkv, D] at
    pos[0] (``kv_fmt`` 1 / 2: FP8 bytes of k * inv_k and v * inv_v, kvfp8.fp8_kv_bits). ``rope=False``: q and k
    unrotated (the attention kernel normalises and rotates them). ``qk_norm`` (Qwen3; with ``rope=False``):
    (q_norm [D], k_norm [D], raw [(Hq + Hkv) * D] of the model dtype, count [Hq + Hkv] int32, zero): q and k
    heads as projected go to ``raw``, and the last program of each head normalises + rotates it
    (qknorm.norm_rope_cache_head) into q_out / the K cache; ``count`` is left zero.
    ``pos_early``: read pos before waiting on the previous kernel (PDL), which must not be the one that
    writes it (the step's first layer follows the finish kernel that advances pos: False there).
    ``norm_late``: the RMSNorm folded into the weight stream (_gemv_pair_loop_late_norm)."""
    half = head_dim // 2
    if half % block_n:
        raise ValueError(f"head_dim/2 = {half} is not a multiple of block_n {block_n}")
    num_heads = num_q_heads + 2 * num_kv_heads
    if wqkv.shape[0] != num_heads * head_dim:
        raise ValueError(f"wqkv has {wqkv.shape[0]} rows, expected (Hq + 2*Hkv) * D = {num_heads * head_dim}")
    grid = (num_heads * (half // block_n),)
    qn = kn = raw = count = None
    if qk_norm is not None:
        if rope:
            raise ValueError("qk_norm rotates q and k after their norm: call with rope=False")
        qn, kn, raw, count = qk_norm
        if raw.numel() < (num_q_heads + num_kv_heads) * head_dim or count.numel() < num_q_heads + num_kv_heads:
            raise ValueError("qk_norm's raw / count buffers are smaller than the q and k heads")
    _gemv_qkv_rope_kernel[grid](
        x, wqkv, norm_w if norm_w is not None else x, bias if bias is not None else x, q_out, k_cache, v_cache,
        pos, cos, sin, wqkv.shape[1], eps, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        NORM=norm_w is not None, BIAS=bias is not None, ROPE=rope, K_POW2=_pow2(wqkv.shape[1]), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        POS_EARLY=pos_early, PREFETCH=l2_prefetch_tiles(prefetch, block_k), KV_FMT=kv_fmt, inv_k=inv_k, inv_v=inv_v,
        raw_ptr=raw, count_ptr=count, qn_ptr=qn, kn_ptr=kn, QK_NORM=qk_norm is not None, NORM_LATE=norm_late,
        num_warps=num_warps, **launch_opts(pdl))
