"""DeepSeek-V3-family decode on the fast path: absorbed MLA, grouped-expert MoE, MTP draft + verify.

Weights are the engine's (deepseek.py names): per layer attn_norm, wq (or, with q LoRA, wq_a, q_a_norm,
wq_b), wkv_a, kv_a_norm, w_uk [Hq, nope, r], w_uv [Hq, v, r], wo, mlp_norm, and router/router_bias/
experts_gate_up/experts_down/shared_gate_up/shared_down (MoE) or w_gate_up/w_down (dense).
``prepare_layer`` pre-lays them out once: wq and wkv_a fused into one projection (q LoRA: wkv_a and wq_a,
then q_b over RMSNorm(q_a) as a second GEMV), shared experts split into routed-size experts. Routing is
noaux_tc, group-limited where the model has several groups (``MlaDims.n_group`` / ``topk_group``).
Cache per layer: ``[max_tokens, r + rope]`` (shared.kvlayout MLA), MTP layers after the main ones.

``MlaDecoder.forward(T)`` runs the main model over ``tokens[:T]`` at positions ``pos .. pos+T-1``
(T = 1: a plain step; T = k+1: the verify of k drafts): logits [T, V] fp32 and final-normed hidden
[T, H]. ``mtp_draft(j)`` runs the MTP layer for draft j. ``plain_step`` / ``spec_step(k)`` chain them
with greedy acceptance on device, so each is one CUDA graph with no host sync.

The one-token block (``MlaStack`` with T = 1; per MoE layer: QKV GEMV + norm, latent prep, q_nope . w_uk,
attention, merge + w_uv, o GEMV + residual, norm + router + top-k, experts gate/up, down, reduce) is a
chain of Triton kernels on programmatic dependent launch on sm_90 (``MlaStack.PDL``): each launches while
the one before finishes, loads what no kernel writes (its first weight tile: ``PDL_EARLY``) and waits
before its first read of an earlier kernel's output (run P3 in bench/NOTES-gpu.md: -5% a V2-Lite step).
A batch stack (several slots' tokens, ``MlaBatchDecoder``) is the same kind of chain (``BATCH_CHAIN``): the
norms are launches of their own, the projections tensor-core dots, q_nope . w_uk and merge + w_uv take every
row, and only the router's top-k is a plain launch; so is a verify's T-row block (``VERIFY_CHAIN``). Run MB4:
4 slots -2.6% a step, a k = 3 verify step -2.3% against their cuBLAS-bmm forms without PDL (still there: both
flags False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import fp8block, smallops
from .attention import DecodeAttention, split_weights
from .fp8block import BlockFp8
from .gemv import gdc_launch_dependents, gdc_wait, launch_opts
from .kernel_helpers import rms_scaled, rnd_bf16, rope_pair, round_to_dtype
from .kvfp8 import fp8_kv_bits, kv_fmt
from .moe import GroupedMoe, gemv_rows, router


# the fewest latent rows an attention split takes: a short context in a long slot keeps the 1K-tuned ~16 splits
# of 64 rows (its later splits stay empty) while a long one spreads over all of them (adapter.attention_splits)
SPLIT_MIN_ROWS = 64


@dataclass
class MlaDims:
    hidden: int
    num_heads: int
    kv_lora_rank: int
    nope: int
    rope: int
    v_dim: int
    num_experts: int
    top_k: int
    moe_inter: int
    num_shared: int
    routed_scale: float
    eps: float
    sm_scale: float
    q_lora_rank: int = 0  # 0: q is one projection of the normed hidden (no q LoRA)
    n_group: int = 1  # routing groups; experts are picked in the topk_group best (group-limited routing)
    topk_group: int = 1
    # sparse attention (DSA, one token a step): each query attends to the index_topk cache rows its
    # lightning indexer (index_heads heads of index_dim, the first ``rope`` dims roped, interleaved for GLM)
    # scores highest; 0: dense
    index_topk: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_rope_interleave: bool = False


@dataclass
class MlaLayer:
    attn_norm: torch.Tensor
    wqkv_a: torch.Tensor  # [Hq (nope + rope) + r + rope, H]: wq then wkv_a (q LoRA: [r + rope + q_lora, H], wkv_a, wq_a)
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [Hq, nope, r]
    w_uv_t: torch.Tensor  # [Hq, r, v] (w_uv transposed once)
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # routed [E, 2I, H], or [1, 2I, H] for a dense layer
    down: torch.Tensor  # routed [E, H, I], or [1, H, I]
    shared_gate_up: torch.Tensor | None  # [S, 2I, H]
    shared_down: torch.Tensor | None  # [S, H, I]
    router: torch.Tensor | None
    router_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None = None  # q LoRA: RMSNorm weight of q_a [q_lora]
    wq_b: torch.Tensor | None = None  # q LoRA: [Hq (nope + rope), q_lora]
    # sparse attention: this layer's indexer (its key and head-weight projections are the last rows of
    # wqkv_a: [... | k_idx (index_dim) | head weights (index_heads)]); None: dense, or (``sparse``) the
    # choice of the last layer before it with an indexer (GLM's shared layers)
    index: "MlaIndexer | None" = None
    sparse: bool = False
    # sparse attention over a block-scaled FP8 stack: the indexer's key and head-weight rows (bf16, as the engine
    # keeps them) in a GEMV of their own, into the columns after wqkv_a's
    w_idx_rows: torch.Tensor | None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None


@dataclass
class MlaIndexer:
    wq_b: torch.Tensor  # [index_heads * index_dim, q_lora]: the indexer's queries from RMSNorm(q_a)
    k_norm: torch.Tensor  # LayerNorm of the indexer key [index_dim], and its bias
    k_norm_bias: torch.Tensor


@dataclass
class MtpWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [H, 2H]
    head_norm: torch.Tensor
    head: torch.Tensor  # [V, H]
    embed: torch.Tensor  # [V, H]
    layer: MlaLayer


def split_shared(gate_up: torch.Tensor, down: torch.Tensor, inter: int):
    """A shared MLP [2 S I, H] / [H, S I] as S routed-size experts [S, 2I, H] / [S, H, I] (block-scaled FP8 with its
    scales where the blocks split with it, else dequantized to bf16)."""
    if isinstance(gate_up, BlockFp8) or isinstance(down, BlockFp8):
        split = fp8block.split_experts(gate_up, down, inter)
        if split is not None:
            return split
        gate_up, down = fp8block.plain(gate_up), fp8block.plain(down)
    s = gate_up.shape[0] // (2 * inter)
    gate, up = gate_up.view(2, s, inter, -1).unbind(0)
    return torch.cat([gate, up], dim=1).contiguous(), down.view(down.shape[0], s, inter).permute(1, 0, 2).contiguous()


def prepare_layer(p: dict[str, torch.Tensor], moe_inter: int, sparse: bool = False) -> MlaLayer:
    """Engine per-layer tensors (deepseek.py names) -> the fast path's pre-laid-out MlaLayer; ``sparse``:
    the model attends sparsely (its indexer's key and head-weight rows join the input projection)."""
    moe = "router" in p
    if moe:
        sg, sd = split_shared(p["shared_gate_up"], p["shared_down"], moe_inter) if "shared_gate_up" in p else (None, None)
        gate_up, down = p["experts_gate_up"], p["experts_down"]
        gate_up, down, sg, sd = _same_experts(gate_up, down, sg, sd)
    else:
        sg, sd = p["w_gate_up"][None], p["w_down"][None]  # the dense MLP is the one "shared expert"
        gate_up, down = sg, sd
    lora = "wq_a" in p  # q LoRA: the latent's and q_a's projections fused, q_b a second GEMV
    rows = [p["wkv_a"], p["wq_a"]] if lora else [p["wq"], p["wkv_a"]]
    index = idx_rows = None
    if sparse and "idx_wq_b" in p:  # the indexer's key and head weights read the same normed input
        extra = [p["idx_wk"], p["idx_weights"]]
        if any(isinstance(w, BlockFp8) for w in rows):  # bf16 rows beside FP8 ones: a GEMV of their own
            idx_rows = torch.cat(extra).contiguous()
        else:
            rows += extra
        index = MlaIndexer(p["idx_wq_b"], p["idx_k_norm"], p["idx_k_norm_bias"])
    return MlaLayer(p["attn_norm"], fp8block.cat_rows(rows), p["kv_a_norm"], p["w_uk"],
                    p["w_uv"].transpose(1, 2).contiguous(), p["wo"], p["mlp_norm"], gate_up, down, sg, sd,
                    p.get("router"), p.get("router_bias"), p.get("q_a_norm"), p.get("wq_b"), index, sparse, idx_rows)


def _same_experts(gate_up, down, sg, sd):
    """Routed and shared experts in one form for the grouped kernels: all four block-scaled FP8 in the same blocks,
    or all four bf16 where a checkpoint mixes them (weight-only FP8 dequantized; with FP8 activations, ValueError:
    fp8block.plain)."""
    parts = [x for x in (gate_up, down, sg, sd) if x is not None]
    fp8 = [x for x in parts if isinstance(x, BlockFp8)]
    if not fp8 or (len(fp8) == len(parts) and len({(x.rows, x.cols, x.act) for x in fp8}) == 1
                   and (sg is None or sg.scale.shape[1:] == gate_up.scale.shape[1:]
                        and sd.scale.shape[1:] == down.scale.shape[1:])):
        return gate_up, down, sg, sd
    return tuple(None if x is None else fp8block.plain(x) for x in (gate_up, down, sg, sd))


@triton.jit
def _mla_prep_kernel(qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qkv, eps,
                     NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                     PDL: tl.constexpr = False, slot_ptr=None, stride_cs=0, BATCH: tl.constexpr = False,
                     KV_FMT: tl.constexpr = 0, inv_scale=1.0):
    # per token t: rope (interleaved pairs) of each head's q_pe -> q_pe[t]; the latent: RMSNorm(c) and
    # rope(k_pe) -> cache[pos + t]. BATCH: row t is its own slot's token, at pos[t] in slot slot_ptr[t]
    # (the cache: every slot's, slot stride stride_cs elements). KV_FMT 3: the cache holds E4M3 bytes, the row's
    # model-dtype values times inv_scale (1 / k_scale) rounded to nearest (kvfp8.fp8_kv_bits)
    _mla_prep_program(tl.program_id(0), tl.program_id(1), qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr,
                      sin_ptr, stride_qkv, eps, NUM_HEADS, NOPE, ROPE, R, PDL, slot_ptr, stride_cs, BATCH, KV_FMT,
                      inv_scale)


@triton.jit
def _mla_prep_program(t, head, qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qkv, eps,
                      NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                      PDL: tl.constexpr, slot_ptr, stride_cs, BATCH: tl.constexpr, KV_FMT: tl.constexpr, inv_scale):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    HALF: tl.constexpr = ROPE // 2
    QK: tl.constexpr = NOPE + ROPE
    if BATCH:
        p = tl.load(pos_ptr + t)
        cache_ptr += tl.load(slot_ptr + t).to(tl.int64) * stride_cs
    else:
        p = tl.load(pos_ptr) + t
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + p * HALF + j).to(tl.float32)
    sin = tl.load(sin_ptr + p * HALF + j).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    if head < NUM_HEADS:
        src = row + head * QK + NOPE
    else:
        src = row + NUM_HEADS * QK + R
    a = tl.load(src + 2 * j).to(tl.float32)
    b = tl.load(src + 2 * j + 1).to(tl.float32)
    dt = q_pe_ptr.dtype.element_ty
    a, b = rope_pair(a, b, cos, sin)
    if head < NUM_HEADS:
        dst = q_pe_ptr + (t * NUM_HEADS + head) * ROPE
        tl.store(dst + j, a.to(dt))
        tl.store(dst + HALF + j, b.to(dt))
    else:
        crow = cache_ptr + p.to(tl.int64) * (R + ROPE)
        r = tl.arange(0, R)
        c = tl.load(row + NUM_HEADS * QK + r).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / R + eps)
        nw = tl.load(kv_norm_ptr + r)
        cn = rms_scaled(c, inv, nw)
        if KV_FMT:  # the model-dtype row (the reference step's), then its bytes
            tl.store(crow + r, fp8_kv_bits(cn, inv_scale, KV_FMT))
            tl.store(crow + R + j, fp8_kv_bits(round_to_dtype(a, dt), inv_scale, KV_FMT))
            tl.store(crow + R + HALF + j, fp8_kv_bits(round_to_dtype(b, dt), inv_scale, KV_FMT))
        else:
            tl.store(crow + r, cn.to(nw.dtype))
            tl.store(crow + R + j, a.to(dt))
            tl.store(crow + R + HALF + j, b.to(dt))


