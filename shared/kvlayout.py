"""The decode engine's native KV layout: the one contract between prefill senders and decode slots.

A decode node owns one receive buffer per slot; that buffer *is* the slot's KV cache (no copy on
inject). Its layout, version ``LAYOUT_VERSION``:

- GQA (Llama, Qwen2, Qwen3): for each attention layer ``l`` two regions, K then V, each
  ``[max_tokens, num_kv_heads, head_dim]`` contiguous, in the layout's ``dtype``: the model dtype,
  or an FP8 format (``fp8_e4m3`` | ``fp8_e5m2``, one byte per element) holding the bytes vLLM's FP8
  KV cache holds (``x / scale`` per layer with vLLM's k_scale/v_scale, truncated toward zero:
  services/decode/engine/kvquant.py). Keys are stored after rotary embedding (and after q/k norm
  where the model has it), exactly what attention consumes.
- MLA (DeepSeek-V3 family): for each attention layer one region ``[max_tokens, kv_lora_rank +
  qk_rope_head_dim]``: the normalized compressed latent (after ``kv_a_layernorm``) followed by the
  roped shared key ``k_pe``. ``k_pe`` is kept in HF transformers' rope order (the rotated even
  elements, then the rotated odd ones), not vLLM's interleaved order: prefill adapters permute.
  MTP layers follow the main layers as further layers. With DeepSeek Sparse Attention (deepseek_v32,
  glm_moe_dsa) the latent region of each layer that runs its own indexer is followed by the
  indexer's key region ``index_k`` ``[max_tokens, index_head_dim]`` (after the indexer's LayerNorm
  and rope, as its scores read it); GLM's "shared" layers reuse an earlier layer's choice and keep none.
- A slot holds ``max_seq_len + num_speculative_tokens`` tokens, so drafts fit at the end.
- Tensor parallelism: a node (or a prefill) over ``tp_size`` ranks keeps one slot image per rank.
  GQA: rank ``r`` holds KV heads ``[r * H / tp_size, (r + 1) * H / tp_size)`` of the model's ``H``
  (its layout's ``kv_head_start`` / ``kv_heads`` / ``kv_heads_total``), so its regions are
  ``[max_tokens, H / tp_size, head_dim]``. MLA: the latent is not split by heads; every rank holds
  all of it. A writer holding one set of heads writes each reader the heads both hold
  (:func:`tp_write_ops`): one write per segment where both hold the same heads, one per token
  where either side holds part of the other's token row. A writer holding more heads than a
  reader (prefill TP < decode TP) stages an image of the reader's heads to write it whole
  (:func:`staged_layout`); a writer holding fewer (prefill TP > decode TP) writes per token.

Regions follow each other in layer order, K before V, with no padding. A writer that holds
``n`` tokens of state writes, for every segment, the bytes ``[0, n * bytes_per_token)`` at
``base + offset_bytes`` (token stride equals bytes per token in this version).

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.events import KvLayoutSpec, KvSegment

LAYOUT_VERSION = 1

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # the layout names of vLLM's FP8 KV cache formats
# MLA's: vLLM's CUDA MLA backends keep an FP8 latent as E4M3 only ([latent, k_pe] / k_scale, one byte each)
MLA_FP8_DTYPES = ("fp8_e4m3",)


def kv_dtype_for_cache(cache_dtype: str, model_dtype: str) -> str:
    """The layout dtype of a KV cache vLLM runs with ``--kv-cache-dtype cache_dtype`` (auto: the
    model dtype; fp8 is E4M3): what a prefill stages and a decode node must keep to pair."""
    names = {"auto": model_dtype, "float16": "float16", "bfloat16": "bfloat16",
             "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
    if cache_dtype not in names:
        raise ValueError(f"kv cache dtype {cache_dtype!r} has no expresslane layout: use one of {', '.join(names)}")
    return names[cache_dtype]


def kv_cache_dtype_flag(dtype: str) -> str:
    """The ``--kv-cache-dtype`` value (vLLM's and the decode node's) that keeps KV in layout ``dtype``."""
    return dtype if dtype in FP8_DTYPES else "auto"


def kv_cache_dtypes_pair(cache_dtype: str, layout: KvLayoutSpec) -> bool:
    """Whether a prefill vLLM run with ``--kv-cache-dtype cache_dtype`` stages KV a slot of ``layout``
    keeps. FP8 caches are handed over as their bytes, so the FP8 format must be the slot's, and
    auto pairs with any model dtype (the sender compares those); a cache dtype without an
    expresslane layout pairs with nothing. Sparse-attention MLA (index-key segments): the prefill
    adapters dequantize vLLM's fp8_ds_mla latent into the slot's model dtype, so every cache dtype pairs."""
    if layout.kind == "mla" and any(s.name == "index_k" for s in layout.segments):
        return True
    if cache_dtype == "auto":  # the model dtype, which the sender compares
        return layout.dtype not in FP8_DTYPES
    try:
        return kv_dtype_for_cache(cache_dtype, "") == layout.dtype
    except ValueError:
        return False


@dataclass(frozen=True)
class KvShape:
    """The per-token KV shape of one model, independent of where it lives."""

    kind: Literal["gqa", "mla"]
    num_layers: int  # layers with a cache, MTP layers included
    num_kv_heads: int = 0  # gqa
    head_dim: int = 0  # gqa
    kv_lora_rank: int = 0  # mla
    qk_rope_head_dim: int = 0  # mla
    index_head_dim: int = 0  # mla with sparse attention: the indexer's key per token (0: none)
    index_layers: tuple[int, ...] = ()  # the layers (MTP included) that keep indexer keys

    @property
    def elems_per_token_per_layer(self) -> int:
        """Elements per token per layer, K and V together (GQA) or latent + rope (MLA; indexer keys aside)."""
        if self.kind == "gqa":
            return 2 * self.num_kv_heads * self.head_dim
        return self.kv_lora_rank + self.qk_rope_head_dim


DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


def dsa_indexer_layers(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers (of ``num_layers``: the main layers, then MTP layers) that run their own
    sparse-attention indexer (none without DSA): every layer of deepseek_v32; of glm_moe_dsa's main
    layers those its ``indexer_types`` call "full" (or the schedule HF derives when absent:
    ``index_topk_pattern``, else ``index_topk_freq`` / ``index_skip_topk_offset``); every MTP layer."""
    if config.get("model_type") not in DSA_TYPES:
        return ()
    n = int(config["num_hidden_layers"])
    mtp = tuple(range(n, num_layers))
    types = config.get("indexer_types")
    if types is None and config.get("model_type") == "glm_moe_dsa":
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(int(config.get("index_topk_freq", 1)), 1), int(config.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if types is None:
        return tuple(range(n)) + mtp
    return tuple(i for i, t in enumerate(types[:n]) if t == "full") + mtp


def kv_shape_from_hf_config(config: dict[str, Any], include_mtp: bool = True) -> KvShape:
    """Derive the KV shape from an HF ``config.json`` dict (llama, qwen2, qwen3, deepseek_v3)."""
    model_type = config.get("model_type", "")
    num_layers = int(config["num_hidden_layers"])
    if model_type in ("deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa"):
        if include_mtp:
            num_layers += int(config.get("num_nextn_predict_layers", 0) or 0)
        return KvShape(
            kind="mla",
            num_layers=num_layers,
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            index_head_dim=int(config.get("index_head_dim", 128)) if model_type in DSA_TYPES else 0,
            index_layers=dsa_indexer_layers(config, num_layers),
        )
    if model_type in ("llama", "qwen2", "qwen3", "mistral"):
        num_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // num_heads
        return KvShape(
            kind="gqa",
            num_layers=num_layers,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
        )
    raise ValueError(
        f"model_type {model_type!r} has no expresslane KV layout: supported are llama, qwen2, "
        "qwen3 and deepseek_v3"
    )


def tp_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, KV heads) rank ``tp_rank`` of ``tp_size`` holds of ``num_kv_heads``."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} does not exist")
    if num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks: "
                         f"use a --tensor-parallel-size that divides {num_kv_heads}")
    n = num_kv_heads // tp_size
    return tp_rank * n, n


