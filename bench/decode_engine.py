"""Decode-engine throughput: tokens/s per model family on CPU (the project's tiny models) and, with
CUDA, a Llama-3-8B-shaped model in bf16 with random weights next to HF transformers (static cache
+ CUDA graph) in the same run, as a fraction of the measured copy-bandwidth roofline.

On CUDA the engine is measured as the product runs it (``fast_path="auto"``: a lone greedy request
decodes on the fast path's CUDA graph, one token per step), with 8 tokens per step, and on its
reference step (``fast_path="off"``, CUDA graph and eager); the fast path's greedy tokens are
compared with the reference step's (``fast_matches_reference_tokens``: identical leading tokens;
bf16 random weights drift apart at near-ties, see bench/NOTES-gpu.md). Then a DeepSeek-V2-Lite-shaped
model cut to 8 layers (+ one MTP layer) the same way, without drafts and with 3 MTP drafts per step,
on the fast path and on the reference step (``cuda_mla``). Then Qwen2.5-7B and Qwen3-8B shapes
(bench/decode_engine_qwen.py: q/k/v bias, q/k norm) the same way, median of three passes, as a fraction
of the bytes-a-step-reads roofline, tokens compared with the reference step's on a model with trained-like
greedy margins (``cuda_qwen``; headline keys ``qwen25_7b_ctx1k_tok_s``, ``..._frac_roofline``,
``..._tokens_identical``, ``..._path``, and the same for ``qwen3_8b``).

    .venv/bin/python bench/decode_engine.py [--device auto|cpu|cuda] [--cuda-parts llama,mla,qwen] [--steps 128]
                                            [--context 1024] [--out PATH]

Prints a table and writes bench/results/decode_engine.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.decode.engine import Engine  # noqa: E402
from shared.events import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "decode_engine.json"
LLAMA3_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 128001, "bos_token_id": 128000,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_tokens_per_s(engine: Engine, prompt: list[int], steps: int, num_slots: int = 1, k: int = 0,
                        sampling: dict | None = None) -> dict:
    """Decode ``steps`` tokens per slot in ``num_slots`` slots after a warm-up; aggregate tokens/s,
    slot 0's tokens, the step paths taken ("fast" | "reference") in the measured pass, and the
    inter-token latency p50 (a step emitting m tokens: its time, then m - 1 zeros, as a stream sees
    them; slot 0's stream). ``sampling``: SamplingParams fields besides max_tokens (default greedy)."""
    extra = dict(ignore_eos=True, num_speculative_tokens=k, **(sampling or {}))
    for warm in (True, False):
        for slot in range(num_slots):  # each slot its own prompt (the first rotated): tokens and routing of their own
            first = int(engine.prefill(slot, prompt[slot:] + prompt[:slot]).argmax())
            engine.start(slot, first, SamplingParams(max_tokens=8 if warm else steps, **extra))
        sync(str(engine.device))
        t0, emitted, tokens, paths, itl, num_steps = time.perf_counter(), 0, [], set(), [], 0
        while engine.active_slots():
            num_steps += 1
            t_step = time.perf_counter()
            outs = engine.step()
            n = sum(len(o.token_ids) for o in outs.values())
            n0 = len(outs[0].token_ids) if 0 in outs else 0  # slot 0's stream: its inter-token gaps
            itl += [time.perf_counter() - t_step] + [0.0] * (n0 - 1) if n0 else []
            emitted += n
            tokens += outs[0].token_ids if 0 in outs else []
            paths.add(engine.last_step_path)
        sync(str(engine.device))
        elapsed = time.perf_counter() - t0
        stats = [engine.spec_stats(s) for s in range(num_slots)]
        for slot in range(num_slots):
            engine.release(slot)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {"tokens": emitted, "seconds": elapsed, "tokens_per_s": emitted / elapsed,
            "acceptance": accepted / drafted if drafted else None, "draft_tokens": drafted,
            "itl_p50_ms": statistics.median(itl) * 1e3 if itl else None, "token_ids": tokens,
            "step_ms": elapsed / num_steps * 1e3 if num_steps else None,
            "paths": sorted(paths)}


def hf_cpu_tokens_per_s(model_dir: Path, prompt: list[int], steps: int) -> float:
    """HF transformers eager decode with its dynamic cache (greedy), tokens/s."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        tok = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = hf(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return steps / (time.perf_counter() - t0)


def bench_cpu(steps: int) -> list[dict]:
    from infra.tinymodel import make_model

    rows = []
    prompt = [1] + list(range(20, 60))
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "qwen3", "deepseek_v3"):
            model_dir = make_model(arch, Path(tmp) / arch)
            hf = hf_cpu_tokens_per_s(model_dir, prompt, steps)
            spec_options = (0, 1, 2, 3) if arch == "deepseek_v3" else (0,)
            for k in spec_options:
                for num_slots in (1, 4) if k == 0 else (1,):
                    engine = Engine.load(model_dir, num_slots=num_slots, max_seq_len=512, dtype=torch.float32,
                                         num_speculative_tokens=k)
                    r = engine_tokens_per_s(engine, prompt, steps, num_slots, k)
                    rows.append({"device": "cpu", "model": f"tiny-{arch}", "dtype": "float32", "slots": num_slots,
                                 "fast_path": engine.fast_path_reason or "on",
                                 "spec_k": k, "engine_tok_s": r["tokens_per_s"], "acceptance": r["acceptance"],
                                 "hf_tok_s": hf if (num_slots == 1 and k == 0) else None,
                                 "hf_kind": "eager dynamic cache"})
    return rows


def copy_bandwidth_bytes_per_s(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + written per second.

    CUDA: decode_gpu.copy_bandwidth, the one measure every GPU bench divides by (2 GiB, CUDA events, median of
    20 after warm-up). A host timer around a synchronised copy counts the launch and the sync too, and on a
    cold GPU read 3.95 TB/s where the event-timed copy read 4.15 on the same H200 in the same call (run N2):
    a roofline that low flatters every fraction. CPU: best of 10 by the host clock."""
    if torch.device(device).type == "cuda":
        from decode_gpu import copy_bandwidth  # bench/ is on sys.path

        return copy_bandwidth() * 1e12
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _hf_graph_tokens_per_s(hf, prompt: list[int], steps: int, device: str) -> tuple[float, str]:
    """HF transformers with its StaticCache, the one-token forward captured in a CUDA graph."""
    from transformers import StaticCache

    n = len(prompt)
    try:
        cache = StaticCache(config=hf.config, max_cache_len=n + steps + 8)
    except TypeError:  # older transformers
        cache = StaticCache(config=hf.config, max_batch_size=1, max_cache_len=n + steps + 8, device=device,
                            dtype=hf.dtype)
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True,
                 cache_position=torch.arange(n, device=device))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([n], device=device)

        def one():
            logits = hf(tok, past_key_values=cache, use_cache=True, cache_position=pos, position_ids=pos[None]).logits
            return logits[:, -1].argmax(-1, keepdim=True)

        kind = "static cache + CUDA graph"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    one()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                nxt = one()

            def run_step():
                graph.replay()
                tok.copy_(nxt)
                pos.add_(1)
        except Exception as e:  # noqa: BLE001 - report what ran
            kind = f"static cache, eager (graph capture failed: {type(e).__name__})"

            def run_step():
                tok.copy_(one())
                pos.add_(1)

        for _ in range(3):
            run_step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        sync(device)
        return steps / (time.perf_counter() - t0), kind


