"""Checkpoint reading: HF safetensors (mapped and fused on the fly) or the engine's own format.

The engine's format is a directory holding the HF ``config.json`` (and ``generation_config.json``),
``expresslane-engine.json`` (format version, dtype, shard list) and safetensors shards whose tensor
names are the engine's parameter names (see :func:`hf_to_engine`), already fused and laid out:

- every family: ``embed``, ``final_norm``, ``lm_head``; per layer ``layers.{i}.attn_norm``,
  ``wo``, ``mlp_norm``, and a dense MLP ``w_gate_up [2*I, H]``, ``w_down [H, I]``
- GQA: ``wqkv [(Hq + 2*Hkv)*D, H]``, ``bqkv`` (qwen2), ``q_norm``/``k_norm`` (qwen3), ``bo``
- MLA: ``wq`` or ``wq_a``/``q_a_norm``/``wq_b``, ``wkv_a``, ``kv_a_norm``, ``w_uk [H, nope, r]``,
  ``w_uv [H, v, r]`` (kv_b_proj split for absorbed attention), with sparse attention the indexer's
  ``idx_wq_b``, ``idx_wk``, ``idx_k_norm`` (+ ``_bias``: a LayerNorm), ``idx_weights``; MoE layers ``router [E, H]``,
  ``router_bias [E]`` (float32), ``experts_gate_up [E, 2*I, H]``, ``experts_down [E, H, I]``,
  ``shared_gate_up``, ``shared_down``; MTP layer j: ``mtp.{j}.enorm``, ``hnorm``, ``eh_proj``,
  ``head_norm``, ``head``, ``embed`` and its block under ``mtp.{j}.block.*``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig, parse_config
from .fp8 import SCALE_SUFFIX, dequantize, is_fp8

ENGINE_MARKER = "expresslane-engine.json"
FORMAT_VERSION = 1

Getter = Callable[[str], torch.Tensor]


class CheckpointReader:
    """Lazy, memory-mapped access to every tensor of a directory of safetensors files."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.model_dir}: pass an HF checkpoint directory")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        return self._where[name].get_tensor(name)

    def names(self) -> list[str]:
        return list(self._where)


class DictReader:
    """The CheckpointReader interface over in-memory HF tensors (an HF model's state_dict)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def names(self) -> list[str]:
        return list(self._tensors)


def read_config(model_dir: str | Path) -> tuple[dict, ModelConfig]:
    """The raw HF config dict and its parsed ModelConfig."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return raw, parse_config(raw)


def is_engine_format(model_dir: str | Path) -> bool:
    return (Path(model_dir) / ENGINE_MARKER).exists()


def _cat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


# A linear weight as read: (weight, float32 scale in the engine's layout or None when unquantized).
Linear = tuple[torch.Tensor, "torch.Tensor | None"]