@triton.jit
def _mla_latent_kernel(qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qkv, eps,
                       NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                       PDL: tl.constexpr, KV_FMT: tl.constexpr, inv_scale, slot_ptr=None, stride_cs=0,
                       BATCH: tl.constexpr = False):
    # a token's latent alone (_mla_prep_program's last program): RMSNorm(c) and rope(k_pe) -> cache[pos]; BATCH:
    # program t's row t of a batch, at pos[t] of slot slot_ptr[t]
    _mla_prep_program(tl.program_id(0), NUM_HEADS, qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr,
                      sin_ptr, stride_qkv, eps, NUM_HEADS, NOPE, ROPE, R, PDL, slot_ptr if BATCH else pos_ptr,
                      stride_cs, BATCH, KV_FMT, inv_scale)


@triton.jit
def _absorb_kernel(qkv_ptr, w_ptr, out_ptr, stride_wh, stride_wn, NOPE: tl.constexpr, QK: tl.constexpr,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                   T: tl.constexpr = 1, stride_qkv=0):
    # the absorbed query q_c[h, t] = q_nope[t, h] @ w_uk[h] (fp32 sums, one rounding, as the bf16 bmm) of T
    # rows (one token, or a batch's slots: rows stride_qkv apart), BLOCK_R latent columns a program, the w_uk
    # tile read once for every row. EARLY (with PDL): the w_uk tile loaded before the wait, while the previous
    # kernel finishes; q_nope (the QKV GEMV's output, two kernels back) after it
    _absorb_program(tl.program_id(0), tl.program_id(1), qkv_ptr, w_ptr, out_ptr, stride_wh, stride_wn, NOPE, QK, R,
                    BLOCK_R, PDL, EARLY, T, stride_qkv)


