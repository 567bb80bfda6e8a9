"""Checkpoint reading: HF safetensors (mapped and fused on the fly) or the engine's own format.

The engine's format is a directory holding the HF ``config.json`` (and ``generation_config.json``),
``expresslane-engine.json`` (format version, dtype, shard list) and safetensors shards whose tensor
names are the engine's parameter names (see :func:`hf_to_engine`), already fused and laid out:

- every family: ``embed``, ``final_norm``, ``lm_head``; per layer ``layers.{i}.attn_norm``,
  ``wo``, ``mlp_norm``, and a dense MLP ``w_gate_up [2*I, H]``, ``w_down [H, I]``
- GQA: ``wqkv [(Hq + 2*Hkv)*D, H]``, ``bqkv`` (qwen2), ``q_norm``/``k_norm`` (qwen3), ``bo``
- MLA: ``wq`` or ``wq_a``/``q_a_norm``/``wq_b``, ``wkv_a``, ``kv_a_norm``, ``w_uk [H, nope, r]``,
  ``w_uv [H, v, r]`` (kv_b_proj split for absorbed attention); MoE layers ``router [E, H]``,
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


def _mlp(get: Getter, prefix: str, out: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{out}w_gate_up", _cat(get(f"{prefix}gate_proj.weight"), get(f"{prefix}up_proj.weight"))
    yield f"{out}w_down", get(f"{prefix}down_proj.weight")


def _gqa_layer(cfg: ModelConfig, r: CheckpointReader, p: str, o: str) -> Iterator[tuple[str, torch.Tensor]]:
    a = f"{p}self_attn."
    yield f"{o}attn_norm", r.get(f"{p}input_layernorm.weight")
    yield f"{o}wqkv", _cat(*(r.get(f"{a}{n}_proj.weight") for n in "qkv"))
    if cfg.qkv_bias:
        yield f"{o}bqkv", _cat(*(r.get(f"{a}{n}_proj.bias") for n in "qkv"))
    if cfg.qk_norm:
        yield f"{o}q_norm", r.get(f"{a}q_norm.weight")
        yield f"{o}k_norm", r.get(f"{a}k_norm.weight")
    yield f"{o}wo", r.get(f"{a}o_proj.weight")
    if cfg.o_bias:
        yield f"{o}bo", r.get(f"{a}o_proj.bias")
    yield f"{o}mlp_norm", r.get(f"{p}post_attention_layernorm.weight")
    yield from _mlp(r.get, f"{p}mlp.", o)


def _experts(cfg: ModelConfig, r: CheckpointReader, m: str) -> tuple[torch.Tensor, torch.Tensor]:
    if r.has(f"{m}experts.gate_up_proj"):  # transformers' fused 3-D layout
        return r.get(f"{m}experts.gate_up_proj"), r.get(f"{m}experts.down_proj")
    gate_up = torch.stack([_cat(r.get(f"{m}experts.{e}.gate_proj.weight"), r.get(f"{m}experts.{e}.up_proj.weight"))
                           for e in range(cfg.num_experts)])
    down = torch.stack([r.get(f"{m}experts.{e}.down_proj.weight") for e in range(cfg.num_experts)])
    return gate_up, down


def _mla_layer(cfg: ModelConfig, r: CheckpointReader, idx: int, p: str, o: str) -> Iterator[tuple[str, torch.Tensor]]:
    a = f"{p}self_attn."
    yield f"{o}attn_norm", r.get(f"{p}input_layernorm.weight")
    if cfg.q_lora_rank:
        yield f"{o}wq_a", r.get(f"{a}q_a_proj.weight")
        yield f"{o}q_a_norm", r.get(f"{a}q_a_layernorm.weight")
        yield f"{o}wq_b", r.get(f"{a}q_b_proj.weight")
    else:
        yield f"{o}wq", r.get(f"{a}q_proj.weight")
    yield f"{o}wkv_a", r.get(f"{a}kv_a_proj_with_mqa.weight")
    yield f"{o}kv_a_norm", r.get(f"{a}kv_a_layernorm.weight")
    kv_b = r.get(f"{a}kv_b_proj.weight").view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    yield f"{o}w_uk", kv_b[:, : cfg.qk_nope_head_dim].contiguous()
    yield f"{o}w_uv", kv_b[:, cfg.qk_nope_head_dim :].contiguous()
    yield f"{o}wo", r.get(f"{a}o_proj.weight")
    yield f"{o}mlp_norm", r.get(f"{p}post_attention_layernorm.weight")
    m = f"{p}mlp."
    if is_moe_layer(cfg, idx):
        yield f"{o}router", r.get(f"{m}gate.weight")
        yield f"{o}router_bias", r.get(f"{m}gate.e_score_correction_bias").float()
        gate_up, down = _experts(cfg, r, m)
        yield f"{o}experts_gate_up", gate_up
        yield f"{o}experts_down", down
        if cfg.num_shared_experts:
            for name, t in _mlp(r.get, f"{m}shared_experts.", o):
                yield name.replace(f"{o}w_", f"{o}shared_"), t
    else:
        yield from _mlp(r.get, m, o)


def is_moe_layer(cfg: ModelConfig, idx: int) -> bool:
    """Layer idx (MTP layers continue the numbering) routes through experts."""
    return cfg.num_experts > 0 and idx >= cfg.first_k_dense_replace


def has_mtp_weights(cfg: ModelConfig, r: CheckpointReader) -> bool:
    return cfg.num_mtp_layers > 0 and r.has(f"model.layers.{cfg.num_layers}.eh_proj.weight")


def hf_to_engine(cfg: ModelConfig, r: CheckpointReader | DictReader) -> Iterator[tuple[str, torch.Tensor]]:
    """Every engine parameter (name, tensor in the checkpoint dtype) of an HF checkpoint, in order."""
    embed = r.get("model.embed_tokens.weight")
    yield "embed", embed
    lm_head = r.get("lm_head.weight") if r.has("lm_head.weight") and not cfg.tie_word_embeddings else embed
    for i in range(cfg.num_layers):
        if cfg.family == "gqa":
            yield from _gqa_layer(cfg, r, f"model.layers.{i}.", f"layers.{i}.")
        else:
            yield from _mla_layer(cfg, r, i, f"model.layers.{i}.", f"layers.{i}.")
    yield "final_norm", r.get("model.norm.weight")
    yield "lm_head", lm_head
    if cfg.family == "mla" and has_mtp_weights(cfg, r):
        for j in range(cfg.num_mtp_layers):
            idx = cfg.num_layers + j
            p, o = f"model.layers.{idx}.", f"mtp.{j}."
            yield f"{o}enorm", r.get(f"{p}enorm.weight")
            yield f"{o}hnorm", r.get(f"{p}hnorm.weight")
            yield f"{o}eh_proj", r.get(f"{p}eh_proj.weight")
            yield f"{o}head_norm", r.get(f"{p}shared_head.norm.weight")
            yield f"{o}head", r.get(f"{p}shared_head.head.weight") if r.has(f"{p}shared_head.head.weight") else lm_head
            yield f"{o}embed", r.get(f"{p}embed_tokens.weight") if r.has(f"{p}embed_tokens.weight") else embed
            yield from _mla_layer(cfg, r, idx, p, f"{o}block.")


def iter_engine_params(model_dir: str | Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of either checkpoint kind, names in the engine's vocabulary."""
    r = CheckpointReader(model_dir)
    if is_engine_format(model_dir):
        for name in r.names():
            yield name, r.get(name)
    else:
        yield from hf_to_engine(cfg, r)
