"""Sampling on the fast path at the Llama-3-8B shape: bench/decode_gpu.py's part "sampled".

- ``kernel_check``: the sampling kernels (cuda/sampling.py, in a CUDA graph) against the reference
  sampler (engine/sampling.py) on the same float32 logits over the whole 128256-id vocabulary, a table
  of parameter sets x consecutive positions: equal tokens, the kernels' modes, us per sampled token.
- ``decoder_timing``: one slot's decoder, its greedy step and its sampled step (temperature 0.7, top_p
  0.9, top_k 50, min_p 0.05, repetition_penalty 1.1), each 8 steps per CUDA-graph replay, ms/token.
- ``engine_timing`` (where the engine package imports: it needs msgspec): ``Engine`` with
  ``fast_path="auto"`` over the same weights, one greedy then one sampled request of 128 tokens after a
  1K prompt, tok/s and the path each step took; the sampled request's seeded tokens against the
  reference step's (``fast_path="off"``): identical leading tokens (the two paths' logits differ in
  float rounding, so a random bf16 model drifts apart at near-ties as greedy does).
- ``extras_timing`` (part "extras", ``python bench/decode_gpu_sampling.py --parts extras``): one slot
  through the Engine API, 128 tokens after a 1K prompt: plain greedy, logprobs=5, a json_schema
  grammar (xgrammar over a synthetic 128256-token vocabulary: the host has no tokenizer files) and
  both; tok/s, the path each took, the host's mask fill per token (``*_over_plain``: the ratios).
"""

from __future__ import annotations

import gc
import time
import traceback

import torch

from decode_gpu import LLAMA_ROPE, ROOT, build_llama, capture, log, make_slot, rope_tables, time_graph

SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1)


def kernel_cases(S, vocab: int) -> list[tuple[str, object]]:
    return [
        ("bench_mix", S.RequestSampling(**SAMPLED, seed=1, prompt_ids=list(range(0, 2000, 7)))),
        ("temperature", S.RequestSampling(temperature=1.0, seed=2)),
        ("top_k_only", S.RequestSampling(temperature=0.8, top_k=40, seed=3)),
        ("top_p_only", S.RequestSampling(temperature=1.0, top_p=0.9, seed=4)),
        ("top_k_5000", S.RequestSampling(temperature=1.0, top_k=5000, seed=8)),
        ("min_p_only", S.RequestSampling(temperature=1.0, min_p=0.1, seed=5)),
        ("penalties_bias_bad_words", S.RequestSampling(
            temperature=0.9, top_k=20, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
            logit_bias={11: 3.0, 12: -50.0}, bad_words=[[7, 7], [9], [5, 100, 101]], prompt_ids=[3, 4, 5], seed=6)),
        ("greedy_penalties", S.RequestSampling(temperature=0.0, repetition_penalty=1.5, prompt_ids=[1, 2], seed=7)),
    ]


