"""``expresslane make-model``: write a tiny, real Hugging Face checkpoint with seeded random weights.

Contract: ``make_model(arch, out, seed=0, dtype="float32")`` writes into ``out``
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with a chat template) and ``special_tokens_map.json``. The files are
in the format of the public checkpoints of each family (hub-style config keys, one tensor per
expert), so HF transformers and vLLM load them unchanged. The same arguments give the same bytes.

Architectures: ``llama`` (Llama-3 GQA, llama3 rope scaling), ``qwen2`` (qkv bias), ``qwen3``
(q/k RMSNorm), ``deepseek_v3`` (MLA with kv_lora_rank 512 + rope dim 64 so vLLM's CPU MLA can run
it, q_lora, sigmoid/noaux_tc routed experts in groups, one shared expert, a dense first layer and
one MTP layer stored as ``model.layers.<num_hidden_layers>.*`` the way DeepSeek-V3 ships it), and
``deepseek_v32`` (the same with DeepSeek Sparse Attention: a lightning indexer per layer, top 16
tokens per query) and ``glm_moe_dsa`` (GLM-5's variant: interleaved indexer rope, the second layer
reusing the first one's choice); the decode engine serves those two, vLLM's CPU build does not
(``ENGINE_ONLY_ARCHS``).

The tokenizer (``infra.tinymodel_tokenizer``: Llama-3 style, or Qwen style for qwen2/qwen3) is a
byte-level BPE trained on ``tinymodel_corpus.txt``; its size is the model's ``vocab_size``, so
every id a model can emit decodes.

Planted continuations (``--plant NAME``, a new model variant; the default models are untouched):
the model greedily emits a fixed text after the chat template's assistant header, e.g. a Hermes
tool call or a ``<think>`` block then an answer, so tool and reasoning parsers have something to
parse. The text is cut into pieces (``PLANTS``), each a dedicated added token (so no token of the
chain repeats), plus ``assistant\n`` as the trigger. The last ``len(chain)`` hidden dimensions are
reserved: a chain token's embedding is ``PLANT_SCALE`` on its own reserved dimension (zero
elsewhere), every other embedding and every layer output (o_proj, down_proj rows) is zero there,
and the lm_head row of its successor is ``PLANT_LOGIT`` on that dimension; after the final RMSNorm
the reserved dimension dominates the hidden state whatever the layers add, so the successor wins
the argmax by a wide margin. The chain ends with ``<|im_end|>``.

Weights: every tensor is drawn from its own generator seeded by (seed, tensor name), so shapes
and names, not creation order, decide the values. Scales keep activations O(1) through the
layers (linear std 1/sqrt(fan_in), embeddings std 1, norm weights 1 + N(0, 0.1)) and give logits
a std of about 4, so greedy decoding depends on the whole context and argmax ties are rare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

from infra.tinymodel_tokenizer import (
    IM_END, TokenizerStyle, add_planted_tokens, style_for, tokenizer_config_files, train_tokenizer,
)
from shared.kvlayout import dsa_indexer_layers

ARCHS = ("llama", "qwen2", "qwen3", "deepseek_v3")  # what vLLM's CPU build serves too
ENGINE_ONLY_ARCHS = ("deepseek_v32", "glm_moe_dsa")  # vLLM's CPU build refuses sparse attention
DTYPES = ("float32", "bfloat16")
MAX_POSITION_EMBEDDINGS = 2048
NUM_LAYERS = 2
LOGIT_STD = 4.0
PLANT_SCALE = 1000.0  # a chain token's embedding on its reserved dimension
PLANT_LOGIT = 8.0  # lm_head weight of a successor on its predecessor's dimension
PLANT_TRIGGER = "assistant\n"  # the end of the chat template's generation prompt
_TOOL_CALL = ["<tool_call>", '\n{"name": "', "get_weather", '", "arguments": {"city": "', "Paris",
              '"}}\n', "</tool_call>"]
_THINK = ["<think>", "\nThe user wants the weather", " in Paris", ".\n", "</think>", "\n\n"]
# name -> the planted continuation's pieces (each one added token); tokens the parsers look up
# (<think>, </think>, <tool_call>, </tool_call>) are pieces too
PLANTS: dict[str, list[str]] = {
    "tool-call": _TOOL_CALL,
    "reasoning": [*_THINK, "It is sunny", " today."],
    "reasoning-tool-call": [*_THINK, *_TOOL_CALL],
}
PLANT_ARCHS = ("llama", "qwen2", "qwen3")


# ---------------------------------------------------------------- configs
# DeepSeek-V3's own rope scaling, shrunk to 2048 positions. It also keeps vLLM's CPU MLA on the
# PyTorch rope path: vLLM 0.32's fused CPU rotary kernel rotates 3-D MLA q/k views wrongly.
_DEEPSEEK_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _common(vocab_size: int, dtype: str, style: TokenizerStyle) -> dict:
    # Qwen configs name <|endoftext|> as bos although the tokenizer never prepends it.
    return {"vocab_size": vocab_size, "num_hidden_layers": NUM_LAYERS, "hidden_act": "silu",
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "tie_word_embeddings": False,
            "bos_token_id": style.id_of(style.bos or style.eos), "eos_token_id": style.id_of(style.eos),
            "pad_token_id": style.id_of(style.pad),
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype}


def model_config(arch: str, vocab_size: int, dtype: str) -> dict:
    """Hub-style config.json for ``arch``."""
    c = _common(vocab_size, dtype, style_for(arch))
    if arch == "llama":
        c.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
                 intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    elif arch == "qwen2":
        c.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=192,
                 intermediate_size=384, num_attention_heads=3, num_key_value_heads=1,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                 use_sliding_window=False, sliding_window=None, max_window_layers=NUM_LAYERS)
    elif arch == "qwen3":
        c.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=128,
                 intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, attention_bias=False,
                 use_sliding_window=False, sliding_window=None, max_window_layers=NUM_LAYERS)
    elif arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        c.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
                 intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                 n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                 topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                 first_k_dense_replace=1, moe_layer_freq=1, ep_size=1,
                 num_nextn_predict_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling=_DEEPSEEK_YARN, attention_bias=False, attention_dropout=0.0)
        if arch == "deepseek_v32":
            c.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=16,
                     index_n_heads=8, index_head_dim=64)
        if arch == "glm_moe_dsa":
            c.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", index_topk=16,
                     index_n_heads=8, index_head_dim=64, indexer_types=["full", "shared"],
                     mlp_layer_types=["dense", "sparse"])
    else:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS + ENGINE_ONLY_ARCHS)}")
    return dict(sorted(c.items()))


# ---------------------------------------------------------------- weight shapes
def _gqa_layer(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    nq, nkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    s = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
         f"{p}.self_attn.q_proj.weight": (nq, h), f"{p}.self_attn.k_proj.weight": (nkv, h),
         f"{p}.self_attn.v_proj.weight": (nkv, h), f"{p}.self_attn.o_proj.weight": (h, nq),
         **_mlp(f"{p}.mlp", h, i)}
    if c["model_type"] == "qwen2":
        s |= {f"{p}.self_attn.q_proj.bias": (nq,), f"{p}.self_attn.k_proj.bias": (nkv,),
              f"{p}.self_attn.v_proj.bias": (nkv,)}
    if c["model_type"] == "qwen3":
        s |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
    return s


def _mlp(p: str, h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {f"{p}.gate_proj.weight": (i, h), f"{p}.up_proj.weight": (i, h), f"{p}.down_proj.weight": (h, i)}


def _mla_layer(c: dict, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    a = f"{p}.self_attn"
    s = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
         f"{a}.q_a_proj.weight": (c["q_lora_rank"], h), f"{a}.q_a_layernorm.weight": (c["q_lora_rank"],),
         f"{a}.q_b_proj.weight": (nh * qk, c["q_lora_rank"]),
         f"{a}.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
         f"{a}.kv_a_layernorm.weight": (c["kv_lora_rank"],),
         f"{a}.kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
         f"{a}.o_proj.weight": (h, nh * c["v_head_dim"])}
    if layer in dsa_indexer_layers(c, layer + 1):  # the sparse-attention indexer
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        s |= {f"{a}.indexer.wq_b.weight": (ih * idim, c["q_lora_rank"]), f"{a}.indexer.wk.weight": (idim, h),
              f"{a}.indexer.k_norm.weight": (idim,), f"{a}.indexer.k_norm.bias": (idim,),
              f"{a}.indexer.weights_proj.weight": (ih, h)}
    if layer < c["first_k_dense_replace"]:
        return s | _mlp(f"{p}.mlp", h, c["intermediate_size"])
    e, im = c["n_routed_experts"], c["moe_intermediate_size"]
    s |= {f"{p}.mlp.gate.weight": (e, h), f"{p}.mlp.gate.e_score_correction_bias": (e,)}
    for j in range(e):
        s |= _mlp(f"{p}.mlp.experts.{j}", h, im)
    return s | _mlp(f"{p}.mlp.shared_experts", h, im * c["n_shared_experts"])


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint -> shape (MTP layers included)."""
    h, v = c["hidden_size"], c["vocab_size"]
    s = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    mla = c["model_type"] in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        s |= _mla_layer(c, p, layer) if mla else _gqa_layer(c, p)
    for layer in range(c["num_hidden_layers"], c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{layer}"
        s |= {f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h),
              f"{p}.embed_tokens.weight": (v, h), f"{p}.shared_head.norm.weight": (h,),
              f"{p}.shared_head.head.weight": (v, h), **_mla_layer(c, p, layer)}
    return s


