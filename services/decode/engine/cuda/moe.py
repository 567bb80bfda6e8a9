"""Few-token GEMVs for the DeepSeek-V3-family step: dense rows, router, grouped experts (torch
twins: reference.router, reference.moe).

- ``gemv_rows``: out[T, N] = [res +] W @ [rmsnorm(x) * nw | x] for T <= 4 tokens; every weight tile is
  loaded once and used for all T rows (a verify step reads each weight once, not T times).
- ``router``: router GEMV over the experts, then sigmoid scores, + correction bias (noaux_tc; with
  several groups, only the experts of the topk_group groups whose two best biased scores sum highest),
  top-k, normalised weights.
- ``moe_gate_up`` / ``moe_down``: grouped expert GEMVs over the (token, slot) pairs of the step;
  slots are the top-k routed experts then the shared experts (pre-laid-out as ``[S, ...]`` experts
  of the routed size). A pair's program runs only if it is the first pair naming its expert, and
  then serves every token that chose that expert: each selected expert's weights are read once per
  step, unselected experts never.
- ``moe_reduce``: h += round(sum_k round(y_k * w_k)) + shared, with the eager-torch rounding points.

``pdl`` (sm_90, programmatic dependent launch): each kernel may start while the previous one finishes; it
waits (``gdc_wait``) before its first read of anything a kernel wrote, in every program, and lets the next
one launch once its weight stream is issued (``gdc_launch_dependents``), as gemv.py's kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8block import BlockFp8, act_groups, col_scales, fp8_block_dot, fp8_fma, fp8_fma_grouped, group_offs, kernel_args
from .fp8block import groups as fp8_groups
from .fp8block import tile as fp8_tile
from .gemv import gdc_launch_dependents, gdc_wait, interpreted_rows, interpreting, launch_opts
from .kernel_helpers import load_first_pair_tile, rms_scaled, round_to_dtype


# The few-token kernels below spell out their dot-or-FMA accumulation each: a jit helper returning a
# [T, N] or a [T, N, K] accumulator by a constexpr branch runs under the interpreter but does not compile
# (Triton 3.6, H200).
@triton.jit
def mma(x, w, acc, UPCAST: tl.constexpr):
    """acc + x [M, K] @ w[N, K]^T: bf16 tensor-core dot with fp32 sums; fp32 operands (exact products of
    bf16 values) under Triton's CPU interpreter, whose dot does not take bf16."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x.to(w.dtype), tl.trans(w), acc)