def _scale(cfg: ModelConfig, r, name: str, w: torch.Tensor) -> torch.Tensor:
    """The engine-layout float32 scale of fp8 weight ``name`` (``<module>.weight``)."""
    spec = cfg.quant
    if spec is None:
        raise ValueError(f"{name} is stored as {w.dtype} but config.json has no quantization_config: "
                         "the checkpoint is incomplete")
    base = name[: -len("weight")]
    sname = next((base + s for s in (spec.scale_suffix, "weight_scale", "weight_scale_inv") if r.has(base + s)), None)
    if sname is None:
        raise KeyError(f"{name} is float8 but {base}{spec.scale_suffix} is missing from the checkpoint")
    s = r.get(sname).float()
    n, k = w.shape[-2], w.shape[-1]
    if spec.strategy == "block":
        bn, bk = spec.block
        want = (*w.shape[:-2], -(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{sname} has shape {tuple(s.shape)}, block {spec.block} of {tuple(w.shape)} needs {want}")
        return s.contiguous()
    if s.numel() == 1:  # per tensor: one scale for every row
        return s.reshape(1).expand(n).contiguous()
    if s.numel() != n:
        raise ValueError(f"{sname} has {s.numel()} scales for {n} output channels")
    return s.reshape(n).contiguous()


def _linear(cfg: ModelConfig, r, name: str) -> Linear:
    w = r.get(name)
    return (w, _scale(cfg, r, name, w)) if is_fp8(w) else (w, None)


def _plain(cfg: ModelConfig, part: Linear) -> torch.Tensor:
    """The weight of ``part`` unquantized: dequantized to float32 when it is FP8."""
    w, s = part
    return w if s is None else dequantize(w, s, cfg.quant.block if s.dim() == w.dim() else None)


def _dense(cfg: ModelConfig, r, name: str) -> torch.Tensor:
    """A weight the engine keeps unquantized (kv_b, the router, embeddings)."""
    return _plain(cfg, _linear(cfg, r, name))


def _fuse(cfg: ModelConfig, out: str, parts: list[Linear], dim: int = 0,
          stack: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine weight ``out`` from parts concatenated (or stacked) on ``dim``, with its scale when
    every part is FP8 and their scales fuse; otherwise the parts dequantized. One part is passed
    through as read (no copy: ties by identity survive)."""
    if len(parts) == 1 and not stack:
        w, s = parts[0]
        yield out, w
        if s is not None:
            yield out + SCALE_SUFFIX, s
        return
    join = torch.stack if stack else torch.cat
    scales = [s for _, s in parts]
    if all(s is not None for s in scales):
        blocked = scales[0].dim() == parts[0][0].dim()
        if stack or not blocked or all(w.shape[dim] % cfg.quant.block[0] == 0 for w, _ in parts[:-1]):
            yield out, join([w for w, _ in parts], dim=dim)
            yield out + SCALE_SUFFIX, join(scales, dim=dim)
            return
    yield out, join([_plain(cfg, p) for p in parts], dim=dim)


def _mlp(cfg: ModelConfig, r, prefix: str, out: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _fuse(cfg, f"{out}w_gate_up", [_linear(cfg, r, f"{prefix}{n}_proj.weight") for n in ("gate", "up")])
    yield from _fuse(cfg, f"{out}w_down", [_linear(cfg, r, f"{prefix}down_proj.weight")])


def _gqa_layer(cfg: ModelConfig, r: CheckpointReader, p: str, o: str) -> Iterator[tuple[str, torch.Tensor]]:
    a = f"{p}self_attn."
    yield f"{o}attn_norm", r.get(f"{p}input_layernorm.weight")
    yield from _fuse(cfg, f"{o}wqkv", [_linear(cfg, r, f"{a}{n}_proj.weight") for n in "qkv"])
    if cfg.qkv_bias:
        yield f"{o}bqkv", _cat(*(r.get(f"{a}{n}_proj.bias") for n in "qkv"))
    if cfg.qk_norm:
        yield f"{o}q_norm", r.get(f"{a}q_norm.weight")
        yield f"{o}k_norm", r.get(f"{a}k_norm.weight")
    yield from _fuse(cfg, f"{o}wo", [_linear(cfg, r, f"{a}o_proj.weight")])
    if cfg.o_bias:
        yield f"{o}bo", r.get(f"{a}o_proj.bias")
    yield f"{o}mlp_norm", r.get(f"{p}post_attention_layernorm.weight")
    yield from _mlp(cfg, r, f"{p}mlp.", o)


def _experts(cfg: ModelConfig, r: CheckpointReader, m: str, o: str) -> Iterator[tuple[str, torch.Tensor]]:
    if r.has(f"{m}experts.gate_up_proj"):  # transformers' fused 3-D layout (never quantized)
        yield f"{o}experts_gate_up", r.get(f"{m}experts.gate_up_proj")
        yield f"{o}experts_down", r.get(f"{m}experts.down_proj")
        return
    gate_up, down = [], []
    for e in range(cfg.num_experts):
        parts = [_linear(cfg, r, f"{m}experts.{e}.{n}_proj.weight") for n in ("gate", "up")]
        fused = dict(_fuse(cfg, "w", parts))
        gate_up.append((fused["w"], fused.get("w" + SCALE_SUFFIX)))
        down.append(_linear(cfg, r, f"{m}experts.{e}.down_proj.weight"))
    yield from _fuse(cfg, f"{o}experts_gate_up", gate_up, stack=True)
    yield from _fuse(cfg, f"{o}experts_down", down, stack=True)


def _mla_layer(cfg: ModelConfig, r: CheckpointReader, idx: int, p: str, o: str) -> Iterator[tuple[str, torch.Tensor]]:
    a = f"{p}self_attn."
    yield f"{o}attn_norm", r.get(f"{p}input_layernorm.weight")
    if cfg.q_lora_rank:
        yield from _fuse(cfg, f"{o}wq_a", [_linear(cfg, r, f"{a}q_a_proj.weight")])
        yield f"{o}q_a_norm", r.get(f"{a}q_a_layernorm.weight")
        yield from _fuse(cfg, f"{o}wq_b", [_linear(cfg, r, f"{a}q_b_proj.weight")])
    else:
        yield from _fuse(cfg, f"{o}wq", [_linear(cfg, r, f"{a}q_proj.weight")])
    yield from _fuse(cfg, f"{o}wkv_a", [_linear(cfg, r, f"{a}kv_a_proj_with_mqa.weight")])
    yield f"{o}kv_a_norm", r.get(f"{a}kv_a_layernorm.weight")
    kv_b = _dense(cfg, r, f"{a}kv_b_proj.weight").view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    yield f"{o}w_uk", kv_b[:, : cfg.qk_nope_head_dim].contiguous()
    yield f"{o}w_uv", kv_b[:, cfg.qk_nope_head_dim :].contiguous()
    yield from _fuse(cfg, f"{o}wo", [_linear(cfg, r, f"{a}o_proj.weight")])
    if cfg.has_indexer(idx):  # the sparse-attention indexer
        x = f"{a}indexer."
        yield f"{o}idx_wq_b", _dense(cfg, r, f"{x}wq_b.weight")
        yield f"{o}idx_wk", _dense(cfg, r, f"{x}wk.weight")
        yield f"{o}idx_k_norm", r.get(f"{x}k_norm.weight")
        yield f"{o}idx_k_norm_bias", r.get(f"{x}k_norm.bias")
        yield f"{o}idx_weights", _dense(cfg, r, f"{x}weights_proj.weight")
    yield f"{o}mlp_norm", r.get(f"{p}post_attention_layernorm.weight")
    m = f"{p}mlp."
    if is_moe_layer(cfg, idx):
        yield f"{o}router", _dense(cfg, r, f"{m}gate.weight")
        yield f"{o}router_bias", r.get(f"{m}gate.e_score_correction_bias").float()
        yield from _experts(cfg, r, m, o)
        if cfg.num_shared_experts:
            for name, t in _mlp(cfg, r, f"{m}shared_experts.", o):
                yield name.replace(f"{o}w_", f"{o}shared_"), t
    else:
        yield from _mlp(cfg, r, m, o)


def is_moe_layer(cfg: ModelConfig, idx: int) -> bool:
    """Layer idx (MTP layers continue the numbering) routes through experts."""
    return cfg.num_experts > 0 and idx >= cfg.first_k_dense_replace


def has_mtp_weights(cfg: ModelConfig, r: CheckpointReader) -> bool:
    return cfg.num_mtp_layers > 0 and r.has(f"model.layers.{cfg.num_layers}.eh_proj.weight")


def hf_to_engine(cfg: ModelConfig, r: CheckpointReader | DictReader) -> Iterator[tuple[str, torch.Tensor]]:
    """Every engine parameter (name, tensor in the checkpoint dtype) of an HF checkpoint, in order."""
    embed = _dense(cfg, r, "model.embed_tokens.weight")
    yield "embed", embed
    untied = r.has("lm_head.weight") and not cfg.tie_word_embeddings
    lm_head = _linear(cfg, r, "lm_head.weight") if untied else (embed, None)
    for i in range(cfg.num_layers):
        if cfg.family == "gqa":
            yield from _gqa_layer(cfg, r, f"model.layers.{i}.", f"layers.{i}.")
        else:
            yield from _mla_layer(cfg, r, i, f"model.layers.{i}.", f"layers.{i}.")
    yield "final_norm", r.get("model.norm.weight")
    yield from _fuse(cfg, "lm_head", [lm_head])
    if cfg.family == "mla" and has_mtp_weights(cfg, r):
        for j in range(cfg.num_mtp_layers):
            idx = cfg.num_layers + j
            p, o = f"model.layers.{idx}.", f"mtp.{j}."
            yield f"{o}enorm", r.get(f"{p}enorm.weight")
            yield f"{o}hnorm", r.get(f"{p}hnorm.weight")
            yield from _fuse(cfg, f"{o}eh_proj", [_linear(cfg, r, f"{p}eh_proj.weight")])
            yield f"{o}head_norm", r.get(f"{p}shared_head.norm.weight")
            head = f"{p}shared_head.head.weight"
            yield from _fuse(cfg, f"{o}head", [_linear(cfg, r, head) if r.has(head) else lm_head])
            yield f"{o}embed", _dense(cfg, r, f"{p}embed_tokens.weight") if r.has(f"{p}embed_tokens.weight") else embed
            yield from _mla_layer(cfg, r, idx, p, f"{o}block.")


PROGRESS_MIN_BYTES = 1 << 30  # checkpoints from this size show a loading progress bar


def iter_engine_params(model_dir: str | Path, cfg: ModelConfig,
                       progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of either checkpoint kind, names in the engine's vocabulary; ``progress``
    (default: checkpoints of PROGRESS_MIN_BYTES and more) shows a bar of the bytes read on stderr."""
    r = CheckpointReader(model_dir)
    total = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    params = ((n, r.get(n)) for n in r.names()) if is_engine_format(model_dir) else hf_to_engine(cfg, r)
    if not (total >= PROGRESS_MIN_BYTES if progress is None else progress):
        yield from params
        return
    from tqdm import tqdm

    seen: set[int] = set()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(model_dir).name}", mininterval=2.0) as bar:
        for name, t in params:
            if id(t) not in seen:  # fused and dequantized tensors only approximate the file bytes
                seen.add(id(t))
                bar.update(min(t.numel() * t.element_size(), total - bar.n))
            yield name, t
        bar.update(total - bar.n)
