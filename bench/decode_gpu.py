"""Batch-1 decode speed of the fast CUDA path on one GPU, against the bandwidth roofline and HF.

One self-contained run (random bf16 weights, no checkpoint): copy bandwidth first; then per shape
GEMV micro-benchmarks (Triton tiles vs cuBLAS, each projection over all layers' distinct weights in
one CUDA graph), whole-step variants in one CUDA graph, correctness against the torch reference
(greedy tokens over 256 steps, logits tolerance), HF transformers static cache + CUDA graph, and
contexts 1K / 8K / 32K; the DeepSeek-V3-family shape (bench/decode_gpu_mla.py) when asked; sampling on
the fast path (part "sampled", bench/decode_gpu_sampling.py: the sampling kernels against the reference
sampler, then greedy vs sampled decode, temperature 0.7 / top_p 0.9 / top_k 50 / min_p 0.05 /
repetition_penalty 1.1, through the Engine API where it imports, else on the decoder's graphs:
``llama8b_sampled_tok_s``, ``llama8b_sampled_over_greedy``, ``llama8b_sampled_path``); several slots in one
step (part "batch", bench/decode_gpu_batch.py: the batched decoder's graphs at 2 / 4 / 8 rows, then engine
step time with 4 / 8 active slots at 1K context each over one slot's: ``llama8b_batch4_step_ratio``,
``llama8b_batch8_step_ratio``, ``llama8b_batch_path``; not in the default parts); the Qwen2.5-7B and Qwen3-8B
shapes through the Engine API (part "qwen", bench/decode_engine_qwen.py, over this run's copy bandwidth:
``qwen25_7b_ctx1k_tok_s``, ``qwen25_7b_ctx1k_frac_roofline``, ``qwen3_8b_ctx1k_*``, ``*_tokens_identical``,
``*_path``; ``QWEN_VARIANTS`` picks its variants, none but the default unless set).
Prints a table; writes --out (default bench/results/decode_gpu.json).

    python bench/decode_gpu.py [--parts copy,micro,llama,correct,hf,ctx,mla,dsv3,dsv3fp8,dsv32,sampled,batch,qwen]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_cuda_pkg():
    """Import services/decode/engine/cuda as a standalone package (needs only torch + triton)."""
    if "xl_cuda" in sys.modules:
        return sys.modules["xl_cuda"]
    pkg_dir = ROOT / "services/decode/engine/cuda"
    spec = importlib.util.spec_from_file_location("xl_cuda", pkg_dir / "__init__.py",
                                                  submodule_search_locations=[str(pkg_dir)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["xl_cuda"] = mod
    spec.loader.exec_module(mod)
    return mod


LLAMA8B = dict(hidden=4096, layers=32, hq=32, hkv=8, d=128, inter=14336, vocab=128256, eps=1e-5)
LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def log(*a):
    print(*a, flush=True)


def time_graph(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median ms of one call of fn (a graph replay or launcher), CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def capture(fn, steps_per_replay: int = 1, before_capture=None):
    """fn captured now in one CUDA graph by the engine's runner (errors propagate); call it to replay."""
    runner = load_cuda_pkg().GraphedFn(fn, True, steps_per_replay=steps_per_replay, before_capture=before_capture)
    runner.capture()
    return runner


def copy_bandwidth() -> float:
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = time_graph(lambda: b.copy_(a), iters=20)
    del a, b
    return 2 * n / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- llama shape