@triton.jit
def _rows_x(x_ptr, nw_ptr, k, K, t, tmask, inv, stride_x, stride_xh, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
            BLOCK_K: tl.constexpr):
    # input columns [k, k + BLOCK_K) of the T rows as loaded, or normed when NORM (bf16 values, in fp32)
    offs = k + tl.arange(0, BLOCK_K)
    kmask = offs < K
    xcol = _x_cols(offs, stride_xh, HEAD_DIM)
    x = tl.load(x_ptr + t[:, None] * stride_x + xcol[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
    if NORM:
        x = rms_scaled(x, inv[:, None], tl.load(nw_ptr + offs, mask=kmask, other=0.0)[None, :])
    return x


@triton.jit
def _x_cols(offs, stride_xh, HEAD_DIM: tl.constexpr):
    # where input column ``offs`` lies in x: with HEAD_DIM, x is [heads, T, HEAD_DIM] (a batched matmul's output)
    # and column k is head k // HEAD_DIM's
    if HEAD_DIM:
        return (offs // HEAD_DIM) * stride_xh + offs % HEAD_DIM
    return offs


@triton.jit
def _group_x(x_ptr, nw_ptr, offs, K, inv, stride_xh, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    # one token's input columns ``offs`` [G, SK] (fp8block.group_offs) as _rows_x reads them (bf16 values)
    kmask = offs < K
    x = tl.load(x_ptr + _x_cols(offs, stride_xh, HEAD_DIM), mask=kmask, other=0.0)
    if NORM:
        x = rms_scaled(x, inv, tl.load(nw_ptr + offs, mask=kmask, other=0.0))
    return x


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, N, K, eps, stride_x, stride_o, stride_xh,
                      HEAD_DIM: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                      K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      DOT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
                      EARLY: tl.constexpr = False, FP8: tl.constexpr = False, s_ptr=None, KB=0,
                      SG: tl.constexpr = 1, SK: tl.constexpr = 1, ACT: tl.constexpr = False, GROUPS: tl.constexpr = 0):
    # FP8: W is block-scaled FP8 (fp8block.py), its scales s_ptr [ceil(N / SG), KB] per SG rows x SK columns (the
    # program's rows in one scale row); on the tensor-core path BLOCK_K == SK. GROUPS (one token, grouped
    # activations): the FMA tiles as [BLOCK_N, GROUPS, SK], GROUPS * SK == BLOCK_K (fp8block.fp8_fma_grouped)
    pid = tl.program_id(0)
    srow = (pid * BLOCK_N) // SG
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    t = tl.arange(0, T_PAD)
    tmask = t < T
    FIRST: tl.constexpr = BLOCK_K if EARLY else 0  # EARLY (with PDL): tile 0 before the wait, the loop from tile 1
    if EARLY:  # weights are never written: the first tile's round trip overlaps the previous kernel's tail
        if GROUPS:
            g0 = group_offs(0, GROUPS, SK)
            w0 = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + g0[None, :, :],
                         mask=rmask[:, None, None] & (g0 < K)[None, :, :], other=0.0, eviction_policy="evict_first")
        else:
            k0 = tl.arange(0, BLOCK_K)
            w0 = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0[None, :], mask=rmask[:, None] & (k0 < K)[None, :],
                         other=0.0, eviction_policy="evict_first")
    if PDL:  # x (and the residual) come from the previous kernel
        gdc_wait()
    inv = tl.full((T_PAD,), 1.0, tl.float32)
    if NORM:
        if DOT:  # T_PAD = 16 rows: sum the squares tile by tile (a [16, K] tile would not fit in registers;
            # one [4, K] load spread over the 16 rows measured slower on the H200)
            ss = tl.zeros((T_PAD,), tl.float32)
            for k in range(0, K, BLOCK_K):
                offs = k + tl.arange(0, BLOCK_K)
                xs = tl.load(x_ptr + t[:, None] * stride_x + offs[None, :], mask=tmask[:, None] & (offs < K)[None, :],
                             other=0.0).to(tl.float32)
                ss += tl.sum(xs * xs, axis=1)
            inv = 1.0 / tl.sqrt(ss / K + eps)
        else:
            kk = tl.arange(0, K_POW2)
            xs = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :], mask=tmask[:, None] & (kk < K)[None, :],
                         other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=1) / K + eps)
    if GROUPS:  # one token over grouped-activation FP8 blocks
        inv1 = tl.sum(inv, axis=0)
        acc3 = tl.zeros((BLOCK_N, GROUPS, SK), dtype=tl.float32)
        if EARLY:
            x0 = _group_x(x_ptr, nw_ptr, g0, K, inv1, stride_xh, HEAD_DIM, NORM)
            acc3 = fp8_fma_grouped(acc3, w0, x0, s_ptr, srow, 0, K, KB, GROUPS, SK)
        for k in tl.range(FIRST, K, BLOCK_K, num_stages=STAGES):
            offs = group_offs(k, GROUPS, SK)
            x = _group_x(x_ptr, nw_ptr, offs, K, inv1, stride_xh, HEAD_DIM, NORM)
            w = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + offs[None, :, :],
                        mask=rmask[:, None, None] & (offs < K)[None, :, :], other=0.0, eviction_policy="evict_first")
            acc3 = fp8_fma_grouped(acc3, w, x, s_ptr, srow, k, K, KB, GROUPS, SK)
        if PDL:
            gdc_launch_dependents()
        y = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]  # [1, BLOCK_N]
        omask = tmask[:, None] & rmask[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + t[:, None] * stride_o + rows[None, :], mask=omask, other=0.0)
            y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
        tl.store(out_ptr + t[:, None] * stride_o + rows[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        if DOT:  # several tokens: tensor-core dots [16, BLOCK_K] x [BLOCK_K, BLOCK_N], bf16 in, fp32 sums
            acc2 = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if EARLY:
            x0 = _rows_x(x_ptr, nw_ptr, 0, K, t, tmask, inv, stride_x, stride_xh, HEAD_DIM, NORM, BLOCK_K)
            if DOT:
                if FP8:
                    acc2 = fp8_block_dot(x0, w0, acc2, tl.load(s_ptr + srow * KB), ACT, UPCAST)
                else:
                    acc2 = mma(x0, w0, acc2, UPCAST)
            else:
                if FP8:
                    acc = fp8_fma(acc, w0, x0, s_ptr, srow, 0, K, KB, T_PAD, SK, ACT, BLOCK_K)
                else:
                    acc += w0.to(tl.float32)[None, :, :] * x0.to(tl.float32)[:, None, :]
        for k in tl.range(FIRST, K, BLOCK_K, num_stages=STAGES):
            x = _rows_x(x_ptr, nw_ptr, k, K, t, tmask, inv, stride_x, stride_xh, HEAD_DIM, NORM, BLOCK_K)
            offs = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & (offs < K)[None, :],
                        other=0.0, eviction_policy="evict_first")
            if DOT:
                if FP8:
                    acc2 = fp8_block_dot(x, w, acc2, tl.load(s_ptr + srow * KB + k // SK), ACT, UPCAST)
                else:
                    acc2 = mma(x, w, acc2, UPCAST)
            else:
                if FP8:
                    acc = fp8_fma(acc, w, x, s_ptr, srow, k, K, KB, T_PAD, SK, ACT, BLOCK_K)
                else:
                    acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if PDL:
            gdc_launch_dependents()
        if DOT:
            y = acc2
        else:
            y = tl.sum(acc, axis=2)  # [T_PAD, BLOCK_N]
        omask = tmask[:, None] & rmask[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + t[:, None] * stride_o + rows[None, :], mask=omask, other=0.0)
            y = r.to(tl.float32) + round_to_dtype(y, r.dtype)
        tl.store(out_ptr + t[:, None] * stride_o + rows[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)


DOT_ROWS = 16  # tokens padded to one tensor-core tile when T > 1
# gemv_rows' rows: up to 4 verify tokens (3 drafts), up to 8 batched slots, up to 16 rows of a batch that drafts (one
# tensor-core tile of rows)
MAX_ROWS = 16


def _dot(t: int, w) -> bool:
    """Whether T tokens over weights w take the tensor-core path (bf16/fp16 or block-scaled FP8 weights, T > 1)."""
    return t > 1 and (isinstance(w, BlockFp8) or w.dtype in (torch.bfloat16, torch.float16))


def gemv_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, norm_w: torch.Tensor | None = None,
              eps: float = 1e-6, residual: torch.Tensor | None = None, block_n: int = 8, block_k: int = 256,
              num_warps: int = 4, stages: int = 4, dot: bool | None = None,
              dot_tile: tuple[int, int, int, int] | None = None, heads: bool = False, pdl: bool = False,
              early: bool = True, fp8_rows: int | None = None) -> torch.Tensor:
    """out[T, N] = [residual +] x'[T, K] @ W[N, K]^T, x' = rmsnorm(x) * norm_w when given (T <= MAX_ROWS);
    ``w`` a bf16 tensor or block-scaled FP8 (fp8block.BlockFp8, its scales applied in the kernel).

    One token: fp32 FMAs over a [BLOCK_N, BLOCK_K] weight tile. Several: tensor-core dots with the tokens
    padded to 16 rows (the same bytes as one token; the FMA form was compute-bound at 4 tokens), with
    ``dot_tile`` (block_n >= 16, block_k, num_warps, stages) when given; ``dot=False`` keeps FMAs
    (small matrices such as the router, where 16-row tiles leave too few programs). ``heads=True``: x is
    [heads, T, D] (the per-head value projection's output), read as [T, heads * D] in place. ``pdl``: launched
    as a programmatic dependent of the previous kernel, with (``early``) its first weight tile before the wait.
    ``fp8_rows``: one token over block-scaled FP8 with grouped activations, the fewest rows a program (default
    fp8block.FMA_ACT_BLOCK_N)."""
    if heads:  # x [heads, T, D] read as [T, heads * D] without a copy
        if norm_w is not None:
            raise ValueError("gemv_rows: heads=True takes no norm_w")
        nh, t, hd = x.shape
        k, stride_t, stride_h = nh * hd, x.stride(1), x.stride(0)
        if x.stride(2) != 1:
            raise ValueError("gemv_rows: heads=True needs x's last dim contiguous")
    else:
        (t, k), stride_t, stride_h, hd = x.shape, x.stride(0), 0, 0
    n = w.shape[0]
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"gemv_rows takes 1..{MAX_ROWS} rows (a verify's tokens, a batch's slots), got {t}")
    dot = _dot(t, w) if dot is None else (dot and _dot(t, w))
    if dot:
        block_n, block_k, num_warps, stages = dot_tile or (max(16, block_n), block_k, num_warps, stages)
    else:
        block_k = max(32, block_k // triton.next_power_of_2(t))  # the [T, BLOCK_N, BLOCK_K] accumulator in registers
    block_n, block_k = fp8_tile(w, block_n, block_k, dot, act_rows=fp8_rows)
    fp8 = kernel_args(w)
    if not fp8 and not dot:
        block_n = interpreted_rows(block_n, n)
    if fp8:
        fp8["GROUPS"] = fp8_groups(w, t, dot, block_k)
    w = w.w if fp8 else w
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, residual if residual is not None else out, norm_w if norm_w is not None else x, n, k, eps,
        stride_t, out.stride(0), stride_h, HEAD_DIM=hd, T=t, T_PAD=DOT_ROWS if dot else triton.next_power_of_2(t), NORM=norm_w is not None,
        RESIDUAL=residual is not None, K_POW2=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, num_warps=num_warps, DOT=dot, UPCAST=interpreting(), PDL=pdl, EARLY=pdl and early,
        **fp8, **launch_opts(pdl))
    return out


@triton.jit
def _topk_body(logits_ptr, bias_ptr, ids_ptr, wts_ptr, scale, t, E: tl.constexpr, TOPK: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, E_POW2: tl.constexpr):
    # token t's noaux_tc top-k from its fp32 router logits (read past L1: other programs may have written them)
    e = tl.arange(0, E_POW2)  # padded past E (e.g. 384 experts): never chosen
    em = e < E
    scores = 1.0 / (1.0 + tl.exp(-tl.load(logits_ptr + t * E + e, mask=em, other=0.0, cache_modifier=".cg")))
    choice = tl.where(em, scores + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32), float("-inf"))
    GS: tl.constexpr = E // N_GROUP  # experts per group
    if N_GROUP > 1:  # group-limited: a group's score is the sum of its two best choices; keep the best groups
        grp = e // GS
        gscore = tl.full((E_POW2,), float("-inf"), tl.float32)  # per expert: its group's score
        for g in tl.static_range(N_GROUP):
            cg = tl.where(grp == g, choice, float("-inf"))
            i1 = tl.argmax(cg, axis=0, tie_break_left=True)
            m1 = tl.max(cg, axis=0)
            m2 = tl.max(tl.where(e == i1, float("-inf"), cg), axis=0)
            gscore = tl.where(grp == g, m1 + m2, gscore)
        keep = e < 0
        for j in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=0, tie_break_left=True) // GS
            keep = keep | (grp == best)
            gscore = tl.where(grp == best, float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    total = 0.0
    c = choice
    for j in tl.static_range(TOPK):
        i = tl.argmax(c, axis=0, tie_break_left=True)
        total += tl.sum(tl.where(e == i, scores, 0.0), axis=0)
        c = tl.where(e == i, float("-inf"), c)
    c = choice
    for j in tl.static_range(TOPK):
        i = tl.argmax(c, axis=0, tie_break_left=True)
        tl.store(ids_ptr + t * TOPK + j, i.to(tl.int32))
        tl.store(wts_ptr + t * TOPK + j, tl.sum(tl.where(e == i, scores, 0.0), axis=0) / (total + 1e-20) * scale)
        c = tl.where(e == i, float("-inf"), c)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr, TOPK: tl.constexpr,
                        N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, E_POW2: tl.constexpr):
    _topk_body(logits_ptr, bias_ptr, ids_ptr, wts_ptr, scale, tl.program_id(0), E, TOPK, N_GROUP, TOPK_GROUP, E_POW2)


