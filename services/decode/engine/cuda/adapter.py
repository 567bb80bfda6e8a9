"""Build the fast path from the engine's loaded models (services/decode/engine llama.py, deepseek.py).

    dec = gqa_decoder_from_engine(model, slot)        # model: LlamaModel, bound to its KvCache
    step = GraphedFn(dec.step, use_graph=True)        # captured on first call
    dec.set_state(first_token_id, num_cached_tokens)  # host side, once per request
    step()                                            # one token; no host sync
    dec.out_tokens[: dec.step_idx]                    # greedy tokens so far (read when emitting)

    mdec = mla_decoder_from_engine(model, slot)       # model: DeepseekModel (with_mtp for drafts)
    GraphedFn(mdec.plain_step, ...) / GraphedFn(lambda: mdec.spec_step(k), ...)

Weights are used in place (views of the engine's parameters) except what ``mla.prepare_layer`` lays
out once (fused wq|wkv_a or, with q LoRA, wkv_a|wq_a; w_uv transposed, shared experts split). The slot's cache views are the
engine's own (``model.cache.k_caches[i][slot]`` ...), so injected KV is read with no copy and the fast path's
writes are the engine's cache. Sampling attaches per slot (the decoders' ``attach_sampler``); the fast path needs bf16, Llama-family blocks (Llama,
Mistral, Qwen2 with its q/k/v bias, Qwen3 with its q/k norm, an o_proj bias; head_dim a power of two)
and DeepSeek-V3-family blocks (with or without q LoRA, group-limited routing or not); anything else
raises ValueError (use the engine's torch path).
"""

from __future__ import annotations

import torch

from .batch import GqaBatchDecoder
from .llama import FastOptions, GqaDecoder, GqaLayer, GqaModel
from .mla import MlaDims, MtpWeights, prepare_layer
from .mla_decoder import MlaBatchDecoder, MlaBatchSpecDecoder, MlaDecoder, MlaModel


def _gqa_model(model) -> GqaModel:
    cfg = model.cfg

    def data(p):
        return None if p is None else p.data

    layers = [GqaLayer(b.attn_norm.data, b.wqkv.data, b.wo.data, b.mlp_norm.data, b.w_gate_up.data, b.w_down.data,
                       bqkv=data(b.bqkv), bo=data(b.bo), q_norm=data(b.q_norm), k_norm=data(b.k_norm))
              for b in model.layers]
    plan = getattr(model, "plan", None)  # a tensor-parallel rank holds its share of the heads
    heads, kv_heads = (plan.heads, plan.kv_heads) if plan is not None else (cfg.num_heads, cfg.num_kv_heads)
    return GqaModel(layers, model.embed.data, model.final_norm.data, model.lm_head.data, heads,
                    kv_heads, cfg.head_dim, cfg.rms_norm_eps)


def _fp8_scales(model) -> list | None:
    """Per-layer FP8 scales of an engine LlamaModel (None: no FP8 weights); ValueError where the FP8
    step cannot run it (block scales, an FP8 lm_head)."""
    from ..fp8 import is_fp8
    from .fp8 import Fp8Scales

    names = ("wqkv", "wo", "w_gate_up", "w_down")
    if not any(is_fp8(getattr(b, n)) for b in model.layers for n in names):
        return None
    if is_fp8(model.lm_head):
        raise ValueError("an FP8 lm_head is not on the fast path: keep lm_head in the checkpoint's ignore list")
    from .fp8block import weight_of

    scales = []
    for b in model.layers:
        per = {}
        for n in names:
            w = getattr(b, n)
            if is_fp8(w) and w.block is not None:  # block scales: the projection itself as BlockFp8
                if b.bqkv is not None or b.bo is not None:
                    raise ValueError("block-scaled FP8 with q/k/v or o biases is not on the fast path (the bias "
                                     "is added before the output's rounding there)")
                per[n] = weight_of(w.data, w.scale, w.block, w.act)
            else:
                per[n] = w.scale if is_fp8(w) else None
        scales.append(Fp8Scales(**per))
    return scales


def _fp8_act(model) -> bool:
    """Whether an FP8 engine LlamaModel's checkpoint quantizes activations too (FP8_DYNAMIC)."""
    return any(getattr(getattr(b, n), "act", None) is not None for b in model.layers for n in ("wqkv", "wo"))


