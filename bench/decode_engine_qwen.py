"""Qwen2.5-7B and Qwen3-8B shapes through the Engine API on one GPU (random bf16 weights), for decode_engine.py.

Each shape is built as HF-named tensors (Qwen2: q/k/v biases; Qwen3: q/k RMSNorm; untied lm_head) with a
trained model's greedy margins planted in the head (lm_head row pi(t) += 0.2 * embed[t] / sqrt(H), as
bench/decode_gpu.py's ``plant_successor``), loaded with ``Engine.from_hf_tensors`` and decoded greedily
after a 1K-token prompt: ``fast_path="auto"`` (the product's default: the fast path's CUDA graph) for
three measured passes (median reported), each variant the same way, and the reference step
(``fast_path="off"``) once; greedy tokens of every pass compared with the reference step's. Variants:
the other place for Qwen3's q/k norm, Qwen3 with the one-launch attention (``FastOptions(
attn_one_launch=True)``: the last split merges), 8 tokens per engine step, and the shape's Llama twin (same
tensors loaded as ``model_type="llama"``: no bias, no q/k norm; a control, its tokens are another
model's). Per-kernel GPU time of one step (torch profiler, PDL off so a kernel's time is its own) for the
Qwen3 shape and its twin. A Llama-3-8B shape built the same way runs last, the check that the Llama
path kept its speed.

``QWEN_VARIANTS=a,b`` measures only those variants (the default always); ``QWEN_SHAPES=a,b`` only
those shapes.

Roofline: bytes a step reads = every weight but the embedding table (lm_head counts, tied or not; one
embedding row is negligible) + the KV of the 1K context, over the copy bandwidth measured in the run.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
import traceback

import torch

from decode_engine import copy_bandwidth_bytes_per_s, engine_tokens_per_s  # bench/ is on sys.path

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from services.decode.engine.cuda.adapter import gqa_decoder_from_engine

QWEN25_7B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "eos_token_id": 151643, "bos_token_id": 151643,
}
QWEN3_8B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
    "eos_token_id": 151645, "bos_token_id": 151643,
}
LLAMA3_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 128001, "bos_token_id": 128000,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
}
TWIN = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False}
PER_STEP_8 = {"engine": {"fast_path_tokens_per_step": 8}}
NO_AHEAD = {"engine": {"fast_path_run_ahead": False}}  # each token read before the next replay
ATTN_WARPS_8 = {"engine": {"fast_path_options": FastOptions(attn_warps=8)}}
ONE_LAUNCH = {"engine": {"fast_path_options": FastOptions(attn_one_launch=True)}}  # the last split merging
SPLITS_8 = {"engine": {"fast_path_options": FastOptions(num_splits=8)}}  # attention: 8 splits of 2 blocks
SPLITS_8_BLOCK_128 = {"engine": {"fast_path_options": FastOptions(num_splits=8, block_s=128)}}
# the QKV and gate/up GEMVs with their RMSNorm first, at HF's rounding points (the default folds it: run N4)
NORM_FIRST = {"engine": {"fast_path_options": FastOptions(norm_late=False)}, "profile": True}


def tiles(**kw) -> dict:
    """A variant with some projections' batch-1 GEMV tiles (block_n, block_k, warps, stages) changed."""
    return {"engine": {"fast_path_options": FastOptions(tiles={**FastOptions().tiles, **kw})}}


# the QKV GEMV (norm prologue + paired rope rows) streams at ~3.2 TB/s against gate/up's ~3.9 (run B4's profile):
# other tiles for it, and for Qwen3-8B's down projection (K = 12288, the Llama default's tile was tuned at 14336)
TILE_VARIANTS = {"qkv_4x512": tiles(qkv=(4, 512, 4, 6)), "qkv_16x256": tiles(qkv=(16, 256, 4, 6)),
                 "qkv_8x512_s4": tiles(qkv=(8, 512, 4, 4)), "qkv_8x128_s8": tiles(qkv=(8, 128, 4, 8)),
                 "qkv_8x256_w8": tiles(qkv=(8, 256, 8, 6))}
# the o GEMV (~9.7 us a Qwen3-8B layer against ~8.0 of bytes, run N3): half / twice its default rows a program,
# and longer K tiles with fewer stages (the tile was last swept before the step ran on PDL)
O_TILE_VARIANTS = {"o_8x256": tiles(o=(8, 256, 4, 6)), "o_32x256_s4": tiles(o=(32, 256, 4, 4)),
                   "o_16x512_s4": tiles(o=(16, 512, 4, 4))}
