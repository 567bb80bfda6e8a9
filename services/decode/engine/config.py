"""Model configuration of the decode engine, parsed once from an HF ``config.json`` dict.

Pure: no torch. One frozen dataclass covers both families (``family`` is "gqa" or "mla"); fields of
the other family keep their zero defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.kvlayout import DSA_TYPES, dsa_indexer_layers

from .quant import QuantSpec, parse_quant

GQA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MLA_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # the last two: DeepSeek Sparse Attention


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: str  # "gqa" | "mla"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the type's parameters
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    # gqa
    num_kv_heads: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Mistral's sliding-window attention (None: full attention); the engine attends to the whole
    # context, which is the same as the window only up to its length (Engine caps max_seq_len)
    sliding_window: int | None = None
    # mla
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa): each query attends to the index_topk cached
    # tokens its lightning indexer (index_n_heads heads of index_head_dim, one key per token) scores
    # highest; 0: dense attention. index_layers: the layers, MTP layers included, with their own
    # indexer (GLM's other main layers reuse the choice of the last one before them); GLM ropes its
    # indexer interleaved, DeepSeek-V3.2 half-split
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_layers: tuple[int, ...] = ()
    index_rope_interleave: bool = False
    # moe
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    num_mtp_layers: int = 0
    quant: QuantSpec | None = None  # FP8 weights (quant.py); None: the checkpoint's dtype throughout
    extra: dict[str, Any] = field(default_factory=dict)

    def has_indexer(self, layer: int) -> bool:
        """Layer ``layer`` (MTP layers continue the numbering) runs its own sparse-attention indexer."""
        return layer in self.index_layers

    @property
    def num_cache_layers(self) -> int:
        """Layers with a KV cache: main layers, then MTP layers."""
        return self.num_layers + self.num_mtp_layers


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ("default", "llama3", "yarn", "linear"):
        raise ValueError(f"rope_type {rope_type!r} is not supported: use default, linear, llama3 or yarn")
    return params


def _eos(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_config(config: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from an HF config dict; raises ValueError for unsupported models."""
    model_type = config.get("model_type", "")
    num_heads = int(config["num_attention_heads"])
    common = dict(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        eos_token_ids=_eos(config),
        quant=parse_quant(config),
    )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported: only silu")
    if config.get("mlp_bias") or config.get("use_sliding_window"):
        raise ValueError("MLP biases and sliding-window attention are not supported by the decode engine")
    if model_type in GQA_TYPES:
        head_dim = config.get("head_dim") or common["hidden_size"] // num_heads
        return ModelConfig(
            family="gqa",
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            # as HF's code reads attention_bias: Qwen2 always has q/k/v biases and no o bias,
            # Llama and Qwen3 put it on q, k, v and o, Mistral has none
            qkv_bias=model_type == "qwen2" or (model_type != "mistral" and bool(config.get("attention_bias", False))),
            o_bias=model_type in ("llama", "qwen3") and bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(config["sliding_window"]) if model_type == "mistral" and config.get("sliding_window") else None,
            **common,
        )
    if model_type in MLA_TYPES:
        if config.get("attention_bias"):
            raise ValueError("attention biases are not supported for deepseek_v3")
        if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError("only the noaux_tc top-k method with sigmoid scoring is supported")
        q_lora_rank = config.get("q_lora_rank")
        dsa = model_type in DSA_TYPES
        if dsa and not q_lora_rank:
            raise ValueError(f"{model_type} without q_lora_rank: its indexer reads the q LoRA's output")
        if dsa and config.get("mlp_layer_types") and [t == "dense" for t in config["mlp_layer_types"]] != [
                i < int(config.get("first_k_dense_replace", 0)) for i in range(int(config["num_hidden_layers"]))]:
            raise ValueError("mlp_layer_types other than first_k_dense_replace dense layers then MoE are not supported")
        num_layers = int(config["num_hidden_layers"])
        index_layers = dsa_indexer_layers(config, num_layers + int(config.get("num_nextn_predict_layers", 0) or 0))
        if dsa and 0 not in index_layers:
            raise ValueError(f"{model_type}: layer 0 is marked to share the indexer of an earlier layer, and "
                             "there is none; its indexer_types (or index_topk_pattern / index_topk_freq / "
                             "index_skip_topk_offset) must make layer 0 'full'")
        return ModelConfig(
            index_topk=int(config.get("index_topk", 2048)) if dsa else 0,
            index_n_heads=(int(config.get("index_n_heads", 64 if model_type == "deepseek_v32" else 32))
                           if dsa else 0),
            index_head_dim=int(config.get("index_head_dim", 128)) if dsa else 0,
            index_layers=index_layers,
            index_rope_interleave=model_type == "glm_moe_dsa",
            family="mla",
            q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            rope_interleave=bool(config.get("rope_interleave", True)),
            num_experts=int(config.get("n_routed_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            num_shared_experts=int(config.get("n_shared_experts") or 0),
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(config.get("first_k_dense_replace", 0)),
            num_mtp_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
            **common,
        )
    raise ValueError(
        f"model_type {model_type!r} is not supported by the decode engine: use llama, qwen2, qwen3, "
        "mistral, deepseek_v3, deepseek_v32 or glm_moe_dsa"
    )