def kernel_check(X, engine_sampling, vocab: int, steps: int = 8) -> dict:
    """Kernels vs the reference sampler on identical logits; graph-timed us per sampled token."""
    S, K = X.sampling_state, X.sampling
    out: dict = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, req in kernel_cases(S, vocab):
        bufs = S.SamplingBuffers(1, vocab, "cuda")
        history, pos0 = [7, 7, 5], 1000
        bufs.arm(0, req, history, pos0 + 1)
        fs = K.FastSampler(bufs.row(0), vocab, "cuda")
        ref = engine_sampling.ReferenceSampler(bufs)
        token, step = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
        outs = torch.zeros(steps + 64, dtype=torch.int64, device="cuda")
        pos = torch.tensor([pos0], dtype=torch.int32, device="cuda")
        logits = torch.empty(vocab, device="cuda")
        got, exp, modes = [], [], []
        for t in range(steps):
            logits.normal_(generator=gen).mul_(2.0)
            for j, tok in enumerate(history[-3:]):
                logits[tok] = logits.max() + 0.25 * j  # the processors' tokens on top
            banned = [S.banned_ids(req.bad_words, history)]
            exp.append(int(ref.tokens(logits[None].clone(), torch.tensor([0], device="cuda"),
                                      torch.tensor([pos0 + 1 + t], device="cuda"), req.flags, banned)[0]))
            fs.finish(logits, token, outs, step, pos)
            got.append(int(token))
            modes.append("greedy" if req.greedy else ("all", "cand", "over")[fs.mode])
            history.append(got[-1])
        # timing: the kernels alone in a graph (the row's state advances; the tokens are not checked here)
        g = capture(lambda: fs.finish(logits, token, outs, step, pos))
        pos.fill_(pos0)
        step.zero_()
        us = time_graph(g, iters=30, warmup=3) * 1e3
        out[name] = {"equal": got == exp, "mismatches": sum(a != b for a, b in zip(got, exp)), "modes": modes,
                     "us_per_token": us}
        log(f"  sampling kernels {name:26s} equal={got == exp} modes={sorted(set(modes))} {us:.1f} us/token")
        del g, fs, bufs
    return out


def decoder_timing(X, model, s: dict, ctx: int = 1024) -> dict:
    """ms/token of one decoder's greedy and sampled graphs (8 steps per replay), same weights and cache."""
    S = X.sampling_state
    max_tokens = ctx + 1024
    slot = make_slot(s, max_tokens, ctx)
    _, kc, vc = slot
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = X.GqaDecoder(model, kc, vc, cos, sin, X.FastOptions(), max_steps=max_tokens)
    bufs = S.SamplingBuffers(1, s["vocab"], "cuda")
    bufs.arm(0, S.RequestSampling(**SAMPLED, seed=1234, prompt_ids=list(range(1, ctx))), [1], ctx + 1)
    dec.attach_sampler(bufs.row(0))
    res = {}
    for name, fn in (("greedy", dec.step), ("sampled", lambda: dec.step(sample=True))):
        runner = capture(fn, 8, before_capture=lambda: dec.set_state(1, ctx))
        dec.set_state(1, ctx)
        ms = min(time_graph(runner, iters=40, warmup=3) / 8 for _ in range(2))
        res[f"{name}_ms"], res[f"{name}_tok_s"] = ms, 1e3 / ms
        del runner
    res["sampled_over_greedy"] = res["sampled_tok_s"] / res["greedy_tok_s"]
    res["sampled_modes_last"] = ("all", "cand", "over")[dec.sampler.mode]
    log(f"  decoder graphs: greedy {res['greedy_tok_s']:.1f} tok/s, sampled {res['sampled_tok_s']:.1f} tok/s "
        f"({res['sampled_over_greedy']:.4f}x)")
    del dec, slot
    return res


def hf_tensors(model, s: dict) -> dict[str, torch.Tensor]:
    """HF Llama names for the bench model's fused weights (views: no copies)."""
    hq, hkv, d, inter = s["hq"], s["hkv"], s["d"], s["inter"]
    t = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm,
         "lm_head.weight": model.lm_head}
    for i, l in enumerate(model.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = l.attn_norm
        t[p + "post_attention_layernorm.weight"] = l.mlp_norm
        t[p + "self_attn.q_proj.weight"] = l.wqkv[: hq * d]
        t[p + "self_attn.k_proj.weight"] = l.wqkv[hq * d: (hq + hkv) * d]
        t[p + "self_attn.v_proj.weight"] = l.wqkv[(hq + hkv) * d:]
        t[p + "self_attn.o_proj.weight"] = l.wo
        t[p + "mlp.gate_proj.weight"] = l.w_gate_up[:inter]
        t[p + "mlp.up_proj.weight"] = l.w_gate_up[inter:]
        t[p + "mlp.down_proj.weight"] = l.w_down
    return t


def hf_config(s: dict) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": s["vocab"],
            "hidden_size": s["hidden"], "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
            "num_attention_heads": s["hq"], "num_key_value_heads": s["hkv"], "head_dim": s["d"],
            "rms_norm_eps": s["eps"], "max_position_embeddings": 8192, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 128001,
            "bos_token_id": 128000, "rope_theta": LLAMA_ROPE["rope_theta"],
            "rope_scaling": {k: v for k, v in LLAMA_ROPE.items() if k != "rope_theta"}}