def bench_cuda(steps: int, context: int) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    device, dtype = "cuda", torch.bfloat16
    bandwidth = copy_bandwidth_bytes_per_s(device)
    config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device(device):
        try:
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        except TypeError:  # older transformers
            hf = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    kv_bytes_per_token = 2 * 32 * 8 * 128 * 2
    roofline = bandwidth / (weight_bytes + context * kv_bytes_per_token)
    prompt = [int(t) for t in torch.randint(0, 128000, (context,), generator=torch.Generator().manual_seed(0))]

    def measure(n: int, **options) -> tuple[dict, str | None]:
        engine = Engine.from_hf_tensors(LLAMA3_8B, hf.state_dict(), max_seq_len=context + steps + 16, device=device,
                                        dtype=dtype, model_name="llama3-8b-shape", **options)
        r, reason = engine_tokens_per_s(engine, prompt, n), engine.fast_path_reason
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        return r, reason

    fast, reason = measure(steps)  # the product's default: fast_path="auto"
    fast8, _ = measure(steps, fast_path="auto", fast_path_tokens_per_step=8)
    graph, _ = measure(steps, fast_path="off")
    eager, _ = measure(min(steps, 32), fast_path="off", use_cuda_graphs=False)
    same = next((i for i, (a, b) in enumerate(zip(fast["token_ids"], graph["token_ids"])) if a != b),
                min(len(fast["token_ids"]), len(graph["token_ids"])))
    theirs, kind = _hf_graph_tokens_per_s(hf, prompt, steps, device)
    ours = fast["tokens_per_s"]
    return {"device": torch.cuda.get_device_name(), "model": "llama3-8b-shape (random)", "dtype": "bfloat16",
            "context": context, "copy_bandwidth_tb_s": bandwidth / 1e12, "weight_gb": weight_bytes / 1e9,
            "roofline_tok_s": roofline, "fast_path": reason or "on", "engine_paths": fast["paths"],
            "engine_tok_s": ours, "engine_fraction": ours / roofline,
            "engine_fast_8_per_step_tok_s": fast8["tokens_per_s"], "engine_fast_8_per_step_paths": fast8["paths"],
            "engine_reference_graph_tok_s": graph["tokens_per_s"], "engine_eager_tok_s": eager["tokens_per_s"],
            "fast_matches_reference_tokens": same, "compared_tokens": len(graph["token_ids"]),
            "hf_tok_s": theirs, "hf_kind": kind, "hf_fraction": theirs / roofline}