# key -> (config, variants measured besides the default: engine keyword arguments, config overrides)
SHAPES = {
    "qwen25_7b": (QWEN25_7B, {"tokens_per_step_8": PER_STEP_8, "no_run_ahead": NO_AHEAD, "attn_warps_8": ATTN_WARPS_8,
                              "attention_one_launch": ONE_LAUNCH, "norm_first": NORM_FIRST,
                              "llama_twin": {"config": TWIN}}),
    "qwen3_8b": (QWEN3_8B, {"qk_norm_kernel": {"engine": {"fast_path_options": FastOptions(qk_norm_in="kernel")}},
                            # before run N1: q/k norm + rope in the attention's prologue (8 warps there)
                            "qk_norm_attention": {"engine": {"fast_path_options": FastOptions(
                                qk_norm_in="attention")}, "profile": True},
                            "attention_one_launch": ONE_LAUNCH, "norm_first": NORM_FIRST,
                            "before_q8": {"engine": {"fast_path_options": FastOptions(
                                qk_norm_in="attention", qk_pos_row_prologue=False)}},
                            "combine_warps_1": {"engine": {"fast_path_options": FastOptions(attn_combine_warps=1)}},
                            "attn_warps_2": {"engine": {"fast_path_options": FastOptions(attn_warps=2)}},
                            "attn_warps_8": ATTN_WARPS_8,
                            "tokens_per_step_8": PER_STEP_8, "no_run_ahead": NO_AHEAD,
                            "splits_8": SPLITS_8, "splits_8_block_128": SPLITS_8_BLOCK_128,
                            "llama_twin": {"config": TWIN, "profile": True}, **TILE_VARIANTS,
                            "down_8x512": tiles(down=(8, 512, 4, 5)), **O_TILE_VARIANTS}),
    "llama3_8b": (LLAMA3_8B, {"no_run_ahead": NO_AHEAD, "attn_warps_8": ATTN_WARPS_8, "attention_one_launch": ONE_LAUNCH,
                              "norm_first": NORM_FIRST, **TILE_VARIANTS}),
}
PROFILED = ("qwen25_7b", "qwen3_8b")  # their defaults' kernels profiled too


def log(*a):
    print(*a, flush=True)


def hf_tensors(cfg: dict, seed: int = 0, beta: float = 0.2, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Random HF-named bf16 tensors on CUDA: projections 1/sqrt(fan_in), o/down also 1/sqrt(2L) (a conditioned
    residual stream), norms 1 + N(0, 0.1), biases N(0, 0.5); the planted next-token map in lm_head."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf, h, L = torch.bfloat16, cfg["hidden_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // hq

    def w(n, k, scale=1.0):
        return torch.randn(n, k, device=device, dtype=bf, generator=g) * (scale * k ** -0.5)

    def nw(n):
        return (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(bf)

    out_scale = (2 * L) ** -0.5
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, device=device, dtype=bf, generator=g)}
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t[p + "input_layernorm.weight"] = nw(h)
        for name, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
            t[f"{a}{name}_proj.weight"] = w(rows, h)
            if cfg["model_type"] == "qwen2":
                t[f"{a}{name}_proj.bias"] = 0.5 * torch.randn(rows, device=device, dtype=bf, generator=g)
        if cfg["model_type"] == "qwen3":
            t[a + "q_norm.weight"], t[a + "k_norm.weight"] = nw(d), nw(d)
        t[a + "o_proj.weight"] = w(h, hq * d, out_scale)
        t[p + "post_attention_layernorm.weight"] = nw(h)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(inter, h), w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter, out_scale)
    t["model.norm.weight"] = nw(h)
    head = w(vocab, h)
    perm = torch.randperm(vocab, device=device, generator=g)
    head.index_add_(0, perm, t["model.embed_tokens.weight"] * (beta / h ** 0.5))
    t["lm_head.weight"] = head
    return t