@triton.jit
def _absorb_program(head, cb, qkv_ptr, w_ptr, out_ptr, stride_wh, stride_wn, NOPE: tl.constexpr, QK: tl.constexpr,
                    R: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, T: tl.constexpr,
                    stride_qkv):
    cols = cb * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.arange(0, NOPE)
    wp = w_ptr + head.to(tl.int64) * stride_wh + n[:, None] * stride_wn + cols[None, :]
    if EARLY:
        w = tl.load(wp)
    if PDL:
        gdc_wait()
    if not EARLY:
        w = tl.load(wp)
    if PDL:
        gdc_launch_dependents()
    for t in tl.static_range(T):
        q = tl.load(qkv_ptr + t * stride_qkv + head * QK + n).to(tl.float32)
        acc = tl.sum(q[:, None] * w.to(tl.float32), axis=0)
        tl.store(out_ptr + (head * T + t) * R + cols, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _prep_absorb_kernel(qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qkv, eps,
                        w_ptr, out_ptr, stride_wh, stride_wn, NUM_HEADS: tl.constexpr, NOPE: tl.constexpr,
                        ROPE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
                        EARLY: tl.constexpr, KV_FMT: tl.constexpr = 0, inv_scale=1.0, T: tl.constexpr = 1,
                        BATCH: tl.constexpr = False, slot_ptr=None, stride_cs=0):
    # _mla_prep_kernel's programs (each row's heads' q_pe rope, its latent's norm + k_pe rope into the cache: T x
    # (NUM_HEADS + 1) programs, BATCH as there) and _absorb_kernel's (q_nope . w_uk of the T rows) in one launch:
    # both read only the QKV GEMV's output, so neither waits on the other, and the attention waits on one launch
    # instead of two in a row
    pid = tl.program_id(0)
    if pid < T * (NUM_HEADS + 1):
        _mla_prep_program(pid // (NUM_HEADS + 1), pid % (NUM_HEADS + 1), qkv_ptr, q_pe_ptr, cache_ptr, kv_norm_ptr,
                          pos_ptr, cos_ptr, sin_ptr, stride_qkv, eps, NUM_HEADS, NOPE, ROPE, R, PDL,
                          slot_ptr if BATCH else pos_ptr, stride_cs, BATCH, KV_FMT, inv_scale)
    else:
        NB: tl.constexpr = R // BLOCK_R
        a = pid - T * (NUM_HEADS + 1)
        _absorb_program(a // NB, a % NB, qkv_ptr, w_ptr, out_ptr, stride_wh, stride_wn, NOPE, NOPE + ROPE, R, BLOCK_R,
                        PDL, EARLY, T, stride_qkv)


@triton.jit
def _combine_uv_kernel(part_o_ptr, part_ml_ptr, w_uv_ptr, out_ptr, NUM_SPLITS: tl.constexpr, R: tl.constexpr,
                       V: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_R: tl.constexpr, PDL: tl.constexpr = False,
                       EARLY: tl.constexpr = False, T: tl.constexpr = 1, NUM_HEADS: tl.constexpr = 1):
    # one token, or a batch of T slots' tokens: the attention's merge of its splits (log-sum-exp, as
    # _attn_combine_kernel: the latent output rounded to bf16) and the value up-projection in one launch.
    # Program (h, vb, t): out[h, t, vb-th BLOCK_V columns] = o_lat[t, h] @ w_uv_t[h][:, those columns] (fp32
    # sum, one rounding); row t's partials are the attention's rows t * NUM_HEADS + h
    head = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    t = tl.program_id(2)
    prow = t * NUM_HEADS + head
    out_ptr += (head * T + t) * V
    sp = tl.arange(0, NUM_SPLITS)
    cmask = cols < V
    FIRST: tl.constexpr = CHUNK_R if EARLY else 0  # EARLY (with PDL): chunk 0 of w_uv loaded before the wait
    if EARLY:  # w_uv is never written: its first chunk streams while the attention finishes
        r0_ = tl.arange(0, CHUNK_R)
        w0 = tl.load(w_uv_ptr + (head * R + r0_)[:, None].to(tl.int64) * V + cols[None, :], mask=cmask[None, :],
                     other=0.0)
    if PDL:  # the partials come from the attention
        gdc_wait()
    wgt, denom = split_weights(part_ml_ptr, prow, NUM_SPLITS)
    seen = wgt > 0  # splits that saw a key: only their partials are read (most are empty for a short context)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    if EARLY:
        o = tl.load(part_o_ptr + (prow * NUM_SPLITS + sp)[:, None] * R + r0_[None, :], mask=seen[:, None], other=0.0)
        o_lat = rnd_bf16(tl.sum(o * wgt[:, None], axis=0) / denom)
        acc += tl.sum(o_lat[:, None] * w0.to(tl.float32), axis=0)
    for r0 in range(FIRST, R, CHUNK_R):
        rr = r0 + tl.arange(0, CHUNK_R)
        o = tl.load(part_o_ptr + (prow * NUM_SPLITS + sp)[:, None] * R + rr[None, :], mask=seen[:, None], other=0.0)
        o_lat = rnd_bf16(tl.sum(o * wgt[:, None], axis=0) / denom)
        w = tl.load(w_uv_ptr + (head * R + rr)[:, None].to(tl.int64) * V + cols[None, :], mask=cmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(o_lat[:, None] * w, axis=0)
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _index_prep_kernel(q_ptr, qo_ptr, row_ptr, wo_ptr, cache_ptr, kn_ptr, kb_ptr, pos_ptr, cos_ptr, sin_ptr,
                       w_scale, stride_row, IH: tl.constexpr, IH_POW2: tl.constexpr, D: tl.constexpr,
                       ROPE: tl.constexpr, INTER: tl.constexpr):
    # the sparse-attention indexer's inputs of token t = program_id(1) at pos + t (engine/deepseek.py
    # ``_selected``, the same rounding points): program h < IH: query head h roped (its first ROPE dims) ->
    # qo[t, h]; program IH: the key LayerNorm'd (weight, bias, eps 1e-6; fp32 statistics, one rounding) and
    # roped -> cache[pos + t], and the head weights (the projection's bf16 values) * w_scale in fp32 ->
    # wo[t]. ``row_ptr``: token 0's [k (D) | head weights (IH)] columns of the input projection (rows
    # ``stride_row`` apart). Rope: x1 * cos - x2 * sin | x2 * cos + x1 * sin, each op rounded, with (x1, x2)
    # the interleaved (INTER) or split halves of the first ROPE dims.
    head = tl.program_id(0)
    t = tl.program_id(1)
    q_ptr += t * IH * D
    qo_ptr += t * IH * D
    row_ptr += t * stride_row
    wo_ptr += t * IH
    HALF: tl.constexpr = ROPE // 2
    p = tl.load(pos_ptr) + t
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + p * HALF + j).to(tl.float32)
    sin = tl.load(sin_ptr + p * HALF + j).to(tl.float32)
    if INTER:
        ia, ib = 2 * j, 2 * j + 1
    else:
        ia, ib = j, j + HALF
    rest = ROPE + tl.arange(0, D - ROPE)  # not roped
    dt = qo_ptr.dtype.element_ty
    if head < IH:
        src = q_ptr + head * D
        dst = qo_ptr + head * D
        a = tl.load(src + ia).to(tl.float32)
        b = tl.load(src + ib).to(tl.float32)
        tl.store(dst + rest, tl.load(src + rest))
    else:
        p64 = p.to(tl.int64)
        dst = cache_ptr + p64 * D
        x = tl.load(row_ptr + tl.arange(0, D)).to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        xc = x - mean
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + 1e-6)
        a = tl.load(row_ptr + ia).to(tl.float32)
        b = tl.load(row_ptr + ib).to(tl.float32)
        a = rnd_bf16((a - mean) * rstd * tl.load(kn_ptr + ia).to(tl.float32) + tl.load(kb_ptr + ia).to(tl.float32))
        b = rnd_bf16((b - mean) * rstd * tl.load(kn_ptr + ib).to(tl.float32) + tl.load(kb_ptr + ib).to(tl.float32))
        xr = tl.load(row_ptr + rest).to(tl.float32)
        xr = (xr - mean) * rstd * tl.load(kn_ptr + rest).to(tl.float32) + tl.load(kb_ptr + rest).to(tl.float32)
        tl.store(dst + rest, xr.to(dt))
        hh = tl.arange(0, IH_POW2)
        w = tl.load(row_ptr + D + hh, mask=hh < IH, other=0.0).to(tl.float32)
        tl.store(wo_ptr + hh, w * w_scale, mask=hh < IH)
    a, b = rope_pair(a, b, cos, sin)
    tl.store(dst + j, a.to(dt))
    tl.store(dst + HALF + j, b.to(dt))


