"""Split-K decode attention (flash-decoding) in Triton, for GQA and for absorbed MLA (torch twin: reference.attention).

One program per (kv head, split): it loads every query head of the group (GQA: Hq/Hkv heads; MLA:
all heads over the one shared latent) and walks its slice of the sequence once, so each KV byte is
read exactly once per step. The number of splits is fixed at capture time; the slice length is
derived in the kernel from the sequence length held in a device tensor (``pos + 1``), so one CUDA
graph serves every position. A second tiny kernel merges the splits (log-sum-exp).

GQA decode (one query token, ``DecodeAttention.one_launch``) runs one kernel instead
(``_gqa_split_kernel``): before waiting on the previous kernel (PDL) each program reads the position
and starts loading its first K/V block (rows of earlier steps, which no kernel in flight writes);
this step's row ``pos`` joins the softmax after the loop (one online update); and the last program of
a kv head to finish (a per-head counter, atomically counted and reset) merges the splits.

Queries may span ``T`` consecutive new tokens (speculative verify): query row ``t`` sees keys
``<= pos + t``. Layouts: q ``[T, Hq, D_QK]``; keys ``[max_tokens, Hkv, key_stride]`` of which the
first ``D_MAIN`` elements are dotted with q's first ``D_MAIN`` and, for MLA, the ``D_ROPE`` elements
at ``rope_offset`` with q's last ``D_ROPE``; values are the first ``D_V`` elements at ``v_ptr``.

Qwen3 (``qk_norm``, one token per step): q and this step's K row arrive as projected; every program
applies the per-head q RMSNorm + rope to its query rows on load (smallops.norm_rope_rows). The split
that holds row ``pos`` normalises + rotates that K row in registers, writes it back to the cache for
later steps, and adds that one key (with its V row) to its softmax after its loop, which stops before
``pos``: the loop is the plain one, and no program reads a cache row written in the same step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .gemv import gdc_launch_dependents, gdc_wait, interpreting, launch_opts
from .kvfp8 import fp8_kv_load, fp8_kv_read
from .kernel_helpers import act_round, act_scale
from .smallops import norm_rope_rows


@triton.jit
def qk_operand(q, KV_FMT: tl.constexpr, amax_more=0.0):
    # q as the score dot's left operand and the factor the dot's results take back: as it is over a
    # model-dtype cache; over FP8 K (fp16 tiles, kvfp8.fp8_kv_load) q in fp16, every bf16 q value exact there
    # once a power of two keeps the largest |q| (and ``amax_more``: MLA's rope part, scaled by the same power)
    # at most 2^14 (a scale of 1 for any usual model)
    if KV_FMT:
        amax = tl.maximum(tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0), amax_more)
        shift = tl.maximum(tl.ceil(tl.log2(amax)) - 14.0, 0.0)
        return (q.to(tl.float32) * tl.exp2(-shift)).to(tl.float16), tl.exp2(shift)
    else:
        return q, 1.0


@triton.jit
def pv_dot(p, v, acc, DOT_F32: tl.constexpr):
    # acc + p @ v for fp32 p: p = hi + lo in v's dtype, so two tensor-core dots give p @ v to ~2^-16 (bf16 v)
    # or ~2^-22 (fp16 v), not the one rounding's 2^-8 / 2^-11; FP8 callers pass p times 2^12, so that fp16's
    # subnormals (below 2^-14) cost nothing a softmax weight would show
    if DOT_F32:
        return tl.dot(p, v.to(tl.float32), acc)
    p_hi = p.to(v.dtype)
    acc = tl.dot(p_hi, v, acc)
    return tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)


# FP8 V: softmax weights scaled by this before pv_dot (fp16 tiles), the output by its inverse
P_SCALE_FP8 = tl.constexpr(4096.0)


@triton.jit
def _online_block(q_op, q_pe, k, k_pe, v, offs, smask, limit, m, l, acc, dot_scale, D_ROPE: tl.constexpr,
                  KV_FMT: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr = True):
    # one key block's scores (main part, and MLA's rope part) and its online-softmax update of (m, l, acc); CAUSAL:
    # query row r sees keys up to limit[r] (else every key of the block's mask)
    if DOT_F32:
        scores = tl.dot(q_op.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        scores = tl.dot(q_op, tl.trans(k))
    if D_ROPE > 0:
        if DOT_F32:
            scores += tl.dot(q_pe.to(tl.float32), tl.trans(k_pe.to(tl.float32)))
        else:
            scores += tl.dot(q_pe, tl.trans(k_pe))
    scores = scores * dot_scale
    if CAUSAL:
        scores = tl.where(smask[None, :] & (offs[None, :] <= limit[:, None]), scores, float("-inf"))
    else:
        scores = tl.where(smask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    if KV_FMT:
        acc = pv_dot(p * P_SCALE_FP8, v, acc * alpha[:, None], DOT_F32)
    else:
        acc = pv_dot(p, v, acc * alpha[:, None], DOT_F32)
    return m_new, l, acc


@triton.jit
def _attn_split_kernel(q_ptr, q_pe_ptr, k_ptr, v_ptr, pos_ptr, part_o_ptr, part_ml_ptr, sm_scale,
                       stride_qt, stride_qh, stride_kt, stride_vt, rope_offset,
                       qn_ptr, kn_ptr, cos_ptr, sin_ptr, qk_eps, slot_ptr, stride_ks, stride_vs, stride_qb,
                       QK_NORM: tl.constexpr, BATCH: tl.constexpr,
                       T: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       GROUP: tl.constexpr, ROWS: tl.constexpr, D_MAIN: tl.constexpr, D_ROPE: tl.constexpr,
                       D_V: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                       DOT_F32: tl.constexpr, V_IS_K: tl.constexpr, V_CHUNKS: tl.constexpr, PDL: tl.constexpr,
                       HEAD_BLOCKS: tl.constexpr = 1, POS_ROW_PROLOGUE: tl.constexpr = False,
                       KV_FMT: tl.constexpr = 0, k_scale=1.0, v_scale=1.0,
                       idx_ptr=None, nidx_ptr=None, SPARSE: tl.constexpr = False, MIN_CHUNK: tl.constexpr = 0,
                       POS_LAST: tl.constexpr = False):
    # KV_FMT > 0: K/V are FP8 bytes (kvfp8.kv_fmt) read as fp8 * k_scale / v_scale (no qk norm; MLA: the rope
    # part too, q_pe in fp16 by q's power of two)
    # SPARSE (one query token, sparse attention): the keys are the nidx_ptr[0] cache rows listed at idx_ptr
    # (the indexer's top-k, any order; a listed row past pos is not visible), split like a dense sequence
    # POS_LAST (one query token, dense, model-dtype K/V): the splits share the rows of earlier steps (0..pos-1),
    # and this step's row pos joins the softmax of the split it falls in (the last, past them) after its loop, as
    # one online update: at a context of a multiple of BLOCK_S * NUM_SPLITS rows the row past them no longer
    # costs every split a block of its own
    # MIN_CHUNK: the fewest keys a split takes (a multiple of BLOCK_S); a short sequence leaves the later splits
    # empty (their partials weigh nothing in the merge) rather than cut into many tiny pieces
    # D_V is the width of this program's slice of the values: chunk program_id(2) of V_CHUNKS.
    # program_id(0) = kv head * HEAD_BLOCKS + head block: each program takes GROUP / HEAD_BLOCKS of the
    # group's query heads (MLA with 128 heads: all of them in one program would not fit shared memory)
    kvh = tl.program_id(0) // HEAD_BLOCKS
    GB: tl.constexpr = GROUP // HEAD_BLOCKS
    hb = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(1)
    vchunk = tl.program_id(2) % V_CHUNKS
    D_V_ALL: tl.constexpr = D_V * V_CHUNKS
    if PDL:  # q and this step's K/V rows come from the previous kernel
        gdc_wait()
    if BATCH:  # batch row b: its query, position and partials; the K/V of its slot (slot_ptr[b])
        b = tl.program_id(2) // V_CHUNKS
        slot = tl.load(slot_ptr + b).to(tl.int64)
        k_ptr += slot * stride_ks
        v_ptr += slot * stride_vs
        q_ptr += b * stride_qb
        q_pe_ptr += b * (T * NUM_Q_HEADS * D_ROPE)  # MLA: row b's rope part, [B, T, Hq, D_ROPE]
        pos_ptr += b
        part_o_ptr += b * (T * NUM_Q_HEADS * NUM_SPLITS * D_V_ALL)
        part_ml_ptr += b * (T * NUM_Q_HEADS * NUM_SPLITS * 2)
    pos = tl.load(pos_ptr)
    seq_len = pos + T  # keys valid after this step's writes
    if SPARSE:
        seq_len = tl.load(nidx_ptr)  # listed rows
    if POS_LAST:  # the loop over rows 0..pos-1; row pos after it, in the split it falls in (the last one past them)
        seq_len = pos
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_S) * BLOCK_S, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    r = tl.arange(0, ROWS)  # row = t * GB + g: head g of this program's block of the group
    t_of = r // GB
    head = kvh * GROUP + hb * GB + (r % GB)
    rvalid = r < T * GB
    q_row = q_ptr + t_of * stride_qt + head * stride_qh
    dm = tl.arange(0, D_MAIN)
    q = tl.load(q_row[:, None] + dm[None, :], mask=rvalid[:, None], other=0.0)
    q_pe = q  # (no rope part: unused)
    if QK_NORM:  # Qwen3, T == 1: q rows and this step's K row (pos) normalised + rotated here
        HALF: tl.constexpr = D_MAIN // 2
        swapped = ((dm + HALF) % D_MAIN)[None, :]
        qp = tl.load(q_row[:, None] + swapped, mask=rvalid[:, None], other=0.0)
        q = norm_rope_rows(q, qp, qn_ptr, cos_ptr, sin_ptr, pos, qk_eps, D_MAIN).to(q.dtype)
        k_row = k_ptr + pos.to(tl.int64) * stride_kt + kvh * D_MAIN
        k_raw = tl.load(k_row + dm[None, :])  # [1, D]
        k_new = norm_rope_rows(k_raw, tl.load(k_row + swapped), kn_ptr, cos_ptr, sin_ptr, pos, qk_eps,
                               D_MAIN).to(k_raw.dtype)
        holds_pos = (start <= pos) & (pos < end)
        if POS_ROW_PROLOGUE:  # V row pos loaded here (its latency under the loop's); K row pos stored after
            # the loop, so no store to the cache precedes the loop's loads and they issue with the prologue's
            v_pos_pre = tl.load(v_ptr + pos.to(tl.int64) * stride_vt + kvh * D_V_ALL + tl.arange(0, D_V))
        else:
            if holds_pos:  # stored for later steps; this step takes row pos from registers, after the loop
                tl.store(k_row + dm[None, :], k_new)
        end = tl.minimum(end, pos)
    if D_ROPE > 0:  # MLA: the rope part of q lives in its own [T, Hq, D_ROPE] buffer
        dr = tl.arange(0, D_ROPE)
        q_pe = tl.load(q_pe_ptr + ((t_of * NUM_Q_HEADS + head) * D_ROPE)[:, None] + dr[None, :],
                       mask=rvalid[:, None], other=0.0)
    dv = tl.arange(0, D_V)
    qk_scale = sm_scale * 1.4426950408889634
    if D_ROPE > 0 and KV_FMT:  # one power of two for both parts of q: the score is one sum
        q_op, q_back = qk_operand(q, KV_FMT, tl.max(tl.max(tl.abs(q_pe.to(tl.float32)), axis=1), axis=0))
        q_pe = (q_pe.to(tl.float32) * (1.0 / q_back)).to(tl.float16)
    else:
        q_op, q_back = qk_operand(q, KV_FMT)
    dot_scale = qk_scale * q_back
    if KV_FMT:
        dot_scale = dot_scale * k_scale
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_V), tl.float32)
    limit = pos + t_of  # last key index each row may see
    for s in range(start, end, BLOCK_S):
        offs = s + tl.arange(0, BLOCK_S)
        smask = offs < end
        if SPARSE:  # the cache rows this block of the list names
            offs = tl.load(idx_ptr + offs, mask=smask, other=0)
        kbase = k_ptr + offs[:, None].to(tl.int64) * stride_kt + kvh * D_MAIN
        k = fp8_kv_read(tl.load(kbase + dm[None, :], mask=smask[:, None], other=0), KV_FMT, DOT_F32)
        k_pe = k
        if D_ROPE > 0:
            k_pe = fp8_kv_read(tl.load(k_ptr + offs[:, None].to(tl.int64) * stride_kt + rope_offset + dr[None, :],
                                       mask=smask[:, None], other=0), KV_FMT, DOT_F32)
        if V_IS_K:  # MLA: the values are the latent itself, already loaded as keys
            v = k
        else:
            v = fp8_kv_read(tl.load(v_ptr + offs[:, None].to(tl.int64) * stride_vt + kvh * D_V_ALL + vchunk * D_V
                                    + dv[None, :], mask=smask[:, None], other=0), KV_FMT, DOT_F32)
        m, l, acc = _online_block(q_op, q_pe, k, k_pe, v, offs, smask, limit, m, l, acc, dot_scale, D_ROPE, KV_FMT,
                                  DOT_F32)
    if POS_LAST:
        if split == tl.minimum(pos // tl.maximum(chunk, BLOCK_S), NUM_SPLITS - 1):  # row pos: one update
            prow_k = k_ptr + pos.to(tl.int64) * stride_kt
            s_pos = tl.sum(q.to(tl.float32) * tl.load(prow_k + kvh * D_MAIN + dm).to(tl.float32)[None, :], axis=1)
            if D_ROPE > 0:
                s_pos += tl.sum(q_pe.to(tl.float32) * tl.load(prow_k + rope_offset + dr).to(tl.float32)[None, :],
                                axis=1)
            s_pos = s_pos * dot_scale
            m_new = tl.maximum(m, s_pos)
            alpha = tl.exp2(m - m_new)
            p_pos = tl.exp2(s_pos - m_new)
            v_pos = tl.load(v_ptr + pos.to(tl.int64) * stride_vt + kvh * D_V_ALL + vchunk * D_V + dv).to(tl.float32)
            acc = acc * alpha[:, None] + p_pos[:, None] * v_pos[None, :]
            l = l * alpha + p_pos
            m = m_new
    if QK_NORM:
        if holds_pos:  # the key at pos (every query row sees it: T == 1), one online-softmax update
            s_pos = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
            m_new = tl.maximum(m, s_pos)
            alpha = tl.exp2(m - m_new)
            p_pos = tl.exp2(s_pos - m_new)
            if POS_ROW_PROLOGUE:
                v_pos = v_pos_pre.to(tl.float32)
                tl.store(k_row + dm[None, :], k_new)  # for later steps (no program of this step reads it)
            else:
                v_pos = tl.load(v_ptr + pos.to(tl.int64) * stride_vt + kvh * D_V_ALL + dv).to(tl.float32)
            acc = acc * alpha[:, None] + p_pos[:, None] * v_pos[None, :]
            l = l * alpha + p_pos
            m = m_new
    if PDL:
        gdc_launch_dependents()
    if KV_FMT:
        acc = acc * (v_scale / P_SCALE_FP8)
    # partials: [T, Hq, NUM_SPLITS, D_V] and [T, Hq, NUM_SPLITS, 2] (max in log2 units, sum)
    prow = (t_of * NUM_Q_HEADS + head) * NUM_SPLITS + split
    tl.store(part_o_ptr + prow[:, None] * D_V_ALL + vchunk * D_V + dv[None, :], acc, mask=rvalid[:, None])
    if vchunk == 0:  # every value chunk computed the same max and sum
        tl.store(part_ml_ptr + prow * 2, m, mask=rvalid)
        tl.store(part_ml_ptr + prow * 2 + 1, l, mask=rvalid)


@triton.jit
def split_weights(part_ml_ptr, row, NUM_SPLITS: tl.constexpr):
    # the log-sum-exp merge of partial row ``row``'s splits: each split's weight (0 for a split that saw no
    # key) and the weighted sum of their softmax sums (the merged output is sum(w * o) / that)
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + sp) * 2)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + sp) * 2 + 1)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.max(m, axis=0)))
    return w, tl.sum(w * l, axis=0)


@triton.jit
def _attn_combine_kernel(part_o_ptr, part_ml_ptr, out_ptr, NUM_SPLITS: tl.constexpr, D_V: tl.constexpr,
                         PDL: tl.constexpr, QUANT: tl.constexpr = False, q_ptr=None, xs_ptr=None,
                         amax_ptr=None, AMAX: tl.constexpr = False):
    # QUANT: each output row (D_V values, one activation group of the next GEMV) also through vLLM's FP8 rounding,
    # its FP8 values into q_ptr and its scale into xs_ptr[row] (what fp8.quant_groups makes of out). AMAX: row's
    # largest |out| into amax_ptr[row], the parts a per-token FP8 GEMV's input scale is the max of
    row = tl.program_id(0)  # (b * T + t) * Hq + head
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    sp = tl.arange(0, NUM_SPLITS)
    w, denom = split_weights(part_ml_ptr, row, NUM_SPLITS)
    dv = tl.arange(0, D_V)
    # a split that saw no key weighs nothing: its partial is not read (a short context in a long slot leaves most)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + sp)[:, None] * D_V + dv[None, :], mask=(w > 0)[:, None], other=0.0)
    o = (tl.sum(o * w[:, None], axis=0) / denom).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D_V + dv, o)
    if AMAX:
        tl.store(amax_ptr + row, tl.max(tl.abs(o.to(tl.float32)), axis=0))
    if QUANT:
        of = o.to(tl.float32)
        sx = act_scale(tl.max(tl.abs(of), axis=0))
        tl.store(q_ptr + row * D_V + dv, act_round(of, 1.0 / sx))
        tl.store(xs_ptr + row, sx)


@triton.jit
def _gqa_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, part_o_ptr, part_ml_ptr, count_ptr, out_ptr, sm_scale,
                      stride_qh, stride_kt, stride_vt, qn_ptr, kn_ptr, cos_ptr, sin_ptr, qk_eps,
                      slot_ptr, stride_ks, stride_vs, stride_qb, stride_ob,
                      QK_NORM: tl.constexpr, BATCH: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                      NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DOT_F32: tl.constexpr,
                      PDL: tl.constexpr, KV_FMT: tl.constexpr = 0, k_scale=1.0, v_scale=1.0):
    # One query token per row (GQA decode), program (kv head, split, batch row). Before waiting on the
    # previous kernel it reads only what earlier kernels wrote (the position, the slot, cache rows < pos)
    # and starts loading its first K/V block; after the wait, q and this step's row pos (the QKV kernel's
    # writes). Row pos joins the softmax after the loop (one online update), so the loop reads only
    # earlier rows. The last split of a (row, kv head) to finish merges the splits into out.
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    if BATCH:
        b = tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        k_ptr += slot * stride_ks
        v_ptr += slot * stride_vs
        q_ptr += b * stride_qb
        out_ptr += b * stride_ob
        pos_ptr += b
        part_o_ptr += b * (NUM_Q_HEADS * NUM_SPLITS * D)
        part_ml_ptr += b * (NUM_Q_HEADS * NUM_SPLITS * 2)
        count_ptr += b * NUM_KV_HEADS
    pos = tl.load(pos_ptr)
    chunk = tl.cdiv(tl.cdiv(pos + 1, NUM_SPLITS), BLOCK_S) * BLOCK_S
    start = split * chunk
    end = tl.minimum(start + chunk, pos + 1)
    holds_pos = (start <= pos) & (pos < end)
    end_c = tl.minimum(end, pos)  # rows cached by earlier steps
    dm = tl.arange(0, D)
    offs = start + tl.arange(0, BLOCK_S)
    smask = offs < end_c
    k = tl.load(k_ptr + offs[:, None].to(tl.int64) * stride_kt + kvh * D + dm[None, :], mask=smask[:, None],
                other=0)
    v = tl.load(v_ptr + offs[:, None].to(tl.int64) * stride_vt + kvh * D + dm[None, :], mask=smask[:, None],
                other=0)
    if PDL:  # q and K/V row pos come from the previous kernel
        gdc_wait()
    r = tl.arange(0, ROWS)
    head = kvh * GROUP + r
    rvalid = r < GROUP
    q_row = q_ptr + head * stride_qh
    q = tl.load(q_row[:, None] + dm[None, :], mask=rvalid[:, None], other=0.0)
    k_row = k_ptr + pos.to(tl.int64) * stride_kt + kvh * D
    if QK_NORM:  # Qwen3: q rows and K row pos arrive as projected; normalised + rotated here
        HALF: tl.constexpr = D // 2
        swapped = ((dm + HALF) % D)[None, :]
        qp = tl.load(q_row[:, None] + swapped, mask=rvalid[:, None], other=0.0)
        k_raw = tl.load(k_row + dm[None, :])  # [1, D]
        k_sw = tl.load(k_row + swapped)
        q = norm_rope_rows(q, qp, qn_ptr, cos_ptr, sin_ptr, pos, qk_eps, D).to(q.dtype)
        k_new = norm_rope_rows(k_raw, k_sw, kn_ptr, cos_ptr, sin_ptr, pos, qk_eps, D).to(k_raw.dtype)
        if holds_pos:  # stored for later steps
            tl.store(k_row + dm[None, :], k_new)
    else:
        k_new = fp8_kv_load(tl.load(k_row + dm[None, :]), KV_FMT)
    qk_scale = sm_scale * 1.4426950408889634
    if KV_FMT:  # FP8 K/V (no qk norm): fp8 values times the layer's scales, folded in here and at the end
        qk_scale = qk_scale * k_scale
    q_op, q_back = qk_operand(q, KV_FMT)
    dot_scale = qk_scale * q_back
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for s in range(start, end_c, BLOCK_S):
        if s > start:  # the first block was loaded before the wait
            offs = s + tl.arange(0, BLOCK_S)
            smask = offs < end_c
            k = tl.load(k_ptr + offs[:, None].to(tl.int64) * stride_kt + kvh * D + dm[None, :],
                        mask=smask[:, None], other=0)
            v = tl.load(v_ptr + offs[:, None].to(tl.int64) * stride_vt + kvh * D + dm[None, :],
                        mask=smask[:, None], other=0)
        k_op = fp8_kv_read(k, KV_FMT, DOT_F32)  # names of their own: k / v stay the loop's uint8 (FP8) tiles
        v_op = fp8_kv_read(v, KV_FMT, DOT_F32)
        m, l, acc = _online_block(q_op, q_op, k_op, k_op, v_op, offs, smask, smask, m, l, acc, dot_scale, 0, KV_FMT,
                                  DOT_F32, CAUSAL=False)  # one query token: every row before pos is visible
    if holds_pos:  # the key at pos, one online-softmax update
        s_pos = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
        m_new = tl.maximum(m, s_pos)
        alpha = tl.exp2(m - m_new)
        p_pos = tl.exp2(s_pos - m_new)
        v_pos = fp8_kv_load(tl.load(v_ptr + pos.to(tl.int64) * stride_vt + kvh * D + dm), KV_FMT).to(tl.float32)
        if KV_FMT:  # acc holds p times P_SCALE_FP8 (pv_dot's callers above)
            acc = acc * alpha[:, None] + (p_pos * P_SCALE_FP8)[:, None] * v_pos[None, :]
        else:
            acc = acc * alpha[:, None] + p_pos[:, None] * v_pos[None, :]
        l = l * alpha + p_pos
        m = m_new
    if KV_FMT:
        acc = acc * (v_scale / P_SCALE_FP8)
    if PDL:
        gdc_launch_dependents()
    prow = head * NUM_SPLITS + split  # partials [Hq, NUM_SPLITS, D] and [Hq, NUM_SPLITS, 2]
    tl.store(part_o_ptr + prow[:, None] * D + dm[None, :], acc, mask=rvalid[:, None])
    tl.store(part_ml_ptr + prow * 2, m, mask=rvalid)
    tl.store(part_ml_ptr + prow * 2 + 1, l, mask=rvalid)
    # the last split of this kv head merges: every program's partials are written before its count
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + kvh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.store(count_ptr + kvh, 0)  # reset for the next call (the next layer's kernel runs after ours)
        sp = tl.arange(0, NUM_SPLITS)
        for g in tl.static_range(GROUP):  # unrolled: every head's loads in flight at once (as _attn_combine_kernel)
            hrow = (kvh * GROUP + g) * NUM_SPLITS + sp
            ms = tl.load(part_ml_ptr + hrow * 2, cache_modifier=".cg")
            ls = tl.load(part_ml_ptr + hrow * 2 + 1, cache_modifier=".cg")
            os_ = tl.load(part_o_ptr + hrow[:, None] * D + dm[None, :], cache_modifier=".cg")
            m_max = tl.max(ms, axis=0)
            w = tl.where(ms == float("-inf"), 0.0, tl.exp2(ms - m_max))
            o = tl.sum(os_ * w[:, None], axis=0) / tl.sum(w * ls, axis=0)
            tl.store(out_ptr + (kvh * GROUP + g) * D + dm, o.to(out_ptr.dtype.element_ty))


# A program's query tile is at most this many elements (rows x (d_main + d_rope)): DeepSeek-V2-Lite's
# 4-token verify (64 rows of 576) compiles on an H100/H200; DeepSeek-V3's 128 heads in one program
# (128 rows of 576, one token) ask for 282 KB of shared memory against 227 KB
MAX_ROW_ELEMS = 64 * 576


def head_blocks(group: int, num_tokens: int, d_qk: int, max_row_elems: int = MAX_ROW_ELEMS) -> int:
    """Programs per (kv head, split) sharing the group's query heads: the fewest (a power of two that
    divides the group) whose tile of rows (heads x tokens, at least 16) times ``d_qk`` fits
    ``max_row_elems``; each reads the split's keys once (from L2 after the first). A tile is never
    below 16 rows (the tensor-core dot's least), so heads are not spread further than that."""
    hb = 1
    while (triton.next_power_of_2(group // hb * num_tokens) * d_qk > max_row_elems
           and group // hb * num_tokens > 16 and group % (2 * hb) == 0):
        hb *= 2
    return hb


class DecodeAttention:
    """Preallocated split-K decode attention for one shape; ``__call__`` launches two kernels."""

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, d_main: int, d_v: int, d_rope: int = 0,
                 num_tokens: int = 1, num_splits: int = 32, block_s: int = 32, sm_scale: float | None = None,
                 num_warps: int = 4, v_is_k: bool = False, v_chunks: int = 1, pdl: bool = False,
                 device: torch.device | str = "cpu", max_batch: int = 1, one_launch: bool = True,
                 max_row_elems: int = MAX_ROW_ELEMS, pos_row_prologue: bool = False,
                 combine_warps: int = 4, min_chunk: int = 0, pos_last: bool = False):
        self.hq, self.hkv, self.num_tokens = num_q_heads, num_kv_heads, num_tokens
        self.d_main, self.d_v, self.d_rope = d_main, d_v, d_rope
        self.group = num_q_heads // num_kv_heads
        self.head_blocks = head_blocks(self.group, num_tokens, d_main + d_rope, max_row_elems)
        self.rows = max(16, triton.next_power_of_2(self.group // self.head_blocks * num_tokens))
        self.num_splits, self.block_s, self.num_warps, self.v_is_k = num_splits, block_s, num_warps, v_is_k
        if min_chunk % block_s:
            raise ValueError(f"min_chunk {min_chunk} is not a multiple of block_s {block_s}")
        self.min_chunk = min_chunk  # two-launch form: the fewest keys a split takes (later splits stay empty)
        # two-launch form, one query token over a dense model-dtype cache: the row at pos after the splits' loops
        # (_attn_split_kernel's POS_LAST)
        self.pos_last = pos_last and num_tokens == 1
        if v_is_k and (d_v != d_main or v_chunks != 1):
            raise ValueError("v_is_k needs d_v == d_main and one value chunk (MLA: values are the latent)")
        if d_v % v_chunks:
            raise ValueError(f"d_v {d_v} is not a multiple of v_chunks {v_chunks}")
        self.v_chunks = v_chunks  # programs per split, each accumulating d_v / v_chunks value columns
        self.pdl = pdl
        # qk_norm, two launches: V row pos loaded in the split kernel's prologue, K row pos stored after its loop
        self.pos_row_prologue = pos_row_prologue
        self.combine_warps = combine_warps
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d_main + d_rope)
        self.max_batch = max_batch  # rows of a batched call (each its own slot's cache and position)
        rows = max_batch * num_tokens * num_q_heads * num_splits
        self.part_o = torch.empty(rows * d_v, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(rows * 2, dtype=torch.float32, device=device)
        # GQA decode (one token, separate values, no rope part): one launch, the splits merged by the last
        # of them to finish (count: finished splits per batch row and kv head, back to 0 after each call)
        self.one_launch = (one_launch and num_tokens == 1 and not d_rope and not v_is_k and v_chunks == 1
                           and d_main == d_v and self.head_blocks == 1)
        self.count = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                 *, stride_kt: int, stride_vt: int, rope_offset: int = 0, q_pe: torch.Tensor | None = None,
                 stride_qt: int | None = None, stride_qh: int | None = None,
                 qk_norm: tuple | None = None, slot_ids: torch.Tensor | None = None, stride_ks: int = 0,
                 stride_vs: int = 0, kv_fmt: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                 sparse: tuple[torch.Tensor, torch.Tensor] | None = None, combine: bool = True,
                 quant: tuple[torch.Tensor, torch.Tensor] | None = None,
                 amax: torch.Tensor | None = None) -> torch.Tensor | None:
        """q: main part, row (t, head) at t*stride_qt + head*stride_qh (default [T, Hq, D_MAIN] contiguous);
        q_pe [T, Hq, D_ROPE] (MLA); k/v cache storage (token strides in elements); out [T, Hq, D_V].
        ``qk_norm=(q_norm [D], k_norm [D], eps, cos, sin)``: q and K row pos as projected (Qwen3, T == 1).
        ``slot_ids`` (int32 [B]): a batch of B rows, row b's query at q[b] (MLA: its rope part at q_pe[b]), its
        position pos[b], its keys and values in slot slot_ids[b] of k / v (slot strides stride_ks / stride_vs
        elements), out [B, T, Hq, D_V].
        ``kv_fmt`` (kvfp8.kv_fmt) > 0: k and v hold FP8 bytes, read as their values times ``k_scale`` /
        ``v_scale`` (without qk_norm; MLA: the rope part of the key rows too).
        ``sparse=(idx int32 [>= n], n int32 [1])``: one query token attends to the n cache rows listed in
        idx (sparse attention's top-k, any order; rows past pos are masked), not to rows 0..pos.
        ``combine=False`` (two-launch form): the split kernel only; its partials stay in ``part_o``
        [B, T, Hq, NUM_SPLITS, D_V] and ``part_ml`` [..., 2] (max in log2 units, sum) for a kernel of the
        caller's that merges them (returns None).
        ``quant=(q, xs)`` (two-launch form): out also rounded to FP8 a row of D_V values at a time (a block-scaled
        GEMV's activation groups of D_V), its FP8 values into q and a scale a row into xs.
        ``amax`` (two-launch form; float32 [B * T * Hq]): each output row's largest |value|, the parts of a per-token
        FP8 GEMV's activation scale (fp8.gemv_fp8's ``amax``)."""
        sqh = stride_qh if stride_qh is not None else self.d_main
        sqt = stride_qt if stride_qt is not None else self.hq * self.d_main
        if qk_norm is not None and (self.num_tokens != 1 or self.d_rope or self.v_is_k or self.v_chunks != 1
                                    or self.head_blocks != 1):
            raise ValueError("qk_norm runs with one query token, no rope part, separate values, one value chunk "
                             "and one head block")
        if kv_fmt and (qk_norm is not None or self.v_is_k):
            raise ValueError("FP8 K/V are read without qk_norm (its K row arrives normalised) and as separate values")
        qn, kn, qk_eps, cos, sin = qk_norm if qk_norm is not None else (q, q, 0.0, q, q)
        batch = 1 if slot_ids is None else slot_ids.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"a batch of {batch} rows: this attention holds partials for {self.max_batch}")
        if (not combine or quant is not None or amax is not None) and self.one_launch:
            raise ValueError("combine=False, quant and amax need the two-launch attention (one_launch merges in its "
                             "split kernel)")
        if sparse is not None and (self.num_tokens != 1 or qk_norm is not None or slot_ids is not None
                                   or self.one_launch):
            raise ValueError("sparse attention takes one query token of one slot, without qk_norm (MLA)")
        if self.one_launch:
            _gqa_split_kernel[(self.hkv, self.num_splits, batch)](
                q, k, v, pos, self.part_o, self.part_ml, self.count, out, self.sm_scale, sqh, stride_kt, stride_vt,
                qn, kn, cos, sin, qk_eps, slot_ids if slot_ids is not None else pos, stride_ks, stride_vs, sqt,
                self.hq * self.d_v, QK_NORM=qk_norm is not None, BATCH=slot_ids is not None, NUM_Q_HEADS=self.hq,
                NUM_KV_HEADS=self.hkv, GROUP=self.group, ROWS=self.rows, D=self.d_main, NUM_SPLITS=self.num_splits,
                BLOCK_S=self.block_s, DOT_F32=interpreting(), PDL=self.pdl, KV_FMT=kv_fmt, k_scale=k_scale,
                v_scale=v_scale, num_warps=self.num_warps, **launch_opts(self.pdl))
            return out
        pos_last = self.pos_last and sparse is None and not kv_fmt and qk_norm is None
        _attn_split_kernel[(self.hkv * self.head_blocks, self.num_splits, self.v_chunks * batch)](
            q, q_pe if q_pe is not None else q, k, v, pos, self.part_o, self.part_ml, self.sm_scale, sqt, sqh,
            stride_kt, stride_vt, rope_offset, qn, kn, cos, sin, qk_eps, slot_ids if slot_ids is not None else pos,
            stride_ks, stride_vs, self.num_tokens * sqt, QK_NORM=qk_norm is not None, BATCH=slot_ids is not None,
            T=self.num_tokens, NUM_Q_HEADS=self.hq, NUM_KV_HEADS=self.hkv, GROUP=self.group, ROWS=self.rows,
            D_MAIN=self.d_main, D_ROPE=self.d_rope, D_V=self.d_v // self.v_chunks, NUM_SPLITS=self.num_splits,
            BLOCK_S=self.block_s, DOT_F32=interpreting(), V_IS_K=self.v_is_k, V_CHUNKS=self.v_chunks, PDL=self.pdl,
            HEAD_BLOCKS=self.head_blocks, POS_ROW_PROLOGUE=self.pos_row_prologue and qk_norm is not None,
            KV_FMT=kv_fmt, k_scale=k_scale, v_scale=v_scale,
            idx_ptr=sparse[0] if sparse is not None else pos, nidx_ptr=sparse[1] if sparse is not None else pos,
            SPARSE=sparse is not None, MIN_CHUNK=self.min_chunk,
            POS_LAST=pos_last, num_warps=self.num_warps, **launch_opts(self.pdl))
        if not combine:
            return None
        _attn_combine_kernel[(batch * self.num_tokens * self.hq,)](
            self.part_o, self.part_ml, out, NUM_SPLITS=self.num_splits,
            D_V=self.d_v, PDL=self.pdl, QUANT=quant is not None, q_ptr=quant[0] if quant is not None else None,
            xs_ptr=quant[1] if quant is not None else None, amax_ptr=amax, AMAX=amax is not None,
            num_warps=self.combine_warps, **launch_opts(self.pdl))
        return out
