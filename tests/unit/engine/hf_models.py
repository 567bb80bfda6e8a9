"""Tiny HF checkpoints with seeded random weights, built with transformers' own config classes.

Used by the engine's unit tests; ``save_checkpoint`` writes a real safetensors directory.
DeepSeek-V3 checkpoints get an MTP layer (``model.layers.{L}.*`` as in the released checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ARCHS = ("llama", "llama3_rope", "qwen2", "qwen3", "deepseek_v3", "deepseek_v3_yarn", "deepseek_v32", "glm_moe_dsa")
MLA_ARCHS = ("deepseek_v3", "glm_moe_dsa")  # prefixes: MLA, MoE, an MTP layer
DSA_ARCHS = ("deepseek_v32", "glm_moe_dsa")
VOCAB = 256


def make_config(arch: str, **overrides):
    """``arch``'s tiny config; ``overrides``: config fields set on top of it (e.g. a smaller hidden size)."""
    cfg = _make_config(arch)
    return type(cfg).from_dict({**cfg.to_dict(), **overrides}) if overrides else cfg


def _make_config(arch: str):
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)
    if arch == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **small)
    if arch == "llama3_rope":
        return tf.LlamaConfig(num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, **small)
    if arch == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **small)
    if arch == "qwen3":
        return tf.Qwen3Config(num_key_value_heads=2, head_dim=32, **small)
    if arch.startswith(MLA_ARCHS):
        extra = {}
        if arch in DSA_ARCHS:  # sparse attention: 8 of the tokens seen, fewer than the test prompts
            extra.update(index_topk=8, index_n_heads=8, index_head_dim=32)
        if arch == "glm_moe_dsa":  # layer 1 reuses layer 0's choice
            extra.update(indexer_types=["full", "shared"])
        if arch.endswith("yarn"):
            extra["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64, "beta_fast": 32,
                                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        if arch.endswith("lite"):  # DeepSeek-V2-Lite-like: no q LoRA, one routing group
            extra.update(q_lora_rank=None, n_group=1, topk_group=1)
        params = dict(moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                      q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                      routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1)
        kind = {"deepseek_v32": tf.DeepseekV32Config, "glm_moe_dsa": tf.GlmMoeDsaConfig}.get(arch,
                                                                                             tf.DeepseekV3Config)
        return kind(**{**params, **small, **extra})
    raise ValueError(arch)


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def _damp_blocks(model) -> None:
    """Shrink attention and MLP outputs so the next token leans on the current one (a near-bigram
    model): then an MTP layer that passes its token embedding through predicts well, and the
    speculative tests see real acceptances."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.mul_(0.25)
            if name.endswith("embed_tokens.weight"):
                p.mul_(4.0)


def _mtp_tensors(cfg, main: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer: a copy of the last layer's block (perturbed) plus enorm/hnorm/eh_proj/shared_head;
    eh_proj passes the token embedding through (plus noise), so drafts follow the near-bigram model."""
    gen = torch.Generator().manual_seed(seed + 1)
    last, idx = cfg.num_hidden_layers - 1, cfg.num_hidden_layers
    out = {}
    for name, t in main.items():
        if name.startswith(f"model.layers.{last}."):
            noise = 0.02 * torch.randn(t.shape, generator=gen) if t.dim() > 1 else 0
            out[name.replace(f"layers.{last}.", f"layers.{idx}.")] = t + noise
    if getattr(cfg, "index_topk", None) and not any(".indexer." in n for n in out):  # last layer shared (GLM):
        for name, t in main.items():  # the MTP layer still has an indexer of its own
            if name.startswith("model.layers.0.self_attn.indexer."):
                out[name.replace("layers.0.", f"layers.{idx}.")] = t.clone()
    h = cfg.hidden_size
    p = f"model.layers.{idx}."
    out[p + "enorm.weight"] = 1 + 0.01 * torch.randn(h, generator=gen)
    out[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1) + 0.01 * torch.randn(h, 2 * h, generator=gen)
    out[p + "shared_head.norm.weight"] = main["model.norm.weight"].clone()
    out[p + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    out[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    return out


def save_checkpoint(arch: str, path: Path, seed: int = 0, damp: bool | None = None, **overrides):
    """Write a random checkpoint of ``arch`` to ``path``; returns the HF model (float32, eval).

    ``damp`` (default: DeepSeek-V3 only) makes it a near-bigram model (see _damp_blocks); ``overrides``:
    config fields set on top of ``arch``'s (make_config)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = make_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(model, seed)
    if arch.startswith(MLA_ARCHS) if damp is None else damp:
        _damp_blocks(model)
    if arch in DSA_ARCHS:  # positive head weights: a token scores 0 only when every head's relu is 0,
        with torch.no_grad():  # so the top-k has no ties to break (which any two implementations may
            for name, p in model.named_parameters():  # break differently)
                if name.endswith("indexer.weights_proj.weight"):
                    p.abs_().add_(0.05)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path)
    if arch.startswith(MLA_ARCHS):
        main = load_file(str(path / "model.safetensors"))
        save_file(_mtp_tensors(cfg, main, seed), str(path / "model-mtp.safetensors"))
    return model