def _engine_run(engine, prompt: list[int], sp, steps: int) -> dict:
    from msgspec import structs

    for params in (structs.replace(sp, max_tokens=8), sp):
        first = int(engine.prefill(0, prompt).argmax())
        engine.start(0, first, params)
        torch.cuda.synchronize()
        t0, tokens, paths = time.perf_counter(), [first], set()
        while engine.active_slots():
            tokens += engine.step()[0].token_ids
            paths.add(engine.last_step_path)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        reason = engine.slot_fast_path_reason(0)
        engine.release(0)
    return {"tok_s": (len(tokens) - 1) / elapsed, "paths": sorted(paths), "tokens": tokens, "reason": reason}


def engine_timing(model, s: dict, ctx: int = 1024, steps: int = 128) -> dict:
    """Greedy and sampled requests through Engine(fast_path="auto"); sampled tokens vs fast_path="off"."""
    import sys

    sys.path.insert(0, str(ROOT))
    from services.decode.engine import Engine
    from shared.events import SamplingParams

    prompt = [int(t) for t in torch.randint(0, 128000, (ctx,), generator=torch.Generator().manual_seed(0))]
    greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
    sampled = SamplingParams(max_tokens=steps, ignore_eos=True, seed=1234, **SAMPLED)
    tensors, cfg = hf_tensors(model, s), hf_config(s)
    res: dict = {}
    for mode in ("auto", "off"):
        engine = Engine.from_hf_tensors(cfg, tensors, max_seq_len=ctx + steps + 16, device="cuda",
                                        dtype=torch.bfloat16, model_name="llama3-8b-shape", fast_path=mode)
        if mode == "auto":
            res["fast_path"] = engine.fast_path_reason or "on"
            g = _engine_run(engine, prompt, greedy, steps)
            smp = _engine_run(engine, prompt, sampled, steps)
            res.update(greedy_tok_s=g["tok_s"], greedy_paths=g["paths"], sampled_tok_s=smp["tok_s"],
                       sampled_paths=smp["paths"], sampled_reason=smp["reason"],
                       sampled_over_greedy=smp["tok_s"] / g["tok_s"])
            fast_tokens = smp["tokens"]
        else:
            ref = _engine_run(engine, prompt, sampled, steps)
            res.update(reference_sampled_tok_s=ref["tok_s"], reference_paths=ref["paths"])
            res["sampled_tokens_equal_reference_prefix"] = next(
                (i for i, (a, b) in enumerate(zip(fast_tokens, ref["tokens"])) if a != b),
                min(len(fast_tokens), len(ref["tokens"])))
            res["compared_tokens"] = len(ref["tokens"])
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    log(f"  engine: greedy {res['greedy_tok_s']:.1f} tok/s {res['greedy_paths']}, sampled {res['sampled_tok_s']:.1f} "
        f"tok/s {res['sampled_paths']} ({res['sampled_over_greedy']:.4f}x), reference sampled "
        f"{res['reference_sampled_tok_s']:.1f}; seeded tokens equal for {res['sampled_tokens_equal_reference_prefix']}"
        f"/{res['compared_tokens']}")
    return res


