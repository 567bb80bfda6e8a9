"""DeepSeek-V3-style decoder: MLA with absorbed projections, sigmoid/noaux_tc MoE with shared experts,
dense first layers, and MTP layers for speculative drafts; DeepSeek-V3.2's sparse attention (DSA).

Attention runs in the latent space for every step (prefill, decode, verify): the cache row of a
token is ``[c (kv_lora_rank), k_pe (rope)]``; queries are absorbed, ``q_c = q_nope @ W_UK``, so
scores are ``[q_c, q_pe] . [c, k_pe]`` (one shared KV head) and the latent output is lifted by
``W_UV``. Same forward contract as llama.py. MoE: static gather of the chosen experts' weights for
small steps (decode, graph-safe; the CPU's one float32 token reads each chosen expert's weights in
place), a per-expert loop for large ones (prefill).

Sparse attention (``cfg.index_topk`` > 0, deepseek_v32 and glm_moe_dsa): a lightning indexer scores every
cached token for each query, ``sum_h w_h * relu(q_h . k * d^-1/2)`` with ``w = weights_proj(x) *
H^-1/2``, its queries from the q LoRA's normed output (``wq_b``), its one key per token from
``LayerNorm(wk(x))``, both roped on the first rope dims (DeepSeek-V3.2 half-split, GLM interleaved);
its keys live in the slot's ``index_k`` cache. The query then attends, causally, only to the
``index_topk`` tokens that score highest (all of them while there are fewer), as HF transformers'
DeepseekV32 / GlmMoeDsa compute it; GLM's "shared" layers have no indexer and reuse the choice of the
last layer before them that has one.

Tensor parallelism (``tp``, tp.py): the model holds its rank's attention heads (the latent
projections, norms and indexer whole: every rank keeps the whole latent cache), its slice of the
dense MLPs and shared experts, and its routed experts (``moe_parallel="ep"``) or its slice of every
expert (``"tp"``); attention and MLP outputs are all-reduced (the routed and shared experts' in one),
the logits all-gathered. The router runs on every rank over the same (reduced) input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpustep
from .cache import KvCache
from .config import ModelConfig
from .cuda.reference import limit_to_groups
from .fp8 import expert, expert_matmul, is_fp8, linear
from .kvquant import dequantize, quantize
from .layers import cached_rows, causal_mask, column_major, rms_norm, swiglu, write_cache
from .rope import rope_factors, rope_tables, rotate, yarn_mscale
from .tp import ShardPlan, TensorParallel, gather_vocab, plan
from .weights import is_moe_layer

GATHER_MAX_TOKENS = 64  # steps with more tokens take the per-expert loop (host syncs allowed there)
PROJECTIONS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "w_gate_up", "w_down", "router", "experts_gate_up", "experts_down",
               "shared_gate_up", "shared_down", "idx_wq_b", "idx_wk", "idx_weights")  # a block's F.linear weights


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class MlaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, p: ShardPlan):
        super().__init__()
        h, nh, r = cfg.hidden_size, p.heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.attn_norm = _param(h)
        if cfg.q_lora_rank:
            self.wq_a, self.q_a_norm, self.wq_b = _param(cfg.q_lora_rank, h), _param(cfg.q_lora_rank), _param(nh * qk, cfg.q_lora_rank)
        else:
            self.wq = _param(nh * qk, h)
        self.wkv_a = _param(r + cfg.qk_rope_head_dim, h)
        self.kv_a_norm = _param(r)
        self.w_uk = _param(nh, cfg.qk_nope_head_dim, r)
        self.w_uv = _param(nh, cfg.v_head_dim, r)
        self.wo = _param(h, nh * cfg.v_head_dim)
        self.has_indexer = cfg.has_indexer(idx)
        if self.has_indexer:  # the sparse-attention indexer
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            self.idx_wq_b, self.idx_wk = _param(ih * idim, cfg.q_lora_rank), _param(idim, h)
            self.idx_k_norm, self.idx_k_norm_bias, self.idx_weights = _param(idim), _param(idim), _param(ih, h)
        self.mlp_norm = _param(h)
        self.is_moe = is_moe_layer(cfg, idx)
        if self.is_moe:
            e, i = p.experts, p.moe_intermediate
            self.router, self.router_bias = _param(cfg.num_experts, h), _param(cfg.num_experts)
            self.experts_gate_up, self.experts_down = _param(e, 2 * i, h), _param(e, h, i)
            if cfg.num_shared_experts:
                si = p.shared_intermediate
                self.shared_gate_up, self.shared_down = _param(2 * si, h), _param(h, si)
        else:
            self.w_gate_up, self.w_down = _param(2 * p.intermediate, h), _param(h, p.intermediate)


class MtpLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, p: ShardPlan):
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm, self.eh_proj = _param(h), _param(h), _param(h, 2 * h)
        self.head_norm, self.head, self.embed = _param(h), _param(p.vocab_rows, h), _param(cfg.vocab_size, h)
        self.block = MlaBlock(cfg, idx, p)


def route(cfg: ModelConfig, blk: MlaBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing of x [N, H]: (expert ids [N, k], weights [N, k] float32)."""
    scores = F.linear(x.float(), blk.router.float()).sigmoid()
    choice = limit_to_groups(scores + blk.router_bias, cfg.n_group, cfg.topk_group)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def moe(cfg: ModelConfig, blk: MlaBlock, x: torch.Tensor, p: ShardPlan | None = None) -> torch.Tensor:
    """Routed experts plus shared experts for x [..., H]; under tensor parallelism (``p``) this rank's
    share of it (its experts, or its slice of every expert), for the caller to all-reduce."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = route(cfg, blk, x)
    mine = None
    if p is not None and p.experts != cfg.num_experts:  # expert-parallel: only the experts held here count
        local = ids - p.first_expert
        mine = (local >= 0) & (local < p.experts)
        # the others' weights are 0; their ids point at a held expert so that the gather stays static
        ids, weights = local.clamp(0, p.experts - 1), weights * mine
    if x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and not is_fp8(blk.experts_gate_up):
        # the CPU's one token: each chosen expert's weights where they lie (a gather copied them, ~3x the time)
        out = None
        for j, e in enumerate(ids[0].tolist()):
            y = swiglu(x, blk.experts_gate_up[e], blk.experts_down[e]) * weights[:, j:j + 1]
            out = y if out is None else out + y
    elif x.shape[0] <= GATHER_MAX_TOKENS:  # static: gather the chosen experts' weights
        gate, up = expert_matmul("nh,nkih->nki", x, blk.experts_gate_up, ids).chunk(2, dim=-1)
        y = expert_matmul("nki,nkhi->nkh", F.silu(gate) * up, blk.experts_down, ids)
        out = (y * weights[..., None].to(y.dtype)).sum(dim=1)
    else:
        out = torch.zeros_like(x)
        for e in (ids if mine is None else ids[mine]).unique().tolist():
            tok, pos = torch.where(ids == e if mine is None else (ids == e) & mine)
            y = swiglu(x[tok], expert(blk.experts_gate_up, e), expert(blk.experts_down, e))
            out.index_add_(0, tok, (y * weights[tok, pos, None]).to(x.dtype))
    if cfg.num_shared_experts:
        out = out + swiglu(x, blk.shared_gate_up, blk.shared_down)
    return out.view(shape)


class DeepseekModel(nn.Module):
    """Parameters named as in weights.py (``tp``: this rank's shards of them, tp.py); call :meth:`bind`
    with the cache before the first forward."""

    family = "mla"

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False, tp: TensorParallel | None = None,
                 moe_parallel: str = "tp"):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel.single()
        self.plan = p = plan(cfg, self.tp.rank, self.tp.size, moe_parallel)
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MlaBlock(cfg, i, p) for i in range(cfg.num_layers))
        self.final_norm = _param(cfg.hidden_size)
        self.lm_head = _param(p.vocab_rows, cfg.hidden_size)
        self.mtp = nn.ModuleList(MtpLayer(cfg, cfg.num_layers + j, p)
                                 for j in range(cfg.num_mtp_layers if with_mtp else 0))
        self.has_mtp = with_mtp and cfg.num_mtp_layers > 0
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        if cfg.rope["rope_type"] == "yarn" and cfg.rope.get("mscale_all_dim"):
            scale *= yarn_mscale(cfg.rope["factor"], cfg.rope["mscale_all_dim"]) ** 2
        self.scale = scale
        self.cache: KvCache | None = None
        # the fused CPU step (cpustep.py) once attach_cpu_step found it applies, else why not; fused: whether
        # the last forward took it
        self.cpu_step: cpustep.MlaKernel | None = None
        self.cpu_step_reason: str | None = "not attached"
        self.fused = False

    def bind(self, cache: KvCache) -> None:
        """Attach the KV cache and build rope tables for its capacity (and, on the CPU, lay the float32
        projections out for one-token products: :meth:`column_major_projections`)."""
        self.cache = cache
        self.cos, self.sin = rope_tables(self.cfg.rope, self.cfg.qk_rope_head_dim, cache.max_tokens, self.embed.device)
        if self.embed.device.type == "cpu" and self.embed.dtype == torch.float32:
            self.column_major_projections()

    def attach_cpu_step(self, mode: str = "auto") -> None:
        """Use the fused CPU step (cpustep.py) where it applies (after :meth:`bind`; ``mode`` "off": never): steps of
        one token a slot, steps verifying drafts (token by token) and the MTP layer's drafts; ``cpu_step_reason``
        says why not otherwise."""
        self.cpu_step, self.cpu_step_reason = cpustep.attach(self, self.cache, mode)

    def column_major_projections(self) -> None:
        """The float32 projection weights column-major (layers.column_major: the one-token F.linear's
        faster form on the CPU), the stacked experts' each; the embeddings, and a head that shares an
        embedding's storage, keep their layout (F.embedding gathers their rows)."""
        blocks = [*self.layers, *(m.block for m in self.mtp)]
        mats = [getattr(blk, n, None) for blk in blocks for n in PROJECTIONS]
        embeds = {e.untyped_storage().data_ptr() for e in (self.embed, *(m.embed for m in self.mtp))}
        heads = [self.lm_head, *(w for m in self.mtp for w in (m.eh_proj, m.head))]
        column_major(mats + [w for w in heads if w.untyped_storage().data_ptr() not in embeds])

    def _attention(self, layer: int, blk: MlaBlock, x, cos, sin, mask, slot_ids, positions) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nope, r = self.plan.heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q_resid = rms_norm(linear(x, blk.wq_a), blk.q_a_norm, cfg.rms_norm_eps)
            q = linear(q_resid, blk.wq_b)
        else:
            q = linear(x, blk.wq)
        if cfg.index_topk:  # sparse attention: each query sees only the tokens an indexer picks
            if blk.has_indexer:  # this layer's own (GLM's shared layers reuse the last one before them)
                self._picked = self._selected(layer, blk, x, q_resid, cos, sin, mask, slot_ids, positions)
            mask = mask & self._picked
        q_nope, q_pe = q.view(b, t, nh, -1).split([nope, cfg.qk_rope_head_dim], dim=-1)
        c, k_pe = linear(x, blk.wkv_a).split([r, cfg.qk_rope_head_dim], dim=-1)
        c = rms_norm(c, blk.kv_a_norm, cfg.rms_norm_eps)
        q_pe = rotate(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = rotate(k_pe[:, :, None], cos, sin, cfg.rope_interleave)[:, :, 0]
        cache, fmt = self.cache.kv[layer], self.cache.kv_format
        row = torch.cat([c, k_pe], dim=-1)
        one = b * t == 1 and x.device.type == "cpu"  # the CPU's one token: the heads' products as one bmm each
        if one:  # (einsum's own bmm with less around it: ~25 us a layer less for both)
            q_c = torch.bmm(q_nope.view(nh, 1, nope), blk.w_uk).view(b, nh, t, r)
        else:
            q_c = torch.einsum("bthn,hnr->bhtr", q_nope, blk.w_uk)  # absorbed: [B, H, T, r]
        query = torch.cat([q_c, q_pe.transpose(1, 2)], dim=-1)  # [B, H, T, r + rope]
        if fmt is None:
            write_cache(cache, slot_ids, positions, row)
            kv = cached_rows(cache, slot_ids, mask.shape[-1])  # [B, n, r + rope]: one KV head shared by all query heads
        else:  # an FP8 latent as vLLM's CUDA MLA backends keep it: bytes rounded to nearest, attended in float32
            k_scale = self.cache.scales[layer][0]
            write_cache(cache, slot_ids, positions, quantize(row, k_scale, fmt, nearest=self.cache.kv_nearest))
            kv = dequantize(cached_rows(cache, slot_ids, mask.shape[-1]), k_scale, fmt)
            query = query.float()
        scores = torch.matmul(query.flatten(1, 2), kv.transpose(1, 2)).view(b, nh, t, -1) * self.scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(kv.dtype)
        out = torch.matmul(probs.flatten(1, 2), kv[..., :r]).view(b, nh, t, r).to(x.dtype)  # [B, H, T, r]
        if one:
            out = torch.bmm(out.view(nh, 1, r), blk.w_uv.transpose(1, 2)).view(b, t, nh, -1)
        else:
            out = torch.einsum("bhtr,hvr->bthv", out, blk.w_uv)
        return linear(out.reshape(b, t, -1), blk.wo)

    def _selected(self, layer: int, blk: MlaBlock, x, q_resid, cos, sin, mask, slot_ids,
                  positions) -> torch.Tensor:
        """[B, 1, T, S] boolean: the cache positions each query's indexer picks (its top index_topk
        visible ones); writes this step's indexer keys into the slot's index_k cache first."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, d, rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = linear(q_resid, blk.idx_wq_b).view(b, t, nh, d)
        inter = cfg.index_rope_interleave
        q = torch.cat([rotate(q[..., :rope], cos, sin, inter), q[..., rope:]], dim=-1)
        k = F.layer_norm(linear(x, blk.idx_wk), (d,), blk.idx_k_norm, blk.idx_k_norm_bias, 1e-6)
        k = torch.cat([rotate(k[:, :, None, :rope], cos, sin, inter)[:, :, 0], k[..., rope:]], dim=-1)
        cache = self.cache.index_k[layer]
        write_cache(cache, slot_ids, positions, k)
        keys = cached_rows(cache, slot_ids, mask.shape[-1]).float()  # [B, S, d]
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q.float(), keys) * d ** -0.5)
        weights = linear(x, blk.idx_weights).float() * nh ** -0.5  # [B, T, H]
        index = torch.einsum("bth,bths->bts", weights, scores).masked_fill(~mask[:, 0], float("-inf"))
        top = index.topk(min(cfg.index_topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(mask[:, 0]).scatter(-1, top, True)[:, None]

    def _block(self, layer: int, blk: MlaBlock, x, cos, sin, mask, slot_ids, positions) -> torch.Tensor:
        eps, tp = self.cfg.rms_norm_eps, self.tp
        x = x + tp.all_reduce(self._attention(layer, blk, rms_norm(x, blk.attn_norm, eps), cos, sin, mask, slot_ids,
                                              positions))
        h = rms_norm(x, blk.mlp_norm, eps)
        p = self.plan if tp.size > 1 else None
        return x + tp.all_reduce(moe(self.cfg, blk, h, p) if blk.is_moe else swiglu(h, blk.w_gate_up, blk.w_down))

    def _rope_mask(self, positions, num_keys: int | None):
        """rope.rope_factors at the positions (once a step, in the model's dtype) and the causal mask."""
        cos, sin = rope_factors(self.cos[positions], self.sin[positions], self.embed.dtype)
        return cos, sin, causal_mask(positions, num_keys or self.cache.max_tokens)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                num_keys: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [B, T, hidden]; ``num_keys`` > every position (default: all)."""
        self.fused = self._fused_rows(tokens, positions)
        if self.fused:  # a few tokens a slot, each seeing its own prefix: one native call a token
            return self.cpu_step.forward(tokens.tolist(), slot_ids.tolist(), positions.tolist())
        x = F.embedding(tokens, self.embed)
        cos, sin, mask = self._rope_mask(positions, num_keys)
        for i, blk in enumerate(self.layers):
            x = self._block(i, blk, x, cos, sin, mask, slot_ids, positions)
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    def _fused_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether the fused CPU step takes these rows: one token a slot, or a few at consecutive positions (a
        step verifying drafts; a prefill keeps the torch step)."""
        if self.cpu_step is None or torch.compiler.is_compiling() or tokens.shape[1] > cpustep.MAX_TOKENS_A_SLOT:
            return False
        return tokens.shape[1] == 1 or bool((positions[:, 1:] - positions[:, :-1] == 1).all())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab] (every rank: the whole vocabulary)."""
        return gather_vocab(self.tp, linear(hidden, self.lm_head).float(), self.cfg.vocab_size)

    def mtp_forward(self, tokens, positions, prev_hidden, slot_ids, num_keys: int | None = None,
                    depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer at positions [B, T]: token i+1 and hidden i -> (recycled hidden, float32 logits).

        ``prev_hidden`` is the main model's (final-normed) hidden or a recycled MTP hidden; the
        recycled hidden is the MTP output after its head norm, as vLLM and SGLang feed it back.
        """
        j = depth % len(self.mtp)
        layer, eps = self.mtp[j], self.cfg.rms_norm_eps
        if self._fused_rows(tokens, positions) and j < self.cpu_step.num_mtp:  # one native call a token
            h = self.cpu_step.mtp(j, tokens.tolist(), slot_ids.tolist(), positions.tolist(), prev_hidden)
            return h, gather_vocab(self.tp, linear(h, layer.head).float(), self.cfg.vocab_size)
        e = F.embedding(tokens, layer.embed)
        e = torch.where((positions == 0)[..., None], torch.zeros_like(e), e)  # position 0 carries no token
        x = linear(torch.cat([rms_norm(e, layer.enorm, eps), rms_norm(prev_hidden, layer.hnorm, eps)], dim=-1), layer.eh_proj)
        cos, sin, mask = self._rope_mask(positions, num_keys)
        x = self._block(self.cfg.num_layers + j, layer.block, x, cos, sin, mask, slot_ids, positions)
        h = rms_norm(x, layer.head_norm, eps)
        return h, gather_vocab(self.tp, linear(h, layer.head).float(), self.cfg.vocab_size)