@triton.jit
def _router_x(h_ptr, nw_ptr, xn_ptr, pid, k, K, inv, BLOCK_K: tl.constexpr):
    # columns [k, k + BLOCK_K) of the token's normed residual (program 0 also stores them for the experts)
    offs = k + tl.arange(0, BLOCK_K)
    kmask = offs < K
    x = rms_scaled(tl.load(h_ptr + offs, mask=kmask, other=0.0), inv, tl.load(nw_ptr + offs, mask=kmask, other=0.0))
    if pid == 0:
        tl.store(xn_ptr + offs, x.to(xn_ptr.dtype.element_ty), mask=kmask)
    return x


@triton.jit
def _shared_gate_up(h_row, nw_ptr, sw_ptr, act_ptr, j, I, K, eps, stride_se, TOPK: tl.constexpr,
                    K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                    PDL: tl.constexpr, EARLY: tl.constexpr):
    # one token's shared expert j // (I / BLOCK_N), rows block j % (I / BLOCK_N): silu(gate) * up over the normed
    # residual as _moe_gate_up_kernel's one-token FMA path computes it from xn (the same normed values, products and
    # roundings), into its pair's act row (TOPK + the expert's index)
    per = tl.cdiv(I, BLOCK_N)
    e = j // per
    rows = (j % per) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < I
    base = sw_ptr + e.to(tl.int64) * stride_se
    FIRST: tl.constexpr = BLOCK_K if EARLY else 0
    if EARLY:  # shared weights are never written: their first tiles before the wait
        k0 = tl.arange(0, BLOCK_K)
        m0 = rmask[:, None] & (k0 < K)[None, :]
        wa0 = tl.load(base + rows[:, None].to(tl.int64) * K + k0[None, :], mask=m0, other=0.0)
        wb0 = tl.load(base + (rows + I)[:, None].to(tl.int64) * K + k0[None, :], mask=m0, other=0.0)
    if PDL:
        gdc_wait()
    kk = tl.arange(0, K_POW2)
    xs = tl.load(h_row + kk, mask=kk < K, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / K + eps)
    acc_a = tl.zeros((1, BLOCK_N, BLOCK_K), tl.float32)
    acc_b = tl.zeros((1, BLOCK_N, BLOCK_K), tl.float32)
    if EARLY:
        x0 = _router_x(h_row, nw_ptr, h_row, 1, 0, K, inv, BLOCK_K)
        acc_a += wa0.to(tl.float32)[None, :, :] * x0.to(tl.float32)[None, None, :]
        acc_b += wb0.to(tl.float32)[None, :, :] * x0.to(tl.float32)[None, None, :]
    for k in tl.range(FIRST, K, BLOCK_K, num_stages=STAGES):
        x = _router_x(h_row, nw_ptr, h_row, 1, k, K, inv, BLOCK_K)  # pid 1: never stores
        offs = k + tl.arange(0, BLOCK_K)
        wmask = rmask[:, None] & (offs < K)[None, :]
        wa = tl.load(base + rows[:, None].to(tl.int64) * K + offs[None, :], mask=wmask, other=0.0)
        wb = tl.load(base + (rows + I)[:, None].to(tl.int64) * K + offs[None, :], mask=wmask, other=0.0)
        acc_a += wa.to(tl.float32)[None, :, :] * x.to(tl.float32)[None, None, :]
        acc_b += wb.to(tl.float32)[None, :, :] * x.to(tl.float32)[None, None, :]
    if PDL:
        gdc_launch_dependents()
    dt = act_ptr.dtype.element_ty
    g = round_to_dtype(tl.sum(acc_a, axis=2), dt)
    u = round_to_dtype(tl.sum(acc_b, axis=2), dt)
    sg = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
    tl.store(act_ptr + (TOPK + e).to(tl.int64) * I + rows[None, :], (sg * u).to(dt), mask=rmask[None, :])


@triton.jit
def _router_fused_kernel(h_ptr, nw_ptr, xn_ptr, w_ptr, bias_ptr, logits_ptr, count_ptr, ids_ptr, wts_ptr, scale,
                         eps, K, stride_h, stride_xn, E: tl.constexpr, TOPK: tl.constexpr, N_GROUP: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                         PDL: tl.constexpr = False, EARLY: tl.constexpr = False, sw_ptr=None, act_ptr=None, I=0,
                         stride_se=0, SHARED: tl.constexpr = False, S_BLOCK_N: tl.constexpr = 8,
                         S_BLOCK_K: tl.constexpr = 512, S_STAGES: tl.constexpr = 3):
    # token t = program_id(1): the MLP's RMSNorm of its row (its output -> xn, by program 0, for the experts),
    # the router GEMV (BLOCK_N experts a program, as gemv_rows' one-token form: the same rounding points) and,
    # in the last of the token's programs to finish, its top-k (_topk_body): one launch instead of three.
    # SHARED (one token): programs past the router's also run the shared experts' gate/up + SiLU
    # (_shared_gate_up), so their weights stream while the router's latency-bound chain runs
    pid = tl.program_id(0)
    t = tl.program_id(1)
    h_row = h_ptr + t * stride_h
    xn_row = xn_ptr + t * stride_xn
    R_PROGRAMS: tl.constexpr = (E + BLOCK_N - 1) // BLOCK_N
    if SHARED:
        if pid >= R_PROGRAMS:
            _shared_gate_up(h_row, nw_ptr, sw_ptr, act_ptr, pid - R_PROGRAMS, I, K, eps, stride_se, TOPK, K_POW2,
                            S_BLOCK_N, S_BLOCK_K, S_STAGES, PDL, EARLY)
        else:
            _router_program(h_row, nw_ptr, xn_row, w_ptr, bias_ptr, logits_ptr, count_ptr, ids_ptr, wts_ptr, scale,
                            eps, K, pid, t, R_PROGRAMS, E, TOPK, N_GROUP, TOPK_GROUP, E_POW2, K_POW2, BLOCK_N,
                            BLOCK_K, STAGES, PDL, EARLY)
    else:
        _router_program(h_row, nw_ptr, xn_row, w_ptr, bias_ptr, logits_ptr, count_ptr, ids_ptr, wts_ptr, scale, eps,
                        K, pid, t, R_PROGRAMS, E, TOPK, N_GROUP, TOPK_GROUP, E_POW2, K_POW2, BLOCK_N, BLOCK_K,
                        STAGES, PDL, EARLY)