def rope_tables(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = params["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    f, lo, hi, old = params["factor"], params["low_freq_factor"], params["high_freq_factor"], \
        params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / f, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / f + smooth * scaled
    is_medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    inv = torch.where(is_medium, smoothed, scaled)
    fr = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return fr.cos(), fr.sin()


def build_llama(X, s: dict, seed: int = 0, init: str = "scaled"):
    """Random weights. init "scaled": output projections (wo, w_down) scaled by 1/sqrt(2 L) as in GPT-2 /
    Megatron init, so the residual stream is conditioned like a trained model's; "unit": every
    projection 1/sqrt(fan_in) (a chaotic net: bf16 rounding noise grows layer by layer)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    out_scale = (2 * s["layers"]) ** -0.5 if init == "scaled" else 1.0

    def w(n, k, scale=1.0):
        return (torch.randn(n, k, device="cuda", dtype=dt, generator=g) * (scale * k ** -0.5)).to(dt)

    def nw(n):
        return (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dt)

    h, hq, hkv, d, inter = s["hidden"], s["hq"], s["hkv"], s["d"], s["inter"]
    layers = [X.GqaLayer(nw(h), w((hq + 2 * hkv) * d, h), w(h, hq * d, out_scale), nw(h), w(2 * inter, h),
                         w(h, inter, out_scale))
              for _ in range(s["layers"])]
    embed = torch.randn(s["vocab"], h, device="cuda", dtype=dt, generator=g)
    return X.GqaModel(layers, embed, nw(h), w(s["vocab"], h), hq, hkv, d, s["eps"])


def plant_successor(model, s: dict, beta: float = 0.2, seed: int = 5) -> torch.Tensor:
    """Give the random model a trained model's greedy margins: lm_head row pi(t) += beta * embed[t] /
    sqrt(H) for a fixed permutation pi, so the next token after t is pi(t) by a margin of ~5 logits
    (random logits: std ~1, max over 128K ~4.5; planted: ~beta * 50) while every kernel still does its
    full work and the random rows keep the logits' spread. Returns the original head (to restore)."""
    saved = model.lm_head.clone()
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(s["vocab"], device="cuda", generator=g)
    model.lm_head.index_add_(0, perm, (model.embed.float() * (beta / s["hidden"] ** 0.5)).to(model.lm_head.dtype))
    return saved


def make_slot(s: dict, max_tokens: int, ctx: int, seed: int = 1):
    """One slot buffer in the shared.kvlayout GQA layout, K/V views per layer, first ctx tokens random."""
    per = max_tokens * s["hkv"] * s["d"]
    buf = torch.empty(s["layers"] * 2 * per, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    views = buf.view(s["layers"], 2, max_tokens, s["hkv"], s["d"])
    views[:, :, :ctx].normal_(generator=g)
    return buf, [views[i, 0] for i in range(s["layers"])], [views[i, 1] for i in range(s["layers"])]


def kv_bytes(s: dict, ctx: int) -> int:
    return s["layers"] * 2 * ctx * s["hkv"] * s["d"] * 2


def step_timing(X, model, s, ctx, opts, steps_per_replay=8, max_tokens=None, slot=None):
    """ms per token of the captured step (steps_per_replay steps per graph) at context ctx."""
    max_tokens = max_tokens or ctx + 1024
    if slot is None:
        slot = make_slot(s, max_tokens, ctx)
    _, kc, vc = slot
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = X.GqaDecoder(model, kc, vc, cos, sin, opts, max_steps=max_tokens)
    runner = capture(dec.step, steps_per_replay, before_capture=lambda: dec.set_state(1, ctx))
    dec.set_state(1, ctx)
    iters = max(1, min(40, (max_tokens - ctx - 16) // steps_per_replay - 6))
    ms = time_graph(runner, iters=iters, warmup=3) / steps_per_replay
    del runner, dec
    return ms


def correctness(X, model, s, ctx, opts, steps=256) -> dict:
    """Fast path (graph, one step per replay) vs reference_step: greedy tokens and logits per step."""
    max_tokens = ctx + steps + 8
    _, kc, vc = make_slot(s, max_tokens, ctx, seed=7)
    kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = X.GqaDecoder(model, kc, vc, cos, sin, opts, max_steps=max_tokens)
    runner = capture(dec.step, before_capture=lambda: dec.set_state(5, ctx))
    dec.set_state(5, ctx)
    tok, identical, first_diff, max_rel, mismatches, gaps = 5, 0, None, 0.0, 0, []
    rel_first, all_gaps = [], []
    cos_b, sin_b = cos.cuda(), sin.cuda()
    # the reference's rounding points are the fast path's: the norm folded where the options fold it
    late = (X.llama.folds_norm(opts, "qkv", False, 0), X.llama.folds_norm(opts, "gate_up", False, 0))
    for i in range(steps):
        runner()
        ref = X.reference_step(model, kr, vr, cos_b, sin_b, tok, ctx + i, norm_late=late)
        fast = dec.logits
        rel = ((fast - ref).abs().max() / ref.abs().max()).item()
        max_rel = max(max_rel, rel)
        if i < 4:
            rel_first.append(rel)
        ft, rt = int(dec.token.item()), int(ref.argmax().item())
        top2 = ref.topk(2).values
        all_gaps.append(float(top2[0] - top2[1]))
        if ft == rt and first_diff is None:
            identical += 1
        elif ft != rt:
            mismatches += 1
            first_diff = i if first_diff is None else first_diff
            gaps.append(all_gaps[-1])
        tok = ft  # teacher-force the reference with the fast path's token from here on
    del runner, dec
    return {"steps": steps, "greedy_identical_prefix": identical, "mismatches": mismatches,
            "first_mismatch": first_diff, "mismatch_ref_top2_gaps": gaps[:5], "logits_max_rel_err": max_rel,
            "logits_rel_err_first_steps": rel_first, "ref_top2_gap_min": min(all_gaps),
            "ref_top2_gap_median": sorted(all_gaps)[len(all_gaps) // 2],
            "tokens_identical": mismatches == 0, "logits_ok": max_rel < 2e-2}


def hf_graph(s: dict, ctx: int, steps: int = 30) -> dict:
    """HF transformers Llama with a static cache, one decode step captured in a CUDA graph."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["hq"], num_key_value_heads=s["hkv"], head_dim=s["d"],
                      vocab_size=s["vocab"], max_position_embeddings=131072, rms_norm_eps=s["eps"],
                      rope_theta=LLAMA_ROPE["rope_theta"], rope_scaling=dict(LLAMA_ROPE))
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    max_len = ctx + 64
    try:
        cache = StaticCache(config=cfg, max_cache_len=max_len)
    except TypeError:
        cache = StaticCache(config=cfg, max_batch_size=1, max_cache_len=max_len, device="cuda", dtype=torch.bfloat16)
    tok = torch.ones(1, 1, dtype=torch.long, device="cuda")
    cpos = torch.tensor([ctx], dtype=torch.long, device="cuda")
    with torch.no_grad():
        def fn():
            return model(input_ids=tok, past_key_values=cache, cache_position=cpos, position_ids=cpos[None],
                         use_cache=True).logits
        eager_ms = time_graph(fn, iters=5, warmup=2)
        g = capture(fn)
        ms = time_graph(g, iters=steps, warmup=3)
    del g, model, cache
    torch.cuda.empty_cache()
    return {"hf_eager_ms": eager_ms, "hf_graph_ms": ms, "hf_graph_tok_s": 1e3 / ms}


def variants(X, micro: dict | None) -> dict:
    P = X.llama.PROJECTIONS
    best_tiles = dict(X.FastOptions().tiles)
    if micro:
        for name, r in micro.items():
            if r.get("best_triton"):
                best_tiles[name] = tuple(int(v) for v in r["best_triton"].strip("()").split(","))
    faster = {}
    if micro:
        for name, r in micro.items():
            b = r.get("best_triton")
            c = r["results"].get("cublas", {}).get("us")
            faster[name] = "triton" if (b and (c is None or r["results"][b]["us"] <= c)) else "cublas"
    out = {
        "triton_all": X.FastOptions(tiles=best_tiles, num_splits=32, block_s=32, pdl=False),
        "cublas_all": X.FastOptions(backends={p: "cublas" for p in P}, pdl=False),
    }
    out["triton_attn_16x64"] = X.FastOptions(tiles=best_tiles, num_splits=16, block_s=64, pdl=False)
    # run 7 notes: PDL with the trigger at kernel entry was slower; this triggers after the weight stream
    out["triton_attn_16x64_pdl"] = X.FastOptions(tiles=best_tiles, num_splits=16, block_s=64, pdl=True)
    if faster:
        out["per_projection_best"] = X.FastOptions(tiles=best_tiles, backends={p: faster.get(p, "triton") for p in P},
                                                   pdl=False)
    return out


def run_llama(X, parts, R: dict) -> None:
    s = LLAMA8B
    t0 = time.time()
    model = build_llama(X, s)
    wbytes = model.weight_bytes()
    R["llama8b_weight_GB"] = wbytes / 1e9
    log(f"llama8b weights {wbytes / 1e9:.2f} GB, built in {time.time() - t0:.1f} s")
    bw = R.get("copy_bw_TBps", 4.2)
    micro = None
    if "micro" in parts:
        from decode_gpu_checks import micro_gemv  # bench/ is on sys.path when run as a script
        mt = 2048
        _, kc, vc = make_slot(s, mt, 0)
        cos, sin = rope_tables(LLAMA_ROPE, s["d"], mt)
        micro = micro_gemv(X, model, s, kc, vc, cos.cuda().bfloat16(), sin.cuda().bfloat16())
        R["llama8b_micro"] = micro
        del kc, vc
    V = variants(X, micro)
    R["llama8b_variants"] = {}
    ctx = 1024
    slot = make_slot(s, ctx + 1024, ctx)
    roof = (wbytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3
    for name, opts in list(V.items()) * 2:  # two passes, best of both: run-to-run spread is ~1%
        try:
            ms = step_timing(X, model, s, ctx, opts, slot=slot)
            if name in R["llama8b_variants"] and "ms" in R["llama8b_variants"][name]:
                ms = min(ms, R["llama8b_variants"][name]["ms"])
            R["llama8b_variants"][name] = {"ms": ms, "tok_s": 1e3 / ms, "frac_roofline": roof / ms,
                                           "backends": opts.backends, "tiles": {k: list(v) for k, v in opts.tiles.items()}}
            log(f"  step {name:22s} {ms:.3f} ms  {1e3 / ms:6.1f} tok/s  {roof / ms:.1%} of roofline")
        except Exception:
            R["llama8b_variants"][name] = {"error": traceback.format_exc()[-600:]}
            log(f"  step {name} FAILED\n{traceback.format_exc()[-1500:]}")
    ok = {k: v for k, v in R["llama8b_variants"].items() if "ms" in v}
    if not ok:
        return
    best = min(ok, key=lambda k: ok[k]["ms"])
    R["llama8b_best_variant"] = best
    R["llama8b_ctx1k_tok_s"] = ok[best]["tok_s"]
    R["llama8b_ctx1k_frac_roofline"] = ok[best]["frac_roofline"]
    R["llama8b_ctx1k_roofline_tok_s"] = 1e3 / roof
    # the weights+KV roofline counts every parameter (the 1.05 GB embedding table too, of which a step reads
    # one row): 16.06 GB + KV; the fields above count only the bytes a step reads (stricter)
    all_bytes = wbytes - model.embed[0].numel() * 2 + model.embed.numel() * 2
    R["llama8b_all_params_GB"] = all_bytes / 1e9
    roof_all = (all_bytes + kv_bytes(s, 1024)) / (bw * 1e12) * 1e3
    R["llama8b_ctx1k_frac_roofline_all_params"] = roof_all / ok[best]["ms"]
    del slot
    if "diag" in parts:
        try:
            from decode_gpu_checks import diagnose
            R["llama8b_diagnose"] = d = diagnose(X, model, s)
            log("  diagnose: " + json.dumps(d)[:3000])
        except Exception:
            log(traceback.format_exc()[-1500:])
    if "correct" in parts:
        for name in dict.fromkeys([best, "triton_all"]):
            try:
                R.setdefault("llama8b_correctness", {})[name] = c = correctness(X, model, s, ctx, V[name])
                log(f"  correctness {name}: {c}")
            except Exception:
                R.setdefault("llama8b_correctness", {})[name] = {"error": traceback.format_exc()[-600:]}
                log(traceback.format_exc()[-1500:])
        try:  # greedy margins like a trained model's: a planted next-token map on top of the random head
            saved = plant_successor(model, s)
            R["llama8b_correctness_successor"] = c3 = correctness(X, model, s, ctx, V[best])
            log(f"  correctness {best} on the successor model: {c3}")
            model.lm_head.copy_(saved)
            del saved
        except Exception:
            log(traceback.format_exc()[-1500:])
        try:  # the same check on a chaotic (unit-init) model: teacher-forced, mismatches are near-ties
            m2 = build_llama(X, s, seed=11, init="unit")
            R["llama8b_correctness_unit_init"] = c2 = correctness(X, m2, s, ctx, V[best])
            log(f"  correctness {best} on unit-init model: {c2}")
            del m2
        except Exception:
            log(traceback.format_exc()[-1500:])
        c = R["llama8b_correctness"].get(best, {})
        R["llama8b_tokens_identical"] = bool(c.get("tokens_identical"))
        R["llama8b_tokens_identical_successor_model"] = bool(R.get("llama8b_correctness_successor", {}).get("tokens_identical"))
        R["llama8b_logits_ok"] = bool(c.get("logits_ok"))
    if "ctx" in parts:
        for ctx in (8192, 32768):
            try:
                ms = step_timing(X, model, s, ctx, V[best], max_tokens=ctx + 512)
                roof = (wbytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3
                R[f"llama8b_ctx{ctx // 1024}k_tok_s"] = 1e3 / ms
                R[f"llama8b_ctx{ctx // 1024}k_frac_roofline"] = roof / ms
                log(f"  ctx {ctx}: {ms:.3f} ms {1e3 / ms:.1f} tok/s {roof / ms:.1%} of roofline")
            except Exception:
                log(traceback.format_exc()[-1500:])
    del model
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="copy,micro,llama,correct,hf,ctx,mla,sampled")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_gpu.json"))
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False
    X = load_cuda_pkg()
    R: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    R["triton"] = triton.__version__
    t_start = time.time()

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(R, indent=1, default=str))

    if "copy" in parts:
        R["copy_bw_TBps"] = copy_bandwidth()
        log(f"copy bandwidth {R['copy_bw_TBps']:.3f} TB/s")
    if "hf" in parts:
        try:
            R.update(hf_graph(LLAMA8B, 1024))
            log(f"HF static cache + graph: {R['hf_graph_tok_s']:.1f} tok/s (eager {1e3 / R['hf_eager_ms']:.1f})")
        except Exception:
            R["hf_error"] = traceback.format_exc()[-800:]
            log(R["hf_error"])
        save()
    if "llama" in parts:
        run_llama(X, parts, R)
        save()
    if "mla" in parts:
        try:
            from decode_gpu_mla import run_mla  # bench/ is on sys.path when run as a script
            run_mla(X, R)
        except Exception:
            R["mla_error"] = traceback.format_exc()[-1500:]
            log(R["mla_error"])
        save()
    if "mlafp8kv" in parts:
        try:
            from decode_gpu_mla import run_mla_fp8kv  # bench/ is on sys.path when run as a script
            run_mla_fp8kv(X, R)
        except Exception:
            R["mlafp8kv_error"] = traceback.format_exc()[-1500:]
            log(R["mlafp8kv_error"])
        save()
    if "dsv3" in parts:
        try:
            from decode_gpu_mla import run_dsv3  # bench/ is on sys.path when run as a script
            run_dsv3(X, R)
        except Exception:
            R["dsv3_error"] = traceback.format_exc()[-1500:]
            log(R["dsv3_error"])
        save()
    if "dsv3fp8" in parts:
        try:
            from decode_gpu_mla import run_dsv3_fp8  # bench/ is on sys.path when run as a script
            run_dsv3_fp8(X, R)
        except Exception:
            R["dsv3fp8_error"] = traceback.format_exc()[-1500:]
            log(R["dsv3fp8_error"])
        save()
    if "dsv32" in parts:
        try:
            from decode_gpu_mla import run_dsv32  # bench/ is on sys.path when run as a script
            run_dsv32(X, R)
        except Exception:
            R["dsv32_error"] = traceback.format_exc()[-1500:]
            log(R["dsv32_error"])
        save()
    if "sampled" in parts:
        try:
            from decode_gpu_sampling import run_sampled  # bench/ is on sys.path when run as a script
            run_sampled(X, R)
        except Exception:
            R["sampled_error"] = traceback.format_exc()[-1500:]
            log(R["sampled_error"])
        save()
    if "batch" in parts:
        try:
            from decode_gpu_batch import run_batch  # bench/ is on sys.path when run as a script
            run_batch(X, R)
        except Exception:
            R["batch_error"] = traceback.format_exc()[-1500:]
            log(R["batch_error"])
        save()
    if "qwen" in parts:
        try:
            sys.path.insert(0, str(ROOT))
            os.environ.setdefault("QWEN_VARIANTS", "default")
            from decode_engine_qwen import bench_cuda_qwen  # bench/ is on sys.path when run as a script

            bandwidth = R["copy_bw_TBps"] * 1e12 if "copy_bw_TBps" in R else None
            bench_cuda_qwen(128, 1024, R, save, bandwidth=bandwidth)
        except Exception:
            R["qwen_error"] = traceback.format_exc()[-1500:]
            log(R["qwen_error"])
        save()
    if "hf_graph_tok_s" in R and "llama8b_ctx1k_tok_s" in R:
        R["speedup_vs_hf_graph"] = R["llama8b_ctx1k_tok_s"] / R["hf_graph_tok_s"]
    R["wall_s"] = time.time() - t_start
    save()
    log("\n| metric | value |\n| --- | --- |")
    for k, v in R.items():
        if not isinstance(v, (dict, list)):
            log(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