def gqa_decoder_from_engine(model, slot: int, options: FastOptions | None = None, max_steps: int = 4096) -> GqaDecoder:
    """GqaDecoder over a bound engine LlamaModel's weights and slot ``slot``'s K/V views (the FP8 step,
    cuda/fp8.py, where the model holds FP8 weights)."""
    cfg, cache = model.cfg, model.cache
    args = (_gqa_model(model), [cache.k_caches[i][slot] for i in range(cfg.num_layers)],
            [cache.v_caches[i][slot] for i in range(cfg.num_layers)], model.cos, model.sin, options, max_steps)
    kv = dict(kv_format=getattr(cache, "kv_format", None), kv_scales=getattr(cache, "scales", None),
              kv_nearest=getattr(cache, "kv_nearest", False))
    scales = _fp8_scales(model)
    if scales is None:
        return GqaDecoder(*args, **kv, tp=getattr(model, "tp", None))
    from .fp8 import Fp8GqaDecoder

    return Fp8GqaDecoder(*args, scales=scales, act_fp8=_fp8_act(model), **kv)


def gqa_batch_decoder_from_engine(model, batch: int, options: FastOptions | None = None,
                                  max_steps: int = 256) -> GqaBatchDecoder:
    """GqaBatchDecoder of ``batch`` rows over a bound engine LlamaModel's weights and every slot's K/V
    (the whole per-layer cache tensors; padded rows decode on the cache's scratch slot)."""
    cache = model.cache
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        raise ValueError("the batched step runs on one GPU: a tensor-parallel engine steps its slots one at a time "
                         "on the fast path, or together on the reference step")
    scales = _fp8_scales(model)
    act = scales is not None and _fp8_act(model)
    return GqaBatchDecoder(_gqa_model(model), cache.k_caches, cache.v_caches, model.cos, model.sin, batch, options,
                           max_steps, scratch_slot=cache.scratch_slot, kv_format=getattr(cache, "kv_format", None),
                           kv_scales=getattr(cache, "scales", None), fp8_scales=scales, act_fp8=act,
                           kv_nearest=getattr(cache, "kv_nearest", False))


def _mla_params(module: torch.nn.Module) -> dict:
    """A DeepSeek-family block's parameters for prepare_layer: block-scaled FP8 ones as fp8block.BlockFp8 (their
    bytes and the ``<name>_scale`` buffers engine/fp8.attach registered)."""
    from ..fp8 import is_fp8
    from .fp8block import weight_of

    out = {}
    for name, p in module.named_parameters(recurse=False):
        out[name] = (weight_of(p.data, getattr(module, name + "_scale"), p.block, p.act) if is_fp8(p)
                     else p.data)
    return out


def _mla_layer(block, moe_inter: int, sparse: bool = False):
    return prepare_layer(_mla_params(block), moe_inter, sparse)