# ---------------------------------------------------------------- weights
def _init_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's init, from its name."""
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith(("head.weight",)) or name == "lm_head.weight":
        return 0.0, LOGIT_STD / math.sqrt(shape[1])
    if len(shape) == 1 and name.endswith(".bias"):
        return 0.0, 0.1
    if len(shape) == 1 and "norm" in name:
        return 1.0, 0.1
    if len(shape) == 1:  # biases, e_score_correction_bias
        return 0.0, 0.1
    return 0.0, 1.0 / math.sqrt(shape[1])


def make_weights(c: dict, seed: int, dtype: str) -> dict:
    """Seeded random tensors for ``weight_shapes(c)``; MTP embed/head are copies of the model's."""
    import torch

    out = {}
    for name, shape in weight_shapes(c).items():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        mean, std = _init_std(name, shape)
        out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
        if name.endswith("indexer.weights_proj.weight"):  # positive head weights: a token's index score is 0
            out[name] = out[name].abs() + 0.05 * std  # only when every head's relu is, so top-k has no ties
    for name in out:
        if name.endswith(".embed_tokens.weight") and name != "model.embed_tokens.weight":
            out[name] = out["model.embed_tokens.weight"].clone()
        if name.endswith(".shared_head.head.weight"):
            out[name] = out["lm_head.weight"].clone()
    torch_dtype = getattr(torch, dtype)
    return {k: t.to(torch_dtype).contiguous() for k, t in out.items()}