def run_sampled(X, R: dict) -> None:
    """Part "sampled" of decode_gpu.py: fills R's llama8b_sampled_* fields."""
    from decode_gpu import LLAMA8B

    s = LLAMA8B
    engine_sampling = None
    try:
        import sys

        sys.path.insert(0, str(ROOT))
        import services.decode.engine.sampling as engine_sampling  # noqa: F811
    except Exception:  # noqa: BLE001 - the kernel check needs the engine package (msgspec)
        R["llama8b_sampling_engine_import_error"] = traceback.format_exc()[-400:]
    if engine_sampling is not None:
        try:
            R["llama8b_sampling_kernel_check"] = kc = kernel_check(X, engine_sampling, s["vocab"])
            R["llama8b_sampling_kernels_equal_reference"] = all(v["equal"] for v in kc.values())
        except Exception:  # noqa: BLE001
            R["llama8b_sampling_kernel_check_error"] = traceback.format_exc()[-1500:]
            log(R["llama8b_sampling_kernel_check_error"])
    model = build_llama(X, s)
    try:
        R["llama8b_sampled_decoder"] = d = decoder_timing(X, model, s)
        R["llama8b_sampled_tok_s"], R["llama8b_greedy_same_run_tok_s"] = d["sampled_tok_s"], d["greedy_tok_s"]
        R["llama8b_sampled_over_greedy"] = d["sampled_over_greedy"]
        R["llama8b_sampled_path"] = "decoder CUDA graph (8 steps per replay)"
    except Exception:  # noqa: BLE001
        R["llama8b_sampled_decoder_error"] = traceback.format_exc()[-1500:]
        log(R["llama8b_sampled_decoder_error"])
    if engine_sampling is not None:
        try:
            R["llama8b_sampled_engine"] = e = engine_timing(model, s)
            R["llama8b_sampled_tok_s"], R["llama8b_greedy_same_run_tok_s"] = e["sampled_tok_s"], e["greedy_tok_s"]
            R["llama8b_sampled_over_greedy"] = e["sampled_over_greedy"]
            R["llama8b_sampled_path"] = f"Engine API, fast_path=auto: {'/'.join(e['sampled_paths'])}"
        except Exception:  # noqa: BLE001
            R["llama8b_sampled_engine_error"] = traceback.format_exc()[-1500:]
            log(R["llama8b_sampled_engine_error"])
    del model
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- logprobs and grammars (part "extras")

EXTRAS_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "admin": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "admin", "tags", "address"]}


def synthetic_vocab(vocab: int, seed: int = 0) -> list[str]:
    """A Llama-3-sized vocabulary of word-like tokens (the GPU host has no tokenizer files): the
    printable characters, JSON pieces, then lowercase words of 2-10 letters, half with a leading
    space; the last 256 ids are special-looking strings."""
    import random

    rng = random.Random(seed)
    toks = [chr(i) for i in range(32, 127)] + ['{"', '":', '", "', '"}', ' "', "true", "false", "null", "\n", "  "]
    toks += [str(i) for i in range(10, 1000)]
    seen = set(toks)
    while len(toks) < vocab - 256:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10)))
        w = (" " + w) if rng.random() < 0.5 else w
        if w not in seen:
            seen.add(w)
            toks.append(w)
    return toks + [f"<|special_{i}|>" for i in range(256)]