def attention_splits(cache_rows: int) -> int:
    """Splits of the MLA decode attention over a slot of ``cache_rows`` rows: one per 64 rows, at most 16 in
    slots up to 8K rows (16 is best at 1K on the H200), 32 up to 16K and 64 beyond (the V2-Lite shape at 32K:
    64 splits 1.67x faster than 16 on the H100, bench/NOTES-gpu.md run G1); always a power of two (the
    combine kernel's ``tl.arange`` over them must be). A context shorter than the slot uses as many of them
    as it fills with mla.SPLIT_MIN_ROWS rows each; the rest stay empty. A one-token stack over at most 16 heads
    takes twice as many, of fewer rows each (mla.MlaStack.FEW_ROWS_ATTN)."""
    cap = 16 if cache_rows <= 8192 else 32 if cache_rows <= 16384 else 64
    return 1 << (max(1, min(cap, -(-cache_rows // 64))).bit_length() - 1)


def _mla_model(model) -> MlaModel:
    """The fast path's MlaModel over a bound engine DeepseekModel's weights (and its first MTP layer, if loaded):
    built once per engine model and shared by every slot's and batch's decoder (what ``prepare_layer`` lays out
    anew, the fused projections and w_uv transposed, exists once)."""
    built = getattr(model, "_fast_mla_model", None)
    if built is not None:
        return built
    cfg = model.cfg
    dense_inter = cfg.intermediate_size if any(not b.is_moe for b in model.layers) else 0
    dims = MlaDims(cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.num_shared_experts, cfg.routed_scaling_factor, cfg.rms_norm_eps, model.scale,
                   q_lora_rank=cfg.q_lora_rank or 0, n_group=cfg.n_group, topk_group=cfg.topk_group,
                   index_topk=cfg.index_topk, index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
                   index_rope_interleave=cfg.index_rope_interleave)
    sparse = bool(cfg.index_topk)
    layers = [_mla_layer(b, cfg.moe_intermediate_size, sparse) for b in model.layers]
    mtp = None
    if model.has_mtp:
        m0 = model.mtp[0]
        mtp = MtpWeights(m0.enorm.data, m0.hnorm.data, _mla_params(m0)["eh_proj"], m0.head_norm.data, m0.head.data,
                         m0.embed.data, _mla_layer(m0.block, cfg.moe_intermediate_size, sparse))
    model._fast_mla_model = MlaModel(dims, layers, model.embed.data, model.final_norm.data, model.lm_head.data, mtp,
                                     dense_inter)
    return model._fast_mla_model


def mla_batch_decoder_from_engine(model, batch: int, max_steps: int = 256) -> MlaBatchDecoder:
    """MlaBatchDecoder of ``batch`` rows over a bound engine DeepseekModel's weights and every slot's latent
    cache (the whole per-layer tensors of the main model; padded rows decode on the cache's scratch slot), and the
    MTP layer's cache where the model has one (its plain steps can keep it: ``step(mtp_row=True)``)."""
    n = len(model.layers)
    caches = list(model.cache.kv[:n])
    mtp_cache = model.cache.kv[n] if len(model.cache.kv) > n else None
    return MlaBatchDecoder(_mla_model(model), caches, model.cos, model.sin, batch, max_steps=max_steps,
                           scratch_slot=model.cache.scratch_slot, num_splits=attention_splits(caches[0].shape[1]),
                           kv_scales=_latent_scales(model.cache), mtp_cache=mtp_cache)


def mla_batch_spec_decoder_from_engine(model, batch: int, k: int, draft_vocab: int | None = None
                                       ) -> MlaBatchSpecDecoder:
    """MlaBatchSpecDecoder of ``batch`` rows with ``k`` drafts each over a bound engine DeepseekModel's weights, its
    first MTP layer and every slot's latent cache (the main model's layers, then the MTP layer's)."""
    caches = list(model.cache.kv[: len(model.layers) + 1])
    return MlaBatchSpecDecoder(_mla_model(model), caches, model.cos, model.sin, batch, k,
                               scratch_slot=model.cache.scratch_slot, num_splits=attention_splits(caches[0].shape[1]),
                               draft_vocab=draft_vocab, kv_scales=_latent_scales(model.cache))


def _latent_scales(cache) -> list[float] | None:
    """Each cache layer's k_scale of an FP8 latent cache (None: the latent in the model dtype)."""
    return [k for k, _ in cache.scales] if cache.kv_format else None


def mla_decoder_from_engine(model, slot: int, max_draft: int = 3, max_steps: int = 4096,
                            draft_vocab: int | None = None) -> MlaDecoder:
    """MlaDecoder over a bound engine DeepseekModel's weights (and its first MTP layer, if loaded)."""
    cfg = model.cfg
    sparse = bool(cfg.index_topk)
    mm = _mla_model(model)
    mtp = mm.mtp
    caches = [model.cache.kv[i][slot] for i in range(len(model.cache.kv))]
    index_caches = [model.cache.index_k[i][slot] if i in model.cache.index_k else None for i in range(len(caches))]
    splits = attention_splits(min(caches[0].shape[0], cfg.index_topk) if sparse else caches[0].shape[0])
    return MlaDecoder(mm, caches, model.cos, model.sin, max_draft=max_draft if mtp else 0,
                      max_steps=max_steps, num_splits=splits, draft_vocab=draft_vocab if mtp else None,
                      index_caches=index_caches, kv_scales=_latent_scales(model.cache))