# ---------------------------------------------------------------- writer
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def plant_weights(w: dict, c: dict, chain: list[int], successors: list[int]) -> None:
    """Make ``successors[k]`` the greedy next token after ``chain[k]`` (float32 tensors, in place;
    see the module docstring)."""
    h = c["hidden_size"]
    dims = list(range(h - len(chain), h))
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    emb[:, dims] = 0.0
    head[:, dims] = 0.0
    w["model.norm.weight"][dims] = 1.0
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        w[f"{p}.self_attn.o_proj.weight"][dims, :] = 0.0
        w[f"{p}.mlp.down_proj.weight"][dims, :] = 0.0
    for k, (token, succ) in enumerate(zip(chain, successors)):
        emb[token] = 0.0
        emb[token, dims[k]] = PLANT_SCALE
        if k + 1 < len(chain):  # a planted piece: only ever the chain's successor
            head[succ] = 0.0
        head[succ, dims[k]] = PLANT_LOGIT


def make_model(arch: str, out: Path | str, seed: int = 0, dtype: str = "float32",
               plant: str | None = None) -> Path:
    """Write the checkpoint of ``arch`` into ``out`` (with ``plant``: the planted variant);
    returns ``out``."""
    from safetensors.torch import save_file

    if arch not in ARCHS + ENGINE_ONLY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS + ENGINE_ONLY_ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if plant is not None and (plant not in PLANTS or arch not in PLANT_ARCHS):
        raise ValueError(f"--plant {plant!r} for {arch!r}: choose one of {', '.join(PLANTS)} with "
                         f"one of {', '.join(PLANT_ARCHS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    style = style_for(arch)
    tok = train_tokenizer(style)
    planted: dict[int, str] = {}
    if plant is not None:
        pieces = [PLANT_TRIGGER, *PLANTS[plant]]
        planted = dict(zip(add_planted_tokens(tok, pieces), pieces))
    tok.save(str(out / "tokenizer.json"), pretty=True)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    for fname, obj in tokenizer_config_files(style, planted).items():
        _write_json(out / fname, obj)
    config = model_config(arch, vocab_size, dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "pad_token_id": config["pad_token_id"],
        "eos_token_id": [config["eos_token_id"], style.id_of(IM_END)]})
    weights = make_weights(config, seed, "float32")
    if planted:
        chain = list(planted)
        plant_weights(weights, config, chain, chain[1:] + [style.id_of(IM_END)])
    import torch

    weights = {k: t.to(getattr(torch, dtype)).contiguous() for k, t in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str]) -> int:
    """CLI entry: ``expresslane make-model --arch ARCH --out DIR``."""
    parser = argparse.ArgumentParser(
        prog="expresslane make-model",
        description="Write a tiny HF checkpoint (config, safetensors, tokenizer with chat template) "
                    "with seeded random weights. Same arguments, same bytes.")
    parser.add_argument("--arch", required=True, choices=ARCHS + ENGINE_ONLY_ARCHS,
                        help="model family (deepseek_v32: sparse attention, for the decode engine only)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="stored weight dtype and config torch_dtype (default float32)")
    parser.add_argument("--quantize", choices=("fp8-channel", "fp8-tensor", "fp8-block"), default=None,
                        help="write FP8 weights (infra.tinymodel_fp8): compressed-tensors per channel or per "
                             "tensor, or the fp8 method with block scales (--block)")
    parser.add_argument("--block", default="128x128", metavar="ROWSxCOLS",
                        help="fp8-block's block (default 128x128, as DeepSeek-V3 ships; the decode engine's fast "
                             "path reads powers of two, and a tiny model's 32-64-wide projections keep distinct "
                             "block scales only with small blocks such as 16x16)")
    parser.add_argument("--plant", choices=tuple(PLANTS), default=None,
                        help="a variant that greedily emits a fixed continuation after the chat "
                             "template's assistant header: a Hermes <tool_call> (tool-call), a <think> "
                             "block then an answer (reasoning), or both (reasoning-tool-call); for "
                             f"{', '.join(PLANT_ARCHS)}")
    args = parser.parse_args(argv)
    try:
        block = tuple(int(v) for v in args.block.lower().split("x"))
        if len(block) != 2 or min(block) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--block {args.block!r}: give ROWSxCOLS, e.g. 128x128")
    try:
        out = make_model(args.arch, args.out, seed=args.seed, dtype=args.dtype, plant=args.plant)
    except ValueError as exc:
        parser.error(str(exc))
    if args.quantize:
        from infra.tinymodel_fp8 import quantize_checkpoint

        quantize_checkpoint(out, args.quantize, block=block)
    print(out)
    return 0