def extras_timing(model, s: dict, ctx: int = 1024, steps: int = 128) -> dict:
    """Engine(fast_path="auto") at one slot: greedy without extras, with logprobs=5, with a json_schema
    grammar (xgrammar over a synthetic vocabulary), and both; tok/s, the paths, and the host time
    filling the grammar's mask per token."""
    import json
    import sys

    sys.path.insert(0, str(ROOT))
    import xgrammar as xgr

    from services.decode.engine import Engine
    from services.decode.engine import grammar as G
    from shared.events import SamplingParams, StructuredOutput

    prompt = [int(t) for t in torch.randint(0, 128000, (ctx,), generator=torch.Generator().manual_seed(0))]
    spec = StructuredOutput(kind="json", json_schema=json.dumps(EXTRAS_SCHEMA))
    cases = {"plain": SamplingParams(max_tokens=steps, ignore_eos=True),
             "logprobs5": SamplingParams(max_tokens=steps, ignore_eos=True, logprobs=5),
             "json_schema": SamplingParams(max_tokens=steps, structured=spec),
             "json_schema_logprobs5": SamplingParams(max_tokens=steps, structured=spec, logprobs=5)}
    engine = Engine.from_hf_tensors(hf_config(s), hf_tensors(model, s), max_seq_len=ctx + steps + 16, device="cuda",
                                    dtype=torch.bfloat16, model_name="llama3-8b-shape", fast_path="auto")
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(synthetic_vocab(s["vocab"]), vocab_type=xgr.VocabType.RAW, vocab_size=s["vocab"],
                             stop_token_ids=[128001])
    engine.grammars._compiler = xgr.GrammarCompiler(info, max_threads=8)
    compiled = engine.grammars.compile(spec)
    res: dict = {"fast_path": engine.fast_path_reason or "on", "tokenizer_info_and_compile_s": time.perf_counter() - t0}
    fill_s = [0.0, 0]
    fill = G.SlotGrammar.fill

    def timed_fill(self, bitmask, row):
        t = time.perf_counter()
        fill(self, bitmask, row)
        fill_s[0] += time.perf_counter() - t
        fill_s[1] += 1

    G.SlotGrammar.fill = timed_fill
    try:
        for rep in range(2):  # the first round captures each graph; the second is timed
            for name, sp in cases.items():
                logits = engine.prefill(0, prompt)[None].float()
                if sp.structured is not None:  # the prefill samples the first token under the grammar
                    m = xgr.GrammarMatcher(compiled)
                    mask = xgr.allocate_token_bitmask(1, s["vocab"])
                    m.fill_next_token_bitmask(mask)
                    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device))
                first = int(logits.argmax())
                engine.start(0, first, sp)
                torch.cuda.synchronize()
                fill_s[:] = [0.0, 0]
                t = time.perf_counter()
                tokens, paths, reason, lps = [first], set(), None, 0
                while engine.active_slots():
                    out = engine.step()[0]
                    tokens += out.token_ids
                    lps += len(out.logprobs or [])
                    reason = out.finish_reason
                    paths.add(engine.last_step_path)
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - t
                why = engine.slot_fast_path_reason(0)
                engine.release(0)
                if rep:
                    r = {"tok_s": (len(tokens) - 1) / elapsed, "tokens": len(tokens) - 1, "finish": reason,
                         "paths": sorted(paths), "fast_path_reason": why, "logprobs": lps,
                         "mask_fill_us_per_token": 1e6 * fill_s[0] / max(1, fill_s[1])}
                    res[name] = r
                    log(f"  extras {name:22s} {r['tok_s']:7.1f} tok/s over {r['tokens']} tokens ({reason}) "
                        f"paths={r['paths']} mask fill {r['mask_fill_us_per_token']:.1f} us/token")
    finally:
        G.SlotGrammar.fill = fill
    for name in ("logprobs5", "json_schema", "json_schema_logprobs5"):
        res[f"{name}_over_plain"] = res[name]["tok_s"] / res["plain"]["tok_s"]
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    """``python bench/decode_gpu_sampling.py --parts extras [--out PATH]``: this file's parts alone."""
    import argparse
    import json
    from pathlib import Path

    from decode_gpu import LLAMA8B, load_cuda_pkg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="extras")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_gpu_extras.json"))
    args = ap.parse_args(argv)
    X = load_cuda_pkg()
    R: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = set(args.parts.split(","))
    if "sampled" in parts:
        run_sampled(X, R)
    if "extras" in parts:
        model = build_llama(X, LLAMA8B)
        try:
            R["llama8b_extras"] = extras_timing(model, LLAMA8B)
        except Exception:  # noqa: BLE001
            R["llama8b_extras_error"] = traceback.format_exc()[-2500:]
            log(R["llama8b_extras_error"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(R, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