@triton.jit
def _router_program(h_row, nw_ptr, xn_row, w_ptr, bias_ptr, logits_ptr, count_ptr, ids_ptr, wts_ptr, scale, eps, K,
                    pid, t, R_PROGRAMS: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, N_GROUP: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < E
    FIRST: tl.constexpr = BLOCK_K if EARLY else 0  # EARLY (with PDL): weight tile 0 loaded before the wait
    if EARLY:
        k0 = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0[None, :], mask=rmask[:, None] & (k0 < K)[None, :],
                     other=0.0, eviction_policy="evict_first")
    if PDL:  # h comes from the previous kernel (and xn / logits / ids may still be read by it)
        gdc_wait()
    kk = tl.arange(0, K_POW2)
    xs = tl.load(h_row + kk, mask=kk < K, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if EARLY:
        x0 = _router_x(h_row, nw_ptr, xn_row, pid, 0, K, inv, BLOCK_K)
        acc += w0.to(tl.float32) * x0[None, :]
    for k in tl.range(FIRST, K, BLOCK_K, num_stages=STAGES):
        x = _router_x(h_row, nw_ptr, xn_row, pid, k, K, inv, BLOCK_K)
        offs = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & (offs < K)[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    if PDL:
        gdc_launch_dependents()
    tl.store(logits_ptr + t * E + rows, tl.sum(acc, axis=1), mask=rmask)
    tl.debug_barrier()  # every thread's logits stored before the count
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == R_PROGRAMS - 1:
        tl.store(count_ptr + t, 0)  # reset for the next call
        _topk_body(logits_ptr, bias_ptr, ids_ptr, wts_ptr, scale, t, E, TOPK, N_GROUP, TOPK_GROUP, E_POW2)


def router(xn: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
           top_k: int, scale: float, logits: torch.Tensor | None = None, *, n_group: int = 1,
           topk_group: int = 1, norm_w: torch.Tensor | None = None, eps: float = 1e-6,
           xn_out: torch.Tensor | None = None, count: torch.Tensor | None = None, pdl: bool = False,
           early: bool = True, shared: "SharedGateUp | None" = None) -> None:
    """ids [T, k] int32 (best first), wts [T, k] fp32 from normed x [T, H] (noaux_tc; group-limited to
    the ``topk_group`` best of ``n_group`` expert groups when fewer than all: reference.router).

    Two launches: the router GEMV spread over the experts (one program per 2 experts; a single program
    per token reading all E x H weights was latency-bound at ~23 us), then top-k per token (the group
    choice in the same program). ``logits``: an fp32 [T, E] scratch buffer (allocated when not given).
    With ``norm_w``: ``xn`` is the residual stream [T, H], normed here (RMSNorm, ``eps``) into ``xn_out`` for
    the experts, and the norm, GEMV and top-k of every token are one launch (``count``: an int32 [>= T] of
    zeros, a token's entry reset by its last program; allocated when not given). ``shared`` (with ``norm_w``, one
    token, bf16 shared experts): the same launch also runs the shared experts' gate/up + SiLU into their act rows
    (GroupedMoe(..., shared_done=True) then runs the routed pairs only)."""
    t, e = xn.shape[0], w.shape[0]
    if norm_w is not None and xn_out is None:
        raise ValueError("router(norm_w=...) takes an xn_out for its normed input")
    if norm_w is not None and count is not None and count.numel() < t:
        raise ValueError(f"router(norm_w=...) of {t} tokens needs a count of {t} entries, not {count.numel()}")
    grouped = n_group > 1 and topk_group < n_group
    if grouped and (e % n_group or e // n_group < 2 or top_k > topk_group * (e // n_group)):
        raise ValueError(f"group-limited routing: {e} experts in {n_group} groups (2+ each), top {topk_group} "
                         f"groups must hold the top-{top_k}")
    if logits is None:
        logits = torch.empty(t, e, dtype=torch.float32, device=xn.device)
    if norm_w is not None:
        if count is None:
            count = torch.zeros(t, dtype=torch.int32, device=xn.device)
        k = xn.shape[1]
        experts = interpreted_rows(2, e)  # a program's experts
        extra, programs = {}, triton.cdiv(e, experts)
        if shared is not None:
            if t != 1:
                raise ValueError(f"router(shared=...) runs one token's shared experts, not {t} tokens'")
            extra = dict(sw_ptr=shared.w, act_ptr=shared.act, I=shared.inter, stride_se=shared.w.stride(0),
                         SHARED=True, S_BLOCK_N=shared.block_n, S_BLOCK_K=shared.block_k, S_STAGES=shared.stages)
            programs += shared.programs
        _router_fused_kernel[(programs, t)](
            xn, norm_w, xn_out, w, bias, logits, count, ids, wts, scale, eps, k, xn.stride(0), xn_out.stride(0),
            E=e, TOPK=top_k,
            N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
            E_POW2=triton.next_power_of_2(e), K_POW2=triton.next_power_of_2(k), BLOCK_N=experts, BLOCK_K=512, STAGES=2,
            PDL=pdl, EARLY=pdl and early, num_warps=4, **extra, **launch_opts(pdl))
        return
    # 512-wide K tiles for any T (gemv_rows narrows block_k by T): 4 dependent loads, not 16
    gemv_rows(xn, w, logits, block_n=2, block_k=512 * triton.next_power_of_2(t), stages=2, dot=False, pdl=pdl,
              early=early)
    _router_topk_kernel[(t,)](logits, bias, ids, wts, scale, E=e, TOPK=top_k, N_GROUP=n_group if grouped else 1,
                              TOPK_GROUP=topk_group if grouped else 1, E_POW2=triton.next_power_of_2(e), num_warps=1)


@dataclass
class SharedGateUp:
    """One token's shared experts' gate/up for the router's launch (router(shared=...)): bf16 weights [S, 2I, H],
    the GroupedMoe's act buffer (their rows after the routed pairs'), the gate/up tile's rows, K width and stages
    (its warps: the router's 4)."""
    w: torch.Tensor
    act: torch.Tensor
    inter: int
    block_n: int
    block_k: int
    stages: int

    @property
    def programs(self) -> int:
        return self.w.shape[0] * triton.cdiv(self.inter, self.block_n)


@triton.jit
def _owner(ids_ptr, p, T: tl.constexpr, TOPK: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr,
           T_PAD: tl.constexpr):
    """Expert of pair p (routed id, or E + s for shared s), whether p is its first pair, and per token the
    pair index that names it (-1 if none)."""
    t0 = p // SLOTS
    k0 = p % SLOTS
    tt = tl.arange(0, T_PAD)
    kk = tl.arange(0, SLOTS_PAD)
    valid = (tt[:, None] < T) & (kk[None, :] < SLOTS)
    routed = kk[None, :] < TOPK
    # past L1 (".cg"): the down kernel on PDL reads the ids before its wait, and a line of an earlier layer's ids
    # must not answer for this layer's
    ids = tl.load(ids_ptr + tt[:, None] * TOPK + kk[None, :], mask=valid & routed, other=-1, cache_modifier=".cg")
    ids = tl.where(routed, ids, 100000 + kk[None, :] - TOPK)  # shared experts: distinct pseudo-ids
    ids = tl.where(valid, ids, -2)
    flat = tl.where(valid, tt[:, None] * SLOTS + kk[None, :], -1000)  # padding never aliases a real pair
    mine = tl.sum(tl.sum(tl.where(flat == p, ids, 0), axis=1), axis=0)
    match = (ids == mine) & valid
    is_first = tl.sum(tl.sum((match & (flat < p)).to(tl.int32), axis=1), axis=0) == 0
    pair_of = tl.max(tl.where(match, flat, -1), axis=1)  # [T_PAD]: a token names an expert at most once
    return mine, is_first, pair_of, k0 < TOPK


@triton.jit
def _moe_gate_up_kernel(x_ptr, ids_ptr, w_ptr, ws_ptr, act_ptr, I, K, stride_e,
                        T: tl.constexpr, T_PAD: tl.constexpr, TOPK: tl.constexpr, SLOTS: tl.constexpr,
                        SLOTS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        DOT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
                        FP8: tl.constexpr = False, s_ptr=None, ss_ptr=None, stride_se=0, KB=0, SG: tl.constexpr = 1,
                        SK: tl.constexpr = 1, ACT: tl.constexpr = False, GROUPS: tl.constexpr = 0):
    # FP8: block-scaled FP8 experts (fp8block.py), scales s_ptr / ss_ptr [E, ceil(2I / SG), KB] (gate's and up's
    # rows of a program each in one scale row: I a multiple of BLOCK_N); GROUPS: one token's grouped-activation
    # tiles [BLOCK_N, GROUPS, SK] (gemv_rows' GROUPS)
    p = tl.program_id(0)
    if PDL:  # the router's ids and the input rows come from earlier kernels
        gdc_wait()
    expert, is_first, pair_of, is_routed = _owner(ids_ptr, p, T, TOPK, SLOTS, SLOTS_PAD, T_PAD)
    if is_first:
        if is_routed:
            base = w_ptr + expert.to(tl.int64) * stride_e
            if FP8:
                sbase = s_ptr + expert.to(tl.int64) * stride_se
        else:
            base = ws_ptr + (expert - 100000).to(tl.int64) * stride_e
            if FP8:
                sbase = ss_ptr + (expert - 100000).to(tl.int64) * stride_se
        srow_a = (tl.program_id(1) * BLOCK_N) // SG
        srow_b = (tl.program_id(1) * BLOCK_N + I) // SG
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < I
        tt = tl.arange(0, T_PAD)
        uses = pair_of >= 0
        if GROUPS:
            acc_a3 = tl.zeros((BLOCK_N, GROUPS, SK), tl.float32)
            acc_b3 = tl.zeros((BLOCK_N, GROUPS, SK), tl.float32)
        elif DOT:
            dot_a = tl.zeros((T_PAD, BLOCK_N), tl.float32)
            dot_b = tl.zeros((T_PAD, BLOCK_N), tl.float32)
        else:
            acc_a = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), tl.float32)
            acc_b = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if GROUPS:  # one token (its row is used: is_first)
                go = group_offs(k, GROUPS, SK)
                xg = tl.load(x_ptr + go, mask=go < K, other=0.0)
                gmask = rmask[:, None, None] & (go < K)[None, :, :]
                wa3 = tl.load(base + rows[:, None, None].to(tl.int64) * K + go[None, :, :], mask=gmask, other=0.0)
                wb3 = tl.load(base + (rows + I)[:, None, None].to(tl.int64) * K + go[None, :, :], mask=gmask,
                              other=0.0)
                acc_a3 = fp8_fma_grouped(acc_a3, wa3, xg, sbase, srow_a, k, K, KB, GROUPS, SK)
                acc_b3 = fp8_fma_grouped(acc_b3, wb3, xg, sbase, srow_b, k, K, KB, GROUPS, SK)
            else:
                offs = k + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + tt[:, None] * K + offs[None, :], mask=uses[:, None] & (offs < K)[None, :], other=0.0)
                wmask = rmask[:, None] & (offs < K)[None, :]
                wa = tl.load(base + rows[:, None].to(tl.int64) * K + offs[None, :], mask=wmask, other=0.0)
                wb = tl.load(base + (rows + I)[:, None].to(tl.int64) * K + offs[None, :], mask=wmask, other=0.0)
                if DOT:
                    if FP8:
                        dot_a = fp8_block_dot(x, wa, dot_a, tl.load(sbase + srow_a * KB + k // SK), ACT, UPCAST)
                        dot_b = fp8_block_dot(x, wb, dot_b, tl.load(sbase + srow_b * KB + k // SK), ACT, UPCAST)
                    else:
                        dot_a = mma(x, wa, dot_a, UPCAST)
                        dot_b = mma(x, wb, dot_b, UPCAST)
                else:
                    if FP8:
                        if ACT:  # the input rounded once, each half's block scales on its own copy
                            xq = act_groups(x, T_PAD, SK, ACT, BLOCK_K)
                            xa = xq * col_scales(sbase, srow_a, k, K, KB, SK, BLOCK_K)[None, :]
                            xb = xq * col_scales(sbase, srow_b, k, K, KB, SK, BLOCK_K)[None, :]
                            acc_a += wa.to(tl.float32)[None, :, :] * xa[:, None, :]
                            acc_b += wb.to(tl.float32)[None, :, :] * xb[:, None, :]
                        else:
                            acc_a = fp8_fma(acc_a, wa, x, sbase, srow_a, k, K, KB, T_PAD, SK, ACT, BLOCK_K)
                            acc_b = fp8_fma(acc_b, wb, x, sbase, srow_b, k, K, KB, T_PAD, SK, ACT, BLOCK_K)
                    else:
                        acc_a += wa.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
                        acc_b += wb.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if PDL:
            gdc_launch_dependents()
        dt = act_ptr.dtype.element_ty
        if GROUPS:
            g = round_to_dtype(tl.sum(tl.sum(acc_a3, axis=2), axis=1)[None, :], dt)
            u = round_to_dtype(tl.sum(tl.sum(acc_b3, axis=2), axis=1)[None, :], dt)
        elif DOT:
            g = round_to_dtype(dot_a, dt)
            u = round_to_dtype(dot_b, dt)
        else:
            g = round_to_dtype(tl.sum(acc_a, axis=2), dt)
            u = round_to_dtype(tl.sum(acc_b, axis=2), dt)
        s = round_to_dtype(g / (1.0 + tl.exp(-g)), dt)
        tl.store(act_ptr + pair_of[:, None].to(tl.int64) * I + rows[None, :], (s * u).to(dt),
                 mask=uses[:, None] & rmask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, ids_ptr, w_ptr, ws_ptr, y_ptr, H, I, stride_e,
                     T: tl.constexpr, T_PAD: tl.constexpr, TOPK: tl.constexpr, SLOTS: tl.constexpr,
                     SLOTS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     DOT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
                     EARLY: tl.constexpr = False, wts_ptr=None, h_ptr=None, count_ptr=None,
                     NUM_SHARED: tl.constexpr = 0, REDUCE: tl.constexpr = False, FP8: tl.constexpr = False,
                     s_ptr=None, ss_ptr=None, stride_se=0, KB=0, SG: tl.constexpr = 1, SK: tl.constexpr = 1,
                     ACT: tl.constexpr = False, GROUPS: tl.constexpr = 0):
    # the router's ids are read before any wait (with PDL: the router finished before the gate/up kernel that
    # let us launch passed its own wait); EARLY (with PDL): the expert's first weight tile too. The
    # activations wait. REDUCE: the last of a column block's programs (every pair's, counted in count_ptr) adds
    # the weighted pairs' rows of those columns into h, as _moe_reduce_kernel would (one launch less)
    p = tl.program_id(0)
    expert, is_first, pair_of, is_routed = _owner(ids_ptr, p, T, TOPK, SLOTS, SLOTS_PAD, T_PAD)
    if is_routed:
        base = w_ptr + expert.to(tl.int64) * stride_e
        if FP8:
            sbase = s_ptr + expert.to(tl.int64) * stride_se
    else:
        base = ws_ptr + (expert - 100000).to(tl.int64) * stride_e
        if FP8:
            sbase = ss_ptr + (expert - 100000).to(tl.int64) * stride_se
    srow = (tl.program_id(1) * BLOCK_N) // SG
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    FIRST: tl.constexpr = BLOCK_K if EARLY else 0
    if EARLY:
        load0 = rmask & (tl.zeros((BLOCK_N,), tl.int32) + is_first.to(tl.int32) > 0)  # a duplicate pair: none
        if GROUPS:  # one token's grouped-activation tiles (gemv_rows' GROUPS)
            g0 = group_offs(0, GROUPS, SK)
            w0 = tl.load(base + rows[:, None, None].to(tl.int64) * I + g0[None, :, :],
                         mask=load0[:, None, None] & (g0 < I)[None, :, :], other=0.0)
        else:
            k0 = tl.arange(0, BLOCK_K)
            w0 = tl.load(base + rows[:, None].to(tl.int64) * I + k0[None, :], mask=load0[:, None] & (k0 < I)[None, :],
                         other=0.0)
    if PDL:
        gdc_wait()
    if is_first:
        uses = pair_of >= 0
        src = tl.where(uses, pair_of, 0).to(tl.int64) * I
        if GROUPS:
            src1 = tl.sum(src, axis=0)  # the one token's pair row
            acc3 = tl.zeros((BLOCK_N, GROUPS, SK), tl.float32)
            if EARLY:
                x0 = tl.load(act_ptr + src1 + g0, mask=g0 < I, other=0.0)
                acc3 = fp8_fma_grouped(acc3, w0, x0, sbase, srow, 0, I, KB, GROUPS, SK)
            for k in tl.range(FIRST, I, BLOCK_K, num_stages=STAGES):
                go = group_offs(k, GROUPS, SK)
                x = tl.load(act_ptr + src1 + go, mask=go < I, other=0.0)
                w = tl.load(base + rows[:, None, None].to(tl.int64) * I + go[None, :, :],
                            mask=rmask[:, None, None] & (go < I)[None, :, :], other=0.0)
                acc3 = fp8_fma_grouped(acc3, w, x, sbase, srow, k, I, KB, GROUPS, SK)
        else:
            if DOT:
                acc2 = tl.zeros((T_PAD, BLOCK_N), tl.float32)
            else:
                acc = tl.zeros((T_PAD, BLOCK_N, BLOCK_K), tl.float32)
            if EARLY:
                k0 = tl.arange(0, BLOCK_K)
                x0 = tl.load(act_ptr + src[:, None] + k0[None, :], mask=uses[:, None] & (k0 < I)[None, :], other=0.0)
                if DOT:
                    if FP8:
                        acc2 = fp8_block_dot(x0, w0, acc2, tl.load(sbase + srow * KB), ACT, UPCAST)
                    else:
                        acc2 = mma(x0, w0, acc2, UPCAST)
                else:
                    if FP8:
                        acc = fp8_fma(acc, w0, x0, sbase, srow, 0, I, KB, T_PAD, SK, ACT, BLOCK_K)
                    else:
                        acc += w0.to(tl.float32)[None, :, :] * x0.to(tl.float32)[:, None, :]
            for k in tl.range(FIRST, I, BLOCK_K, num_stages=STAGES):
                offs = k + tl.arange(0, BLOCK_K)
                x = tl.load(act_ptr + src[:, None] + offs[None, :], mask=uses[:, None] & (offs < I)[None, :], other=0.0)
                w = tl.load(base + rows[:, None].to(tl.int64) * I + offs[None, :], mask=rmask[:, None] & (offs < I)[None, :],
                            other=0.0)
                if DOT:
                    if FP8:
                        acc2 = fp8_block_dot(x, w, acc2, tl.load(sbase + srow * KB + k // SK), ACT, UPCAST)
                    else:
                        acc2 = mma(x, w, acc2, UPCAST)
                else:
                    if FP8:
                        acc = fp8_fma(acc, w, x, sbase, srow, k, I, KB, T_PAD, SK, ACT, BLOCK_K)
                    else:
                        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if PDL:
            gdc_launch_dependents()
        if GROUPS:
            y = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
        elif DOT:
            y = acc2
        else:
            y = tl.sum(acc, axis=2)  # fp32, unrounded: the shared halves are summed before rounding
        tl.store(y_ptr + pair_of[:, None].to(tl.int64) * H + rows[None, :], y, mask=uses[:, None] & rmask[None, :])
    if REDUCE:
        tl.debug_barrier()  # every thread's rows stored before the count
        done = tl.atomic_add(count_ptr + tl.program_id(1), 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.store(count_ptr + tl.program_id(1), 0)  # reset for the next call
            for t in tl.static_range(T):
                _reduce_cols(y_ptr, wts_ptr, h_ptr, t, rows, rmask, H, TOPK, NUM_SHARED, ".cg")


@triton.jit
def _reduce_cols(y_ptr, wts_ptr, h_ptr, t, cols, cmask, H, TOPK: tl.constexpr, NUM_SHARED: tl.constexpr,
                 CM: tl.constexpr):
    # h[t, cols] += routed pairs' rows (each rounded, times its rounded weight, rounded) + the shared experts'
    # rows (fp32 sum, one rounding), in that order of roundings; CM ".cg": the rows were stored by other
    # programs of this launch (read past L1)
    SLOTS: tl.constexpr = TOPK + NUM_SHARED
    dt = h_ptr.dtype.element_ty
    routed = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(TOPK):
        w = round_to_dtype(tl.load(wts_ptr + t * TOPK + k), dt)
        yk = round_to_dtype(tl.load(y_ptr + (t * SLOTS + k) * H + cols, mask=cmask, other=0.0, cache_modifier=CM), dt)
        routed += round_to_dtype(yk * w, dt)
    shared = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(NUM_SHARED):
        shared += tl.load(y_ptr + (t * SLOTS + TOPK + s) * H + cols, mask=cmask, other=0.0, cache_modifier=CM)
    out = round_to_dtype(shared, dt)
    if TOPK > 0:
        out = round_to_dtype(round_to_dtype(routed, dt) + out, dt)
    h = tl.load(h_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
    h = (h + out).to(dt)
    tl.store(h_ptr + t * H + cols, h, mask=cmask)
    return h


@triton.jit
def _moe_down_rows_kernel(act_ptr, ids_ptr, w_ptr, ws_ptr, wts_ptr, h_ptr, H, I, stride_e, TOPK: tl.constexpr,
                          NUM_SHARED: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
                          EARLY: tl.constexpr = False):
    # one token's down projections and their reduce by output rows: a program owns BLOCK_N rows of h and walks
    # every pair (routed, then shared), one [BLOCK_N, I] tile a pair (BLOCK_K >= I), so its stream is all the
    # layer's pairs back to back and no other program's rows are waited for; the sums are combined as
    # _reduce_cols combines the down kernel's rows (each routed row rounded, times its rounded weight, rounded;
    # the shared rows summed in fp32, one rounding). The router's ids are read before the wait (the router
    # finished before the gate/up kernel that let this one launch passed its own wait)
    SLOTS: tl.constexpr = TOPK + NUM_SHARED
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    offs = tl.arange(0, BLOCK_K)
    kmask = offs < I
    wmask = rmask[:, None] & kmask[None, :]
    dt = h_ptr.dtype.element_ty
    sj = tl.arange(0, SLOTS_PAD)
    ids = tl.load(ids_ptr + sj, mask=sj < TOPK, other=0, cache_modifier=".cg")  # the pairs' experts, loop-invariant
    wts = tl.load(wts_ptr + sj, mask=sj < TOPK, other=0.0, cache_modifier=".cg")
    if EARLY:  # the first pair's weight tile before the wait
        e0 = tl.sum(tl.where(sj == 0, ids, 0))
        b0 = (w_ptr + e0.to(tl.int64) * stride_e) if TOPK > 0 else ws_ptr
        w0 = tl.load(b0 + rows[:, None].to(tl.int64) * I + offs[None, :], mask=wmask, other=0.0)
    if PDL:
        gdc_wait()
    routed = tl.zeros((BLOCK_N,), tl.float32)
    shared = tl.zeros((BLOCK_N,), tl.float32)
    FIRST: tl.constexpr = 1 if EARLY else 0
    if EARLY:
        x0 = tl.load(act_ptr + offs, mask=kmask, other=0.0)
        y0 = tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)
        if TOPK > 0:
            routed += round_to_dtype(round_to_dtype(y0, dt) * round_to_dtype(tl.sum(tl.where(sj == 0, wts, 0.0)), dt),
                                     dt)
        else:
            shared += y0
    for sl in tl.range(FIRST, SLOTS, num_stages=STAGES):
        is_routed = sl < TOPK
        e = tl.sum(tl.where(sj == sl, ids, 0))
        base = tl.where(is_routed, w_ptr + e.to(tl.int64) * stride_e, ws_ptr + tl.cast(sl - TOPK, tl.int64) * stride_e)
        w = tl.load(base + rows[:, None].to(tl.int64) * I + offs[None, :], mask=wmask, other=0.0)
        x = tl.load(act_ptr + tl.cast(sl, tl.int64) * I + offs, mask=kmask, other=0.0)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        wt = round_to_dtype(tl.sum(tl.where(sj == sl, wts, 0.0)), dt)
        routed += tl.where(is_routed, round_to_dtype(round_to_dtype(y, dt) * wt, dt), 0.0)
        shared += tl.where(is_routed, 0.0, y)
    if PDL:
        gdc_launch_dependents()
    out = round_to_dtype(shared, dt)
    if TOPK > 0:
        out = round_to_dtype(round_to_dtype(routed, dt) + out, dt)
    h = tl.load(h_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(h_ptr + rows, (h + out).to(dt), mask=rmask)


@triton.jit
def _moe_reduce_kernel(y_ptr, wts_ptr, h_ptr, H, TOPK: tl.constexpr, NUM_SHARED: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False, NORM: tl.constexpr = False, nw_ptr=None,
                       xn_ptr=None, eps=1e-6, stride_xn=0):
    # NORM (one program a row, BLOCK >= H): the row of h just written, RMSNorm'd with nw_ptr's weight into xn_ptr's
    # row t, as smallops.rmsnorm_rows computes it (the next block's attention input: one launch less a layer)
    t = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    h = _reduce_cols(y_ptr, wts_ptr, h_ptr, t, cols, cmask, H, TOPK, NUM_SHARED, "")
    if NORM:
        x = tl.where(cmask, h.to(tl.float32), 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(nw_ptr + cols, mask=cmask, other=0.0)
        xr = round_to_dtype(x * inv, w.dtype)
        tl.store(xn_ptr + t * stride_xn + cols, (xr * w.to(tl.float32)).to(w.dtype), mask=cmask)


class GroupedMoe:
    """Launch plan of one MoE (or dense, TOPK = 0 with the MLP as the one shared expert) for T tokens."""

    # (block_n, block_k, num_warps, num_stages) of gate/up and down on the tensor-core path (T > 1)
    # (H200 sweeps; down 64 wide since run SW2: -1.1% a 4-slot step, -1.0% an 8-slot one against 32 x 128)
    DOT_TILES: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] = ((32, 128, 4, 4), (64, 128, 4, 4))
    # ... and of one token (fp32 FMAs): best of bench/decode_gpu_mla.py's plain_tile_sweep (H200, runs T1, T2 on PDL)
    PLAIN_TILES: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] = ((8, 512, 4, 3), (8, 512, 4, 3))
    # ... down's of one token where the hidden size is WIDE_HIDDEN or more: the DeepSeek-V3 shape (hidden 7168)
    # steps 31 us faster on T1's down and wo tiles than on T2's, which won on V2-Lite's 2048 (run D1)
    WIDE_HIDDEN: int = 4096
    WIDE_DOWN_TILE: tuple[int, int, int, int] = (32, 256, 4, 3)
    # one token's down projections with their reduce by output rows (_moe_down_rows_kernel: a program's rows over
    # every pair, one [rows, I] tile a pair): (rows, warps, stages); None: the down kernel by pairs and its last
    # program's reduce (also where I > DOWN_ROWS_MAX_I, FP8 experts, several tokens)
    DOWN_ROWS_TILE: tuple[int, int, int] | None = (4, 4, 3)
    DOWN_ROWS_MAX_I: int = 2048
    # one token: the weighted sum of the pairs' rows into h by the down kernel's last program of each column
    # block (_moe_down_kernel's REDUCE) instead of a launch of its own (_moe_reduce_kernel). Run SW2: a plain
    # step 2.188 -> 2.151 ms; but 4 slots 3.967 -> 4.036 (the down kernel's tail waits for its last programs'
    # 32 pairs), so several tokens keep the launch. None in __init__: this
    FUSED_REDUCE: bool = True
    # one token over block-scaled FP8 experts: the fewest rows a program of "gate_up" / "down" (absent:
    # fp8block.FMA_ACT_BLOCK_N; never fewer than the tile's own). DeepSeek-V3 shape (H200, run G48): down at 64
    # rows -18 us a step (16: +-0, 128: +27 us), gate/up best at 32 (16: +68 us, 64: +108)
    FP8_ROWS: dict[str, int] = {"down": 64}

    def __init__(self, *, num_tokens: int, top_k: int, num_shared: int, hidden: int, inter: int,
                 device: torch.device | str, tiles: tuple[tuple[int, int, int, int], ...] | None = None,
                 pdl: bool = False, early: bool = True, fused_reduce: bool | None = None):
        self.num_tokens, self.top_k, self.num_shared = num_tokens, top_k, num_shared
        self.pdl, self.early = pdl, pdl and early
        self.hidden, self.inter = hidden, inter
        self.slots = top_k + num_shared
        self.dot = num_tokens > 1  # several tokens: tensor-core dots (bf16 experts), as gemv_rows
        if self.dot:
            default = self.DOT_TILES
        else:
            bk = max(32, 256 // triton.next_power_of_2(num_tokens))  # [T, BLOCK_N, BLOCK_K] accumulators
            default = self.PLAIN_TILES if num_tokens == 1 else ((8, bk, 4, 4), (8, bk, 4, 4))
            if num_tokens == 1 and hidden >= self.WIDE_HIDDEN:
                default = (default[0], self.WIDE_DOWN_TILE)
        self.tiles = tiles or default
        self.act = torch.zeros(num_tokens * self.slots * inter, dtype=torch.bfloat16, device=device)
        self.out_rows = torch.zeros(num_tokens * self.slots * hidden, dtype=torch.float32, device=device)
        self.fused_reduce = self.FUSED_REDUCE and num_tokens == 1 if fused_reduce is None else fused_reduce
        # finished programs per column block of the down kernel (fused_reduce), back to 0 after each call (FP8
        # experts may cut the tile's rows to their scale rows: room for 16-row blocks)
        self.count = torch.zeros(triton.cdiv(hidden, min(self.tiles[1][0], 16)), dtype=torch.int32, device=device)

    def __call__(self, xn: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor, h: torch.Tensor,
                 shared_done: bool = False, next_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> bool:
        """h[T, H] += MoE(xn); routed weights [E, 2I, H] / [E, H, I], shared [S, 2I, H] / [S, H, I]; bf16, or
        block-scaled FP8 (fp8block.BlockFp8, routed and shared alike: mla.prepare_layer lays them out so).
        ``shared_done``: the shared experts' act rows are written already (:meth:`shared_gate_up` given to the
        router's launch): the gate/up launch covers the routed pairs only. ``next_norm`` (weight, out [T, H], eps):
        where the sums into h take a launch of their own (several tokens), that launch also writes RMSNorm(h) *
        weight into out (smallops.rmsnorm_rows' values); returns whether it did."""
        t, hid, inter = self.num_tokens, self.hidden, self.inter
        fp8 = isinstance(w_gate_up, BlockFp8)
        dot = self.dot and (fp8 or w_gate_up.dtype in (torch.bfloat16, torch.float16))
        common = dict(T=t, T_PAD=DOT_ROWS if dot else triton.next_power_of_2(t), TOPK=self.top_k,
                      SLOTS=self.slots, SLOTS_PAD=triton.next_power_of_2(self.slots), DOT=dot,
                      UPCAST=interpreting(), PDL=self.pdl, **launch_opts(self.pdl))
        (bn, bk, nw, st), (bn2, bk2, nw2, st2) = self.tiles
        up_args, down_args = {}, {}
        if fp8:
            if shared_gate_up is None:  # no shared experts: the kernels' shared pointers are never read
                shared_gate_up, shared_down = w_gate_up, w_down
            if inter % w_gate_up.rows:  # each half's rows in whole scale rows (the up half's start, srow_b)
                raise ValueError(f"FP8 experts of {inter} rows in {w_gate_up.rows}-row scale blocks")
            bn, bk = fp8_tile(w_gate_up, bn, bk, dot, accumulators=2,  # gate and up rows a program
                              act_rows=self.FP8_ROWS.get("gate_up"))
            bn2, bk2 = fp8_tile(w_down, bn2, bk2, dot, act_rows=self.FP8_ROWS.get("down"))
            up_args = dict(_expert_scales(w_gate_up, shared_gate_up), GROUPS=fp8_groups(w_gate_up, t, dot, bk))
            down_args = dict(_expert_scales(w_down, shared_down), GROUPS=fp8_groups(w_down, t, dot, bk2))
            w_gate_up, shared_gate_up, w_down, shared_down = w_gate_up.w, shared_gate_up.w, w_down.w, shared_down.w
        if not fp8 and not dot:
            bn = interpreted_rows(bn, inter)
        pairs = t * self.slots
        if shared_done and t != 1:
            raise ValueError("shared_done: one token's shared experts run in the router's launch, not several's")
        up_pairs = t * self.top_k if shared_done else pairs  # the gate/up launch's (the routed ones only)
        _moe_gate_up_kernel[(up_pairs, triton.cdiv(inter, bn))](
            xn, ids, w_gate_up, shared_gate_up, self.act, inter, hid, 2 * inter * hid, **common,
            BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw, **up_args)
        if self.DOWN_ROWS_TILE and t == 1 and not fp8 and inter <= self.DOWN_ROWS_MAX_I:
            rbn, rnw, rst = self.DOWN_ROWS_TILE
            rbn = interpreted_rows(rbn, hid)
            _moe_down_rows_kernel[(triton.cdiv(hid, rbn),)](
                self.act, ids, w_down, shared_down if shared_down is not None else w_down, wts, h, hid, inter,
                hid * inter, TOPK=self.top_k, NUM_SHARED=self.num_shared,
                SLOTS_PAD=triton.next_power_of_2(self.slots), BLOCK_N=rbn,
                BLOCK_K=triton.next_power_of_2(inter), STAGES=rst, PDL=self.pdl, EARLY=self.early, num_warps=rnw,
                **launch_opts(self.pdl))
            return False
        if self.fused_reduce:  # the last program of each column block adds the pairs' rows into h
            _moe_down_kernel[(pairs, triton.cdiv(hid, bn2))](
                self.act, ids, w_down, shared_down, self.out_rows, hid, inter, hid * inter, **common,
                BLOCK_N=bn2, BLOCK_K=bk2, STAGES=st2, EARLY=self.early, num_warps=nw2, wts_ptr=wts, h_ptr=h,
                count_ptr=self.count, NUM_SHARED=self.num_shared, REDUCE=True, **down_args)
            return False
        _moe_down_kernel[(pairs, triton.cdiv(hid, bn2))](
            self.act, ids, w_down, shared_down, self.out_rows, hid, inter, hid * inter, **common,
            BLOCK_N=bn2, BLOCK_K=bk2, STAGES=st2, EARLY=self.early, num_warps=nw2, **down_args)
        if next_norm is not None:  # a row a program, as smallops.rmsnorm_rows (its block and warps: its sums' order)
            nw, xn_out, eps = next_norm
            _moe_reduce_kernel[(t, 1)](self.out_rows, wts, h, hid, TOPK=self.top_k, NUM_SHARED=self.num_shared,
                                       BLOCK=triton.next_power_of_2(hid), PDL=self.pdl, NORM=True, nw_ptr=nw,
                                       xn_ptr=xn_out, eps=eps, stride_xn=xn_out.stride(0), num_warps=8,
                                       **launch_opts(self.pdl))
            return True
        _moe_reduce_kernel[(t, triton.cdiv(hid, 1024))](self.out_rows, wts, h, hid, TOPK=self.top_k,
                                                        NUM_SHARED=self.num_shared, BLOCK=1024, PDL=self.pdl,
                                                        num_warps=4, **launch_opts(self.pdl))
        return False

    def shared_gate_up(self, w_shared: torch.Tensor) -> "SharedGateUp | None":
        """The router-launch form of this MoE's shared experts' gate/up (router(shared=...)), where it applies: one
        token, bf16 shared experts, a gate/up tile of 4 warps (the router's); else None."""
        bn, bk, nw, st = self.tiles[0]
        if self.num_tokens != 1 or w_shared is None or isinstance(w_shared, BlockFp8) or nw != 4 \
                or w_shared.dtype not in (torch.bfloat16, torch.float16) or not w_shared.is_contiguous():
            return None
        return SharedGateUp(w_shared, self.act, self.inter, bn, bk, st)


def _expert_scales(routed: BlockFp8, shared: BlockFp8) -> dict:
    """The grouped expert kernels' FP8 arguments: routed and shared experts in the same blocks."""
    if not isinstance(shared, BlockFp8) or (shared.rows, shared.cols, shared.act) != (routed.rows, routed.cols, routed.act) \
            or shared.scale.shape[1:] != routed.scale.shape[1:]:
        raise ValueError("FP8 routed experts need their shared experts in the same FP8 blocks (mla.prepare_layer)")
    if not (routed.scale.is_contiguous() and shared.scale.is_contiguous() and routed.w.is_contiguous()
            and shared.w.is_contiguous()):
        raise ValueError("FP8 experts and their scales must be contiguous (the kernels index them by shape)")
    return dict(kernel_args(routed), ss_ptr=shared.scale, stride_se=routed.scale.stride(0))