def step_bytes(engine: Engine, context: int) -> int:
    """Bytes a batch-1 step reads: every parameter but the embedding table (lm_head counts) + the context's KV."""
    params = engine.model.named_parameters(remove_duplicate=False)
    weights = sum(p.numel() * p.element_size() for name, p in params if name != "embed")
    cfg = engine.cfg
    return weights + cfg.num_layers * 2 * context * cfg.num_kv_heads * cfg.head_dim * 2


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_profile(engine: Engine, token: int, pos: int, steps: int = 4) -> dict[str, float]:
    """GPU us per step of each kernel name, eager steps of a PDL-free decoder over the engine's slot 0."""
    from torch.profiler import ProfilerActivity, profile

    opts = getattr(engine._fast, "options", None) or FastOptions()  # the variant's own options, PDL off
    dec = gqa_decoder_from_engine(engine.model, 0, dataclasses.replace(opts, pdl=False), max_steps=16)
    dec.set_state(token, pos)
    for _ in range(2):
        dec.step()
    dec.set_state(token, pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us:
            times[e.key[:60]] = round(us / steps, 1)
    times["sum"] = round(sum(times.values()), 1)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def measure_shape(key: str, steps: int, context: int, bandwidth: float, prompt: list[int],
                  device: str = "cuda") -> dict:
    """Reference step once, then the fast path's default and variants three passes each (through ``Engine``)."""
    cfg, variants = SHAPES[key]
    chosen = os.environ.get("QWEN_VARIANTS")  # a comma list of variant names: only those (a shorter run)
    if chosen is not None:
        variants = {k: v for k, v in variants.items() if k in chosen.split(",")}
    t0 = time.time()
    tensors = hf_tensors(cfg, device=device)
    prompt = [t % (cfg["vocab_size"] - 2) + 2 for t in prompt]
    out: dict = {"model": f"{key} shape (random, planted next-token margins)", "context": context, "steps": steps}

    def load(config: dict | None = None, **options) -> Engine:
        return Engine.from_hf_tensors({**cfg, **(config or {})}, tensors, max_seq_len=context + steps + 16,
                                      device=device, dtype=torch.bfloat16, model_name=key, **options)

    ref = load(fast_path="off")
    r = engine_tokens_per_s(ref, prompt, steps)
    ref_tokens = r["token_ids"]
    out["reference"] = {"tok_s": r["tokens_per_s"], "paths": r["paths"]}
    del ref
    _free()
    for name, variant in [("default", {"profile": key in PROFILED}), *variants.items()]:
        try:
            engine = load(variant.get("config"), fast_path="auto", **variant.get("engine", {}))
            if name == "default":
                nbytes = step_bytes(engine, context)
                out.update(step_GB=nbytes / 1e9, roofline_tok_s=bandwidth / nbytes)
            passes = [engine_tokens_per_s(engine, prompt, steps) for _ in range(3)]
            tok_s = statistics.median(p["tokens_per_s"] for p in passes)
            same = [next((i for i, (a, b) in enumerate(zip(p["token_ids"], ref_tokens)) if a != b),
                         min(len(p["token_ids"]), len(ref_tokens))) for p in passes]
            twin = "config" in variant  # another model: its tokens are not the reference's
            out[name] = {"tok_s": tok_s, "passes_tok_s": [p["tokens_per_s"] for p in passes],
                         "frac_roofline": tok_s / out["roofline_tok_s"],
                         "paths": sorted({x for p in passes for x in p["paths"]}),
                         "fast_path": engine.fast_path_reason or "on",
                         "tokens_equal_reference_prefix": None if twin else same, "compared_tokens": len(ref_tokens),
                         "tokens_identical": None if twin else all(p["token_ids"] == ref_tokens for p in passes)}
            log(f"  {key} {name:<18} {tok_s:7.1f} tok/s  {out[name]['frac_roofline']:.1%} of roofline  paths "
                f"{'/'.join(out[name]['paths'])}  tokens = reference: {out[name]['tokens_identical']} ({same})")
            if variant.get("profile"):
                try:
                    out[name]["kernel_us_per_step"] = kp = kernel_profile(engine, passes[0]["token_ids"][0], context)
                    log(f"    kernels (us per step, PDL off): {kp}")
                except Exception:  # noqa: BLE001 - the measurement above still counts
                    out[name]["kernel_profile_error"] = traceback.format_exc()[-800:]
                    log(out[name]["kernel_profile_error"])
            del engine
            _free()
        except Exception:  # noqa: BLE001 - the other variants still count
            out[name] = {"error": traceback.format_exc()[-1500:]}
            log(f"  {key} {name} FAILED\n{out[name]['error']}")
    out["wall_s"] = time.time() - t0
    tensors.clear()
    _free()
    return out


def bench_cuda_qwen(steps: int, context: int, result: dict, save=lambda: None, bandwidth: float | None = None) -> None:
    """Adds cuda_qwen (every measurement) and the headline keys to ``result`` (decode_engine.json or
    decode_gpu.json); ``save()`` after each shape. ``bandwidth``: the run's copy bandwidth (bytes/s), measured
    here when not given."""
    bandwidth = bandwidth or copy_bandwidth_bytes_per_s("cuda")
    prompt = [int(t) for t in torch.randint(2, 150000, (context,), generator=torch.Generator().manual_seed(0))]
    q = result["cuda_qwen"] = {"device": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": bandwidth / 1e12}
    log(f"\n{q['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; roofline = bytes a step reads "
        "(weights but the embedding table, + KV)")
    for key in [k for k in SHAPES if k in os.environ.get("QWEN_SHAPES", ",".join(SHAPES)).split(",")]:
        try:
            q[key] = m = measure_shape(key, steps, context, bandwidth, prompt)
        except Exception:  # noqa: BLE001
            q[key] = {"error": traceback.format_exc()[-1500:]}
            log(q[key]["error"])
            save()
            continue
        d = m.get("default", {})
        if "tok_s" not in d:
            continue
        ctx = f"ctx{context // 1024}k" if context % 1024 == 0 else f"ctx{context}"
        result[f"{key}_{ctx}_tok_s"] = d["tok_s"]
        result[f"{key}_{ctx}_frac_roofline"] = d["frac_roofline"]
        result[f"{key}_tokens_identical"] = d["tokens_identical"]
        result[f"{key}_path"] = "/".join(d["paths"]) + ("" if d["fast_path"] == "on" else f" ({d['fast_path']})")
        result[f"{key}_reference_tok_s"] = m["reference"]["tok_s"]
        save()