DSV2_LITE_8L = {  # DeepSeek-V2-Lite's layer shape (no q LoRA, one routing group), 8 layers + 1 MTP layer
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eos_token_id": 1, "bos_token_id": 0, "hidden_act": "silu",
}


def bench_cuda_mla(steps: int, context: int) -> dict:
    """The DeepSeek-family fast path through the Engine API: plain and MTP (k = 3) greedy decode on the fast
    path vs the reference step, random bf16 weights (an MTP layer copied from the last block: random drafts
    are rarely accepted, so this measures the path, not a speed-up)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    device, dtype, cfg = "cuda", torch.bfloat16, DSV2_LITE_8L
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    tensors = dict(hf.state_dict())
    last, idx, h = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"], cfg["hidden_size"]
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            tensors[name.replace(f"layers.{last}.", f"layers.{idx}.")] = t
    p = f"model.layers.{idx}."
    tensors.update({p + "enorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "hnorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "eh_proj.weight": torch.randn(h, 2 * h, device=device, dtype=dtype) * 0.02,
                    p + "shared_head.norm.weight": tensors["model.norm.weight"],
                    p + "shared_head.head.weight": tensors["lm_head.weight"],
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"]})
    del hf
    prompt = [int(t) for t in torch.randint(2, 102000, (context,), generator=torch.Generator().manual_seed(0))]
    out: dict = {"device": torch.cuda.get_device_name(), "model": "deepseek-v2-lite-shape, 8 layers (random)",
                 "dtype": "bfloat16", "context": context}
    sampled = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=3)
    drafting = {k: v for k, v in sampled.items() if k != "repetition_penalty"}  # penalties never draft
    # (name, drafts, fast path mode, engine options, sampling): random MTP weights, so drafts are (almost)
    # never accepted: fast_mtp3 (adaptive drafting, the default) against fast (no drafts) is what
    # speculation costs a request it does not help; fast_mtp3_every_step drafts regardless
    for name, k, mode, opts, sp in (("fast", 0, "auto", {}, None), ("fast_mtp3", 3, "auto", {}, None),
                                    ("fast_mtp3_every_step", 3, "auto", {"adaptive_speculation": False}, None),
                                    ("fast_sampled", 0, "auto", {}, sampled),
                                    # speculative sampling: every step drafts (the step's own cost), the
                                    # default adaptive drafting, and the reference step that served such
                                    # requests before, against plain sampled steps
                                    ("fast_mtp3_every_step_sampled", 3, "auto", {"adaptive_speculation": False},
                                     drafting),
                                    ("fast_mtp3_sampled", 3, "auto", {}, drafting),
                                    ("fast_sampled_no_penalty", 0, "auto", {}, drafting),
                                    ("reference_graph_mtp3_sampled", 3, "off", {}, drafting),
                                    ("reference_graph", 0, "off", {}, None),
                                    ("reference_graph_mtp3", 3, "off", {}, None),
                                    # four requests at once: one batched step of the four slots (MlaBatchDecoder)
                                    # against one slot's step, and the reference step batching the same four
                                    ("fast_4slots", 0, "auto", {"num_slots": 4}, None),
                                    ("reference_graph_4slots", 0, "off", {"num_slots": 4}, None),
                                    # ... each slot verifying one draft a step in the batched step (never
                                    # accepted here: the batched drafting step's own cost)
                                    ("fast_4slots_mtp1_every_step", 1, "auto",
                                     {"num_slots": 4, "adaptive_speculation": False}, None),
                                    # ... the same four sampling: speculative sampling in the batched step
                                    ("fast_4slots_mtp1_every_step_sampled", 1, "auto",
                                     {"num_slots": 4, "adaptive_speculation": False}, drafting),
                                    # adaptive drafting's plain steps without the MTP layer's row each
                                    # (FastPath.MTP_ROWS off): what keeping the draft layer's cache costs
                                    ("fast_mtp3_no_mtp_rows", 3, "auto", {"mtp_rows": False}, None)):
        from services.decode.engine import fastpath

        opts = dict(opts)
        fastpath.FastPath.MTP_ROWS = opts.pop("mtp_rows", True)
        engine = Engine.from_hf_tensors(cfg, tensors, max_seq_len=context + steps + 16, device=device, dtype=dtype,
                                        model_name="dsv2-lite-shape", num_speculative_tokens=k, fast_path=mode,
                                        **opts)
        r = engine_tokens_per_s(engine, prompt, steps, num_slots=opts.get("num_slots", 1), k=k, sampling=sp)
        fastpath.FastPath.MTP_ROWS = True
        out[name] = {"tok_s": r["tokens_per_s"], "paths": r["paths"], "acceptance": r["acceptance"],
                     "draft_tokens": r["draft_tokens"], "itl_p50_ms": r["itl_p50_ms"], "step_ms": r["step_ms"],
                     "fast_path": engine.fast_path_reason or "on"}
        print(f"  mla {name:<28} {r['tokens_per_s']:7.1f} tok/s  ITL p50 {r['itl_p50_ms']:.3f} ms  step "
              f"{r['step_ms']:.3f} ms  drafts {r['draft_tokens']}  acceptance {r['acceptance']}  paths {r['paths']}",
              flush=True)
        out[f"{name}_tokens"] = r["token_ids"]
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    out["dsv2lite_unaccepted_spec_itl_ratio"] = out["fast_mtp3"]["itl_p50_ms"] / out["fast"]["itl_p50_ms"]
    out["dsv2lite_unaccepted_spec_itl_ratio_every_step"] = (out["fast_mtp3_every_step"]["itl_p50_ms"]
                                                            / out["fast"]["itl_p50_ms"])
    out["dsv2lite_unaccepted_spec_itl_ratio_no_mtp_rows"] = (out["fast_mtp3_no_mtp_rows"]["itl_p50_ms"]
                                                             / out["fast"]["itl_p50_ms"])
    out["dsv2lite_batch4_mtp1_step_ratio"] = out["fast_4slots_mtp1_every_step"]["step_ms"] / out["fast_4slots"]["step_ms"]
    out["dsv2lite_batch4_mtp1_sampled_over_greedy_step"] = (out["fast_4slots_mtp1_every_step_sampled"]["step_ms"]
                                                            / out["fast_4slots_mtp1_every_step"]["step_ms"])
    out["dsv2lite_sampled_over_greedy"] = out["fast_sampled"]["tok_s"] / out["fast"]["tok_s"]
    # a k = 3 step drafting and verifying with sampling over the same step greedy; the default (adaptive)
    # sampled request with drafts on the fast path over the reference step, and over plain sampled steps
    out["dsv2lite_spec_sampled_step_ratio"] = (out["fast_mtp3_every_step_sampled"]["step_ms"]
                                               / out["fast_mtp3_every_step"]["step_ms"])
    out["dsv2lite_spec_sampled_over_reference"] = (out["fast_mtp3_sampled"]["tok_s"]
                                                   / out["reference_graph_mtp3_sampled"]["tok_s"])
    out["dsv2lite_spec_sampled_over_plain_sampled"] = (out["fast_mtp3_sampled"]["tok_s"]
                                                       / out["fast_sampled_no_penalty"]["tok_s"])
    # four slots a step (aggregate tok/s over 4 x steps tokens): its step time over one slot's, and over the
    # reference step's four-slot batch
    out["dsv2lite_engine_batch4_step_ratio"] = out["fast_4slots"]["step_ms"] / out["fast"]["step_ms"]
    out["dsv2lite_engine_batch4_over_reference"] = (out["fast_4slots"]["tok_s"]
                                                    / out["reference_graph_4slots"]["tok_s"])
    out["dsv2lite_engine_batch4_over_one_slot_tok_s"] = out["fast_4slots"]["tok_s"] / out["fast"]["tok_s"]
    for name in ("fast_sampled", "fast_mtp3_every_step_sampled", "fast_mtp3_sampled", "fast_sampled_no_penalty",
                 "reference_graph_mtp3_sampled", "fast_4slots", "reference_graph_4slots",
                 "fast_4slots_mtp1_every_step", "fast_4slots_mtp1_every_step_sampled", "fast_mtp3_no_mtp_rows"):
        out.pop(f"{name}_tokens")
    ref = out["reference_graph_tokens"]
    for name in ("fast", "fast_mtp3", "fast_mtp3_every_step", "reference_graph_mtp3"):
        toks = out.pop(f"{name}_tokens")
        out[name]["tokens_equal_reference_prefix"] = next(
            (i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
    out.pop("reference_graph_tokens")
    return out


def _fmt(x, spec="{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=128, help="decode steps per measurement")
    parser.add_argument("--context", type=int, default=1024, help="prompt length of the CUDA measurement")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="cpu: tiny models only; cuda: the Llama-3-8B shape only; auto: both, CUDA when present")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    parser.add_argument("--cuda-parts", default="llama,mla,qwen",
                        help="CUDA measurements: llama (Llama-3-8B shape + HF), mla (DeepSeek shape), qwen (Qwen shapes)")
    args = parser.parse_args(argv)
    args.skip_cpu, args.skip_cuda = args.device == "cuda", args.device == "cpu"
    torch.set_num_threads(args.threads)
    result = {"machine": platform.platform(), "torch": torch.__version__, "threads": args.threads, "cpu": [], "cuda": None}
    if not args.skip_cpu:
        result["cpu"] = bench_cpu(args.steps)
        print(f"{'model':<18}{'slots':>6}{'spec k':>7}{'engine tok/s':>14}{'accept':>8}{'HF tok/s':>10}")
        for r in result["cpu"]:
            print(f"{r['model']:<18}{r['slots']:>6}{r['spec_k']:>7}{_fmt(r['engine_tok_s']):>14}"
                  f"{_fmt(r['acceptance'], '{:.2f}'):>8}{_fmt(r['hf_tok_s']):>10}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
    cuda_parts = set(args.cuda_parts.split(","))
    if torch.cuda.is_available() and not args.skip_cuda and "llama" in cuda_parts:
        c = result["cuda"] = bench_cuda(args.steps, args.context)
        print(f"\n{c['device']}: {c['model']} {c['dtype']}, context {c['context']}, copy bandwidth "
              f"{c['copy_bandwidth_tb_s']:.2f} TB/s, roofline {c['roofline_tok_s']:.0f} tok/s (weights + KV)")
        print(f"{'':<34}{'tok/s':>8}{'of roofline':>13}")
        rows = [(f"engine, {'/'.join(c['engine_paths'])} path", c["engine_tok_s"]),
                ("engine, 8 tokens per step", c["engine_fast_8_per_step_tok_s"]),
                ("engine reference step (CUDA graph)", c["engine_reference_graph_tok_s"]),
                ("engine reference step (eager)", c["engine_eager_tok_s"])]
        for name, tok_s in rows:
            print(f"{name:<34}{tok_s:>8.1f}{tok_s / c['roofline_tok_s']:>12.0%}")
        print(f"{'HF ' + c['hf_kind'][:31]:<34}{c['hf_tok_s']:>8.1f}{c['hf_fraction']:>12.0%}")
        print(f"fast path: {c['fast_path']}; greedy tokens equal to the reference step's for the first "
              f"{c['fast_matches_reference_tokens']} of {c['compared_tokens']}")
    if torch.cuda.is_available() and not args.skip_cuda and "mla" in cuda_parts:
        try:
            m = result["cuda_mla"] = bench_cuda_mla(args.steps, args.context)
            print(f"\n{m['device']}: {m['model']} {m['dtype']}, context {m['context']}")
            for name in ("fast", "fast_mtp3", "reference_graph", "reference_graph_mtp3"):
                r = m[name]
                print(f"  engine {name:<22}{r['tok_s']:>8.1f} tok/s  paths {'/'.join(r['paths'])}  acceptance "
                      f"{_fmt(r['acceptance'], '{:.2f}')}  tokens = reference for "
                      f"{r.get('tokens_equal_reference_prefix', '-')}")
        except Exception as e:  # noqa: BLE001 - the Llama numbers above still count
            import traceback
            result["cuda_mla_error"] = traceback.format_exc()[-2000:]
            print(f"DeepSeek-family engine measurement failed: {e!r}\n{result['cuda_mla_error']}")
    if torch.cuda.is_available() and not args.skip_cuda and "qwen" in cuda_parts:
        from decode_engine_qwen import bench_cuda_qwen  # bench/ is on sys.path when run as a script

        args.out.parent.mkdir(parents=True, exist_ok=True)
        bench_cuda_qwen(args.steps, args.context, result,
                        save=lambda: args.out.write_text(json.dumps(result, indent=2) + "\n"))
        for key in ("qwen25_7b", "qwen3_8b", "llama3_8b"):
            ctx = f"{key}_ctx{args.context // 1024}k"
            if f"{ctx}_tok_s" in result:
                print(f"  {key:<10} {result[f'{ctx}_tok_s']:7.1f} tok/s  {result[f'{ctx}_frac_roofline']:.1%} of the "
                      f"bytes-read roofline  path {result[f'{key}_path']}  tokens identical to the reference step: "
                      f"{result[f'{key}_tokens_identical']}  (reference step {result[f'{key}_reference_tok_s']:.1f} tok/s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