def layout_spec(shape: KvShape, dtype: str, max_tokens: int, tp_size: int = 1, tp_rank: int = 0) -> KvLayoutSpec:
    """The native layout of one slot holding up to ``max_tokens`` tokens (of rank ``tp_rank`` of
    ``tp_size``: its share of the KV heads for GQA, the whole latent for MLA)."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype!r} not supported: use one of {sorted(DTYPE_SIZES)}")
    if dtype in FP8_DTYPES and shape.kind == "mla" and (dtype not in MLA_FP8_DTYPES or shape.index_layers):
        raise ValueError(f"an {dtype} MLA latent layout is built for dense MLA in fp8_e4m3 only (sparse attention "
                         "keeps its latent in the model dtype: the prefill dequantizes vLLM's fp8_ds_mla)")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    elt = DTYPE_SIZES[dtype]
    segments: list[KvSegment] = []
    offset = 0
    head_start = heads = heads_total = 0
    if shape.kind == "gqa":
        head_start, heads = tp_heads(shape.num_kv_heads, tp_size, tp_rank)
        heads_total = shape.num_kv_heads
        per_token = heads * shape.head_dim * elt
        regions = [("k", per_token), ("v", per_token)]
    else:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} does not exist")
        regions = [("kv_latent", (shape.kv_lora_rank + shape.qk_rope_head_dim) * elt)]
    index_k = ("index_k", shape.index_head_dim * elt)
    for layer in range(shape.num_layers):
        for name, per_token in regions + ([index_k] if layer in shape.index_layers else []):
            segments.append(
                KvSegment(
                    layer=layer,
                    name=name,
                    offset_bytes=offset,
                    token_stride_bytes=per_token,
                    bytes_per_token=per_token,
                )
            )
            offset += per_token * max_tokens
    return KvLayoutSpec(
        layout_version=LAYOUT_VERSION,
        kind=shape.kind,
        dtype=dtype,
        num_layers=shape.num_layers,
        max_tokens=max_tokens,
        slot_nbytes=offset,
        segments=segments,
        tp_size=tp_size,
        tp_rank=tp_rank,
        kv_head_start=head_start,
        kv_heads=heads,
        kv_heads_total=heads_total,
    )


def staged_layout(ours: KvLayoutSpec, theirs: KvLayoutSpec) -> KvLayoutSpec | None:
    """The layout a writer of ``ours`` stages for a reader of ``theirs`` so that its writes are one
    per segment: ``theirs``'s heads and segments at ``ours``'s token capacity (offsets packed as
    layout_spec packs them), when the writer holds every head the reader holds and more; None when
    it should write from its own image (the same heads, MLA, or fewer heads than the reader)."""
    if ours.kind != "gqa" or not ours.kv_heads or not theirs.kv_heads:
        return None
    s0, s1 = held_heads(ours)
    d0, d1 = held_heads(theirs)
    if (s0, s1) == (d0, d1) or not (s0 <= d0 and d1 <= s1):
        return None
    segments, offset = [], 0
    for seg in theirs.segments:
        segments.append(KvSegment(layer=seg.layer, name=seg.name, offset_bytes=offset,
                                  token_stride_bytes=seg.bytes_per_token, bytes_per_token=seg.bytes_per_token))
        offset += seg.bytes_per_token * ours.max_tokens
    return KvLayoutSpec(layout_version=ours.layout_version, kind=ours.kind, dtype=ours.dtype,
                        num_layers=ours.num_layers, max_tokens=ours.max_tokens, slot_nbytes=offset,
                        segments=segments, tp_size=theirs.tp_size, tp_rank=theirs.tp_rank,
                        kv_head_start=theirs.kv_head_start, kv_heads=theirs.kv_heads,
                        kv_heads_total=theirs.kv_heads_total)


def held_heads(spec: KvLayoutSpec) -> tuple[int, int]:
    """[first, end) of the KV heads a GQA layout's tokens hold (an older peer's: all, from 0)."""
    if spec.kv_heads:
        return spec.kv_head_start, spec.kv_head_start + spec.kv_heads
    return 0, spec.kv_heads_total or 0  # (0, 0): not described; the segments hold every head


def tp_mismatch(ours: KvLayoutSpec, theirs: KvLayoutSpec) -> str:
    """Why a writer of layout ``ours`` cannot fill a slot of layout ``theirs`` head by head ("" when
    it can): both must describe the same model's heads, or one rank each of the same head set."""
    if ours.kind != "gqa":
        return ""
    if (ours.tp_size, theirs.tp_size) == (1, 1) and not (ours.kv_heads and theirs.kv_heads):
        return ""
    if ours.kv_heads_total != theirs.kv_heads_total or not ours.kv_heads or not theirs.kv_heads:
        return (f"layout mismatch: prefill stages {ours.kv_heads or '?'} of {ours.kv_heads_total or '?'} KV heads "
                f"(tensor-parallel rank {ours.tp_rank} of {ours.tp_size}), decode slot holds {theirs.kv_heads or '?'} "
                f"of {theirs.kv_heads_total or '?'} (rank {theirs.tp_rank} of {theirs.tp_size}): a peer too old to "
                "describe its tensor-parallel split, or a different model")
    return ""