class MlaStack:
    """Buffers and launch plan of one MLA+MoE block stack for T tokens (T fixed per instance)."""

    # (block_n, block_k, num_warps, stages) of the attention projections' tensor-core dots (T > 1)
    DOT_TILE: tuple[int, int, int, int] = (16, 256, 4, 4)  # best of bench/decode_gpu_mla.py's sweep (H200)
    # (block_n, block_k, num_warps, stages) of the one-token projections (fp32 FMAs; an instance's ``tiles``):
    # best of bench/decode_gpu_mla.py's plain_tile_sweep on the V2-Lite shape (H200, runs T1, T2 on PDL)
    PLAIN_TILES: dict[str, tuple[int, int, int, int]] = {"wqkv_a": (8, 512, 4, 3), "wq_b": (8, 256, 4, 4),
                                                         "wo": (4, 512, 4, 4)}
    # ... wo's where the hidden size is GroupedMoe.WIDE_HIDDEN or more (T1's tile: better on the V3 shape, run D1)
    WIDE_WO_TILE: tuple[int, int, int, int] = (8, 256, 4, 4)
    # one token over block-scaled FP8 with grouped activations: the fewest rows a program of these projections
    # (gemv_rows' fp8_rows, cut to the scale rows; absent: fp8block.FMA_ACT_BLOCK_N). On the DeepSeek-V3 shape (H200,
    # run G48) wo at 64 rows -25 us a step (its 224 programs of 32 rows took 1.7 waves), wq_b at 128 -25 us more; 16
    # rows were slower for all three projections, 64 for wqkv_a
    FP8_ROWS: dict[str, int] = {"wo": 64, "wq_b": 128}
    # one token: the attention splits' merge and o . w_uv in one kernel (_combine_uv_kernel) instead of the
    # merge kernel + a cuBLAS bmm (run F7 on the H200: -62 us a V2-Lite step); False: those two
    FUSED_UV: bool = True
    UV_TILE: tuple[int, int, int] = (32, 512, 4)  # _combine_uv_kernel's (value columns, latent chunk, warps)
    # a chain's rows (one token; a batch or a verify in the chain form): the MLP's RMSNorm, the router GEMV and
    # the top-k of every row in one launch (moe.router(norm_w=...))
    FUSED_ROUTER: bool = True
    # one token: the shared experts' gate/up + SiLU run in the fused router's launch (moe.SharedGateUp), their
    # weights streaming while the router's norm, GEMV and top-k (latency-bound, ~5-7 us a layer) run
    SHARED_IN_ROUTER: bool = True
    PROJ_DOT: bool = True  # False: the attention projections of T > 1 tokens on fp32 FMAs (bench comparison)
    # one token: the block's Triton kernels with programmatic dependent launch (each starts while the one before
    # finishes, gemv.py's GQA step does the same); None: on for sm_90+ CUDA devices, False: off
    PDL: bool | None = None
    # True: a batch stack (several slots' tokens) as well: PDL, the absorb kernel and the merge + w_uv kernel over
    # every row, so its block is one chain of Triton kernels too (but the router's top-k, a plain launch). Run
    # MB4 (bench/NOTES-gpu.md): 4 slots 4.177 -> 4.068 ms, 8 slots unchanged; False: norms + dots + cuBLAS bmms
    # without PDL (run MB3's form)
    BATCH_CHAIN: bool = True
    # True: a verify's T-row block (the target pass over MTP drafts, dense attention) the same chain (run MB4:
    # k = 1 / 2 / 3 steps 1.67 / 2.01 / 2.29x -> 1.57 / 1.91 / 2.21x a plain step)
    VERIFY_CHAIN: bool = True
    # with PDL: each GEMV's first weight tile (and merge + w_uv's first latent chunk) loaded before the wait
    PDL_EARLY: bool = True
    # one token: q_nope . w_uk by _absorb_kernel (64 latent columns a program; on PDL, w_uk's tile loaded before
    # the wait) instead of a cuBLAS bmm, which cannot join the PDL chain; False: the bmm
    ABSORB_KERNEL: bool = True
    ABSORB_BLOCK_R: int = 64
    # one token with the absorb kernel: the latent prep's programs and the absorb's in one launch (_prep_absorb_kernel)
    PREP_ABSORB_ONE_LAUNCH: bool = True
    # ... and so for several rows (a batch's slots, a verify's tokens); read when a stack is made
    PREP_ABSORB_ROWS: bool = True
    # several rows: the MLP's launch that sums into h (the MoE's reduce) also norms h for the next block's attention
    # (block's next_lw), which then skips its own norm launch; read when a stack is made. Off: run G54 (H100) had
    # the 4-slot V2-Lite step +28 us with it (its reduce's program a row does the work of two), 8 slots even
    NORM_IN_REDUCE: bool = False
    # the attention's programs a split: (value chunks, key rows a block, warps): each of a split's programs
    # accumulates kv_lora_rank / chunks value columns and reads its split's keys (the second and later from L2).
    # One program a split (the values taken from its key tiles) was slower at 16-64 splits (run G13)
    ATTN_FORM: tuple[int, int, int] = (4, 32, 4)
    # one token of a model with at most 16 heads (DeepSeek-V2-Lite; a program's 16 query rows): twice the slot's
    # splits (at most 64) of at least this many rows, in this form: (value chunks, key block, warps, fewest rows a
    # split). Runs G13-G14 on the H100: 32 splits of 32 rows in 2 chunks -30..-70 us a V2-Lite step against 16 of
    # 64 in 4; the V3 shape (128 heads, 64 rows a program) keeps ATTN_FORM (2 chunks do not fit its shared
    # memory, 32 splits were slower). None: ATTN_FORM and SPLIT_MIN_ROWS for every stack
    FEW_ROWS_ATTN: tuple[int, int, int, int] | None = (2, 32, 4, 32)
    # with FEW_ROWS_ATTN (one token, at most 16 heads) over a model-dtype latent: the splits share the rows of
    # earlier steps and this step's row joins the last one's softmax after its loop (attention.py's POS_LAST), so a
    # context of a multiple of the splits' rows does not cost every split one more key block (run G18: V2-Lite -36
    # us at 1K and at 1000; G19 neutral; the V3 cut's 64-row programs +8..+20 us: not there)
    POS_ROW_LAST: bool = True

    def __init__(self, dims: MlaDims, num_tokens: int, device, num_splits: int = 16,
                 dense_inter: int = 0, max_tokens: int = 0, batch: bool = False):
        """``batch``: the T rows are T slots' tokens (``block(..., slots=)``: each at its own position in its
        own slot of the whole cache), not T consecutive tokens of one slot."""
        d, t, dev, bf = dims, num_tokens, device, torch.bfloat16
        self.dims, self.num_tokens, self.batch = d, t, batch
        if batch and t < 2:
            raise ValueError("a batch stack has 2 or more rows")
        if batch and d.index_topk:
            raise ValueError("sparse attention decodes one slot per step (its indexer's lists are per slot)")
        dev_ = torch.device(dev)
        sm90 = dev_.type == "cuda" and torch.cuda.get_device_capability(dev_)[0] >= 9
        # one token, a batch or a verify: one chain of Triton kernels (a sparse verify attends token by token)
        chain = t == 1 or (self.BATCH_CHAIN if batch else self.VERIFY_CHAIN and not d.index_topk)
        self.pdl = chain and (sm90 if self.PDL is None else bool(self.PDL))
        self.early = self.pdl and self.PDL_EARLY
        self.absorb = self.ABSORB_KERNEL and chain
        self.prep_absorb = self.PREP_ABSORB_ONE_LAUNCH and (t == 1 or self.PREP_ABSORB_ROWS)
        self.norm_in_reduce = t > 1 and self.NORM_IN_REDUCE
        self._normed_for = None  # (the block, its h) whose attention input the last MLP launch normed into xn
        self.q_c1 = torch.zeros(d.num_heads, t, d.kv_lora_rank, dtype=bf, device=dev) if self.absorb else None
        self.tiles = dict(self.PLAIN_TILES)
        if d.hidden >= GroupedMoe.WIDE_HIDDEN:
            self.tiles["wo"] = self.WIDE_WO_TILE
        self.fused_uv = self.FUSED_UV and chain
        # a chain (one token, a batch or a verify in the chain form): the MLP's norm, router and top-k of every
        # row in one launch; the bmm forms keep the three (run MB3's form)
        self.fused_router = self.FUSED_ROUTER and chain
        self.router_count = torch.zeros(t, dtype=torch.int32, device=dev)
        self.uv_tile = self.UV_TILE
        self.o1 = torch.zeros(d.num_heads, t, d.v_dim, dtype=bf, device=dev) if self.fused_uv else None
        nq = d.num_heads * (d.nope + d.rope)
        # [q | c, k_pe | q_a | k_idx, head weights]: q LoRA's q_a (normed, then q_b into the q columns) after
        # the latent; sparse attention's indexer key and head weights last
        extra = d.index_dim + d.index_heads if d.index_topk else 0
        slot_splits = num_splits  # the slot's (adapter.attention_splits): the verify and batch stacks' count
        few_rows = t == 1 and not batch and d.num_heads <= 16 and self.FEW_ROWS_ATTN is not None
        if few_rows:
            v_chunks, block_s, attn_warps, min_rows = self.FEW_ROWS_ATTN
            num_splits = min(2 * num_splits, 64)
        else:
            (v_chunks, block_s, attn_warps), min_rows = self.ATTN_FORM, SPLIT_MIN_ROWS
        v_chunks = max(1, min(v_chunks, d.kv_lora_rank // 128))
        min_chunk = -(-min_rows // block_s) * block_s  # whole key blocks
        self.qkv = torch.zeros(t, nq + d.kv_lora_rank + d.rope + d.q_lora_rank + extra, dtype=bf, device=dev)
        self.selects: list = []
        if d.index_topk:  # the indexer's queries, head weights and a top-k list per token
            if not d.q_lora_rank:
                raise ValueError("sparse attention runs on the fast path with q LoRA (its indexer reads q_a)")
            from .dsa import SparseSelect

            self.q_idx = torch.zeros(t, d.index_heads * d.index_dim, dtype=bf, device=dev)
            self.q_idx_roped = torch.zeros(t, d.index_heads, d.index_dim, dtype=bf, device=dev)
            self.w_idx = torch.zeros(t, d.index_heads, dtype=torch.float32, device=dev)
            self.selects = [SparseSelect(max_tokens=max_tokens, top_k=min(d.index_topk, max_tokens), device=dev)
                            for _ in range(t)]
            # token j of a verify attends to its own list at pos + j: one one-token attention per token
            self.pos_t = torch.zeros(t, dtype=torch.int32, device=dev)
            self.steps_t = torch.arange(t, dtype=torch.int32, device=dev)
            self.attn1 = DecodeAttention(num_q_heads=d.num_heads, num_kv_heads=1, d_main=d.kv_lora_rank,
                                         d_v=d.kv_lora_rank, d_rope=d.rope, num_tokens=1, num_splits=slot_splits,
                                         block_s=block_s, sm_scale=d.sm_scale, num_warps=4,
                                         v_chunks=max(1, d.kv_lora_rank // 128), min_chunk=min_chunk,
                                         device=dev) if t > 1 else None
        self.q_an = torch.zeros(t, d.q_lora_rank, dtype=bf, device=dev) if d.q_lora_rank and t > 1 else None
        self.q_pe = torch.zeros(t, d.num_heads, d.rope, dtype=bf, device=dev)
        self.o_lat = torch.zeros(t, d.num_heads, d.kv_lora_rank, dtype=bf, device=dev)
        self.xn = torch.zeros(t, d.hidden, dtype=bf, device=dev)
        self.ids = torch.zeros(t, max(d.top_k, 1), dtype=torch.int32, device=dev)
        self.wts = torch.zeros(t, max(d.top_k, 1), dtype=torch.float32, device=dev)
        self.router_logits = torch.zeros(t, max(d.num_experts, 1), dtype=torch.float32, device=dev)
        self.attn = DecodeAttention(num_q_heads=d.num_heads, num_kv_heads=1, d_main=d.kv_lora_rank, d_v=d.kv_lora_rank,
                                    d_rope=d.rope, num_tokens=1 if batch else t, num_splits=num_splits,
                                    block_s=block_s, sm_scale=d.sm_scale, num_warps=attn_warps,
                                    v_chunks=v_chunks, min_chunk=min_chunk, device=dev,
                                    pos_last=self.POS_ROW_LAST and few_rows,
                                    pdl=self.pdl, max_batch=t if batch else 1)  # [rows, 128] value slices: no spill at 4 x 16 rows
        self.moe = GroupedMoe(num_tokens=t, top_k=d.top_k, num_shared=d.num_shared, hidden=d.hidden,
                              inter=d.moe_inter, device=dev, pdl=self.pdl, early=self.early)
        self.dense = GroupedMoe(num_tokens=t, top_k=0, num_shared=1, hidden=d.hidden, inter=dense_inter,
                                device=dev, pdl=self.pdl, early=self.early) if dense_inter else None

    def block(self, lw: MlaLayer, h: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, index_cache: torch.Tensor | None = None,
              slots: torch.Tensor | None = None, k_scale: float = 1.0, next_lw: MlaLayer | None = None) -> None:
        """h [T, H] += attention; h += MLP/MoE (in place); writes this block's cache rows at pos.. (and
        with an indexer its key at pos into ``index_cache`` [max_tokens, index_dim]). A batch stack: row t
        decodes at pos[t] in slot slots[t] of ``cache`` [slots, max_tokens, r + rope]. A uint8 ``cache`` holds
        the latent as E4M3 bytes (vLLM's FP8 MLA cache): rows written as the values / ``k_scale`` rounded to
        nearest, read as fp8 * ``k_scale``. ``next_lw``: the block the caller runs next on this h (several rows:
        this block's last launch norms h for its attention, NORM_IN_REDUCE)."""
        d, t = self.dims, self.num_tokens
        normed, self._normed_for = self._normed_for == (id(lw), h.data_ptr()), None
        if self.batch != (slots is not None):
            raise ValueError("a batch stack takes the rows' slots (and only it does)")
        fmt = kv_fmt("fp8_e4m3", nearest=True) if cache.dtype == torch.uint8 else 0  # an FP8 latent
        if fmt and lw.sparse:
            raise ValueError("sparse attention keeps its latent in the model dtype (an FP8 latent: dense MLA)")
        kv = dict(kv_fmt=fmt, k_scale=k_scale, v_scale=k_scale)
        r, nope = d.kv_lora_rank, d.nope
        nq = d.num_heads * (nope + d.rope)
        lora = lw.wq_b is not None
        a_out = self.qkv[:, nq:] if lora else self.qkv  # q LoRA: [c, k_pe | q_a]; else [q | c, k_pe]
        for w, out in ((lw.wqkv_a, a_out), (lw.w_idx_rows, None)):
            if w is None:
                continue
            if out is None:  # the indexer's bf16 rows after a block-scaled FP8 stack's
                n0 = lw.wqkv_a.shape[0]
                out = a_out[:, n0:n0 + w.shape[0]]
            if t == 1:
                gemv_rows(h, w, out, norm_w=lw.attn_norm, eps=d.eps, **self._tile("wqkv_a"))
            else:  # the norm first: a norm prologue in each of the GEMV's programs loops over 16 padded rows
                if w is lw.wqkv_a and not normed:  # (or the previous block's last launch wrote it)
                    smallops.rmsnorm_rows(h, lw.attn_norm, self.xn, d.eps, pdl=self.pdl)
                gemv_rows(self.xn, w, out, dot=self.PROJ_DOT, dot_tile=self.DOT_TILE, pdl=self.pdl, early=self.early)
        if lora:  # q = q_b(RMSNorm(q_a)) into the q columns (row views: strided rows, contiguous columns)
            q_a = self.qkv[:, nq + r + d.rope:nq + r + d.rope + d.q_lora_rank]
            if t == 1:
                gemv_rows(q_a, lw.wq_b, self.qkv[:, :nq], norm_w=lw.q_a_norm, eps=d.eps, **self._tile("wq_b"))
            else:
                smallops.rmsnorm_rows(q_a, lw.q_a_norm, self.q_an, d.eps, pdl=self.pdl)
                gemv_rows(self.q_an, lw.wq_b, self.qkv[:, :nq], dot=self.PROJ_DOT, dot_tile=self.DOT_TILE,
                          pdl=self.pdl, early=self.early)
            if lw.index is not None:  # sparse attention: this layer's indexer picks each token's rows
                self._select(lw, q_a, index_cache, pos, cos, sin)
        br = min(self.ABSORB_BLOCK_R, r)
        absorb = self.absorb and lw.w_uk.stride(2) == 1  # absorbed q: [Hq, T, r]
        if absorb and self.prep_absorb and r % br == 0:
            _prep_absorb_kernel[(t * (d.num_heads + 1) + d.num_heads * (r // br),)](
                self.qkv, self.q_pe, cache, lw.kv_a_norm, pos, cos, sin, self.qkv.stride(0), d.eps, lw.w_uk, self.q_c1,
                lw.w_uk.stride(0), lw.w_uk.stride(1), NUM_HEADS=d.num_heads, NOPE=nope, ROPE=d.rope, R=r, BLOCK_R=br,
                PDL=self.pdl, EARLY=self.early, KV_FMT=fmt, inv_scale=1.0 / k_scale, T=t, BATCH=self.batch,
                slot_ptr=slots if self.batch else pos, stride_cs=cache.stride(0) if self.batch else 0, num_warps=4,
                **launch_opts(self.pdl))
        else:
            _mla_prep_kernel[(t, d.num_heads + 1)](self.qkv, self.q_pe, cache, lw.kv_a_norm, pos, cos, sin,
                                               self.qkv.stride(0), d.eps, NUM_HEADS=d.num_heads, NOPE=nope,
                                               ROPE=d.rope, R=r, PDL=self.pdl, slot_ptr=slots if self.batch else pos,
                                               stride_cs=cache.stride(0) if self.batch else 0, BATCH=self.batch,
                                               KV_FMT=fmt, inv_scale=1.0 / k_scale, num_warps=4,
                                               **launch_opts(self.pdl))
            if absorb:
                _absorb_kernel[(d.num_heads, triton.cdiv(r, br))](
                    self.qkv, lw.w_uk, self.q_c1, lw.w_uk.stride(0), lw.w_uk.stride(1), NOPE=nope, QK=nope + d.rope,
                    R=r, BLOCK_R=br, PDL=self.pdl, EARLY=self.early, T=t, stride_qkv=self.qkv.stride(0), num_warps=4,
                    **launch_opts(self.pdl))
        if absorb:
            q_c = self.q_c1
        else:
            q_nope = self.qkv[:, :nq].view(t, d.num_heads, nope + d.rope)[..., :nope]
            q_c = torch.matmul(q_nope.transpose(0, 1), lw.w_uk)  # absorbed: [Hq, T, r]
        if self.batch:  # row t: its own query over its own slot's rows 0..pos[t]
            self.attn(q_c, cache, cache, pos, self.o_lat, stride_kt=r + d.rope, stride_vt=r + d.rope, rope_offset=r,
                      q_pe=self.q_pe, stride_qt=r, stride_qh=t * r, slot_ids=slots, stride_ks=cache.stride(0),
                      stride_vs=cache.stride(0), combine=not self.fused_uv, **kv)
        elif not lw.sparse or t == 1:  # dense, or one token over its indexer's list
            sparse = (self.selects[0].idx, self.selects[0].count) if lw.sparse else None
            self.attn(q_c, cache, cache, pos, self.o_lat, stride_kt=r + d.rope, stride_vt=r + d.rope, rope_offset=r,
                      q_pe=self.q_pe, stride_qt=r, stride_qh=t * r, sparse=sparse, combine=not self.fused_uv, **kv)
        else:  # token j: its query rows (q_c[:, j], q_pe[j]) over its own list, causal at pos + j
            for j, sel in enumerate(self.selects):
                self.attn1(q_c[:, j], cache, cache, self.pos_t[j:j + 1], self.o_lat[j], stride_kt=r + d.rope,
                           stride_vt=r + d.rope, rope_offset=r, q_pe=self.q_pe[j], stride_qt=r, stride_qh=t * r,
                           sparse=(sel.idx, sel.count))
        if self.fused_uv:  # the splits merged and up-projected: [Hq, T, v]
            bv, cr, nw = self.uv_tile
            bv = min(bv, triton.next_power_of_2(d.v_dim))
            _combine_uv_kernel[(d.num_heads, triton.cdiv(d.v_dim, bv), t)](
                self.attn.part_o, self.attn.part_ml, lw.w_uv_t, self.o1, NUM_SPLITS=self.attn.num_splits, R=r,
                V=d.v_dim, BLOCK_V=bv, CHUNK_R=min(cr, r), PDL=self.pdl, EARLY=self.early, T=t,
                NUM_HEADS=d.num_heads, num_warps=nw, **launch_opts(self.pdl))
            o = self.o1
        else:
            o = torch.matmul(self.o_lat.transpose(0, 1), lw.w_uv_t)  # [Hq, T, v]
        if t == 1:
            gemv_rows(o.view(1, -1), lw.wo, h, residual=h, **self._tile("wo"))
        else:  # [Hq, T, v] read in place (its [T, Hq * v] transpose would be one more copy kernel)
            gemv_rows(o, lw.wo, h, residual=h, dot=self.PROJ_DOT, dot_tile=self.DOT_TILE, heads=True, pdl=self.pdl,
                      early=self.early)
        route = dict(n_group=d.n_group, topk_group=d.topk_group)
        shared = None
        if lw.is_moe and self.fused_router:  # the MLP's norm, the router and its top-k in one launch
            if self.SHARED_IN_ROUTER:  # (one token) with the shared experts' gate/up streaming beside them
                shared = self.moe.shared_gate_up(lw.shared_gate_up)
            router(h, lw.router, lw.router_bias, self.ids, self.wts, d.top_k, d.routed_scale, self.router_logits,
                   norm_w=lw.mlp_norm, eps=d.eps, xn_out=self.xn, count=self.router_count, pdl=self.pdl,
                   early=self.early, shared=shared, **route)
        else:
            smallops.rmsnorm_rows(h, lw.mlp_norm, self.xn, d.eps, pdl=self.pdl)
            if lw.is_moe:
                router(self.xn, lw.router, lw.router_bias, self.ids, self.wts, d.top_k, d.routed_scale,
                       self.router_logits, pdl=self.pdl, early=self.early, **route)
        mlp = self.moe if lw.is_moe else self.dense
        nxt = (next_lw.attn_norm, self.xn, d.eps) if self.norm_in_reduce and next_lw is not None else None
        if mlp(self.xn, self.ids, self.wts, lw.gate_up, lw.down, lw.shared_gate_up, lw.shared_down, h,
               shared_done=shared is not None, next_norm=nxt) and nxt is not None:
            self._normed_for = (id(next_lw), h.data_ptr())

    def latent(self, lw: MlaLayer, h: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_scale: float = 1.0, slots: torch.Tensor | None = None) -> None:
        """One token's cache row alone, the start of ``block`` without its query: RMSNorm(h) * attn_norm, the latent
        rows of wqkv_a ([c, k_pe]; a block-scaled FP8 wqkv_a: all its rows), kv_a_norm and the rope into cache[pos]
        (what a later token attends to). A batch stack: row t's at pos[t] of slot slots[t] of ``cache`` [slots,
        max_tokens, r + rope]. Dense attention (an indexer's key row would be missing)."""
        d, t = self.dims, self.num_tokens
        if self.batch != (slots is not None):
            raise ValueError("a batch stack takes the rows' slots (and only it does)")
        if (t != 1 and not self.batch) or lw.index is not None or lw.sparse:
            raise ValueError("latent() writes one token's row (or a batch's rows) of a dense-attention block")
        r, nq = d.kv_lora_rank, d.num_heads * (d.nope + d.rope)
        lora = lw.wq_b is not None
        first = 0 if lora else nq  # the latent's rows in wqkv_a: [c, k_pe | q_a] or [q | c, k_pe]
        if isinstance(lw.wqkv_a, torch.Tensor):
            w, out = lw.wqkv_a[first:first + r + d.rope], self.qkv[:, nq:nq + r + d.rope]
        else:
            w, out = lw.wqkv_a, self.qkv[:, nq:] if lora else self.qkv
        if t == 1:
            gemv_rows(h, w, out, norm_w=lw.attn_norm, eps=d.eps, **self._tile("wqkv_a"))
        else:  # as block's rows: the norm first, then the tensor-core GEMV
            smallops.rmsnorm_rows(h, lw.attn_norm, self.xn, d.eps, pdl=self.pdl)
            gemv_rows(self.xn, w, out, dot=self.PROJ_DOT, dot_tile=self.DOT_TILE, pdl=self.pdl, early=self.early)
        fmt = kv_fmt("fp8_e4m3", nearest=True) if cache.dtype == torch.uint8 else 0
        _mla_latent_kernel[(t,)](self.qkv, self.q_pe, cache, lw.kv_a_norm, pos, cos, sin, self.qkv.stride(0), d.eps,
                                 NUM_HEADS=d.num_heads, NOPE=d.nope, ROPE=d.rope, R=r, PDL=self.pdl, KV_FMT=fmt,
                                 inv_scale=1.0 / k_scale, slot_ptr=slots if self.batch else pos,
                                 stride_cs=cache.stride(0) if self.batch else 0,
                                 BATCH=self.batch, num_warps=4, **launch_opts(self.pdl))

    def _tile(self, name: str) -> dict:
        bn, bk, nw, st = self.tiles[name]
        return dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=self.pdl, early=self.early,
                    fp8_rows=self.FP8_ROWS.get(name))

    def _select(self, lw: MlaLayer, q_a: torch.Tensor, index_cache: torch.Tensor, pos: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The indexer of this layer for each token j: its query (q_b over RMSNorm(q_a)), key (into index_cache
        at pos + j) and head weights, then the top index_topk cache rows up to pos + j into self.selects[j]'s
        list (the sparse attention's)."""
        d, t = self.dims, self.num_tokens
        if index_cache is None:
            raise ValueError("a layer with an indexer needs its index_k cache")
        if t == 1:
            gemv_rows(q_a, lw.index.wq_b, self.q_idx, norm_w=lw.q_a_norm, eps=d.eps, **self._tile("wq_b"))
        else:  # q_an: RMSNorm(q_a), made for q_b
            gemv_rows(self.q_an, lw.index.wq_b, self.q_idx, dot=self.PROJ_DOT, dot_tile=self.DOT_TILE)
        k0 = d.num_heads * (d.nope + d.rope) + d.kv_lora_rank + d.rope + d.q_lora_rank
        _index_prep_kernel[(d.index_heads + 1, t)](
            self.q_idx, self.q_idx_roped, self.qkv[0, k0:], self.w_idx, index_cache, lw.index.k_norm,
            lw.index.k_norm_bias, pos, cos, sin, d.index_heads ** -0.5, self.qkv.stride(0), IH=d.index_heads,
            IH_POW2=triton.next_power_of_2(d.index_heads), D=d.index_dim, ROPE=d.rope,
            INTER=d.index_rope_interleave, num_warps=4)
        if t == 1:
            self.selects[0](self.q_idx_roped[0], self.w_idx[0], index_cache, pos)
            return
        torch.add(pos, self.steps_t, out=self.pos_t)
        for j, sel in enumerate(self.selects):
            sel(self.q_idx_roped[j], self.w_idx[j], index_cache, self.pos_t[j:j + 1])