def tp_write_ops(ours: KvLayoutSpec, local_base: int, theirs: KvLayoutSpec, remote_base: int,
                 num_tokens: int) -> list[tuple[int, int, int]]:
    """(local, remote, nbytes) writes that move the first ``num_tokens`` tokens of the KV both
    layouts hold from a slot image of ``ours`` at ``local_base`` into one of ``theirs`` at
    ``remote_base``. Segments pair in order (an MLA writer's extra MTP layers are not written).
    GQA: the heads both hold; contiguous runs merge, so equal head sets are one write per segment.
    MLA: every rank holds the whole latent, so only the writer of rank 0 writes (the others: [])."""
    if ours.kind == "mla":
        if ours.tp_rank != 0:
            return []
        return [(local_base + a.offset_bytes, remote_base + b.offset_bytes, num_tokens * a.bytes_per_token)
                for a, b in zip(ours.segments, theirs.segments)]
    s0, s1 = held_heads(ours)
    d0, d1 = held_heads(theirs)
    if not theirs.kv_heads:  # an older peer, one rank: it holds every head
        d0, d1 = 0, ours.kv_heads_total or s1
    if not ours.kv_heads:
        s0, s1 = 0, theirs.kv_heads_total or d1
    if (s0, s1) == (d0, d1):  # the same heads (one rank each side, or equal splits)
        return [(local_base + a.offset_bytes, remote_base + b.offset_bytes, num_tokens * a.bytes_per_token)
                for a, b in zip(ours.segments, theirs.segments)]
    lo, hi = max(s0, d0), min(s1, d1)
    if lo >= hi:
        return []
    ops: list[tuple[int, int, int]] = []
    for a, b in zip(ours.segments, theirs.segments):
        head_bytes = a.bytes_per_token // (s1 - s0)
        nbytes = (hi - lo) * head_bytes
        src = local_base + a.offset_bytes + (lo - s0) * head_bytes
        dst = remote_base + b.offset_bytes + (lo - d0) * head_bytes
        if nbytes == a.bytes_per_token == b.bytes_per_token:  # whole rows on both sides: one run
            ops.append((src, dst, num_tokens * nbytes))
            continue
        ops.extend((src + t * a.token_stride_bytes, dst + t * b.token_stride_bytes, nbytes)
                   for t in range(num_tokens))
    return ops


def write_ranges(spec: KvLayoutSpec, num_tokens: int) -> list[tuple[int, int]]:
    """(offset_bytes, nbytes) of every region a writer of ``num_tokens`` tokens fills."""
    if not 0 < num_tokens <= spec.max_tokens:
        raise ValueError(
            f"{num_tokens} tokens do not fit a slot of {spec.max_tokens}: "
            "raise the decode node's --max-seq-len or shorten the prompt"
        )
    return [(s.offset_bytes, num_tokens * s.bytes_per_token) for s in spec.segments]
