"""Several slots in one fast-path step at the Llama-3-8B shape: bench/decode_gpu.py's part "batch".

- ``gemv_sweep``: the batched GEMV (cuda/batch.py ``rows_gemv``) per projection of the shape at 2 and 8
  rows, each accumulation mode and a few tiles, against cuBLAS and the one-token GEMV: us and GB/s.
- ``decoder_timing``: graph-timed ms per step at context 1K of the batch-1 decoder (cuda/llama.py) and
  of the batched decoder (cuda/batch.py) at 2, 4 and 8 rows, each row its own slot; 4 rows with the
  4 and 8 rows with the rope in the QKV GEMV's epilogue (``fused_rope_batch{4,8}_ms``:
  ``FastOptions(batch_fused_rope=True)``; the default is rope_rows after the GEMV), and the
  single and 4-row steps with the one-launch attention (``one_launch_*``: ``attn_one_launch=True``); a few tile choices of the batched GEMVs
  (``FastOptions.batch_tiles``) at 4 and 8 rows. ``DECODE_GPU_BATCH_SWEEP=0`` skips ``gemv_sweep``.
- ``engine_timing`` (where the engine package imports: it needs msgspec): ``Engine(fast_path="auto")``
  with 8 slots over the same weights, every slot's KV holding 1K random tokens; engine step time
  (``Engine.step``: one host sync per step) with 1, 4 and 8 active greedy slots, and 8 with half of them
  sampled (temperature 0.7, top_p 0.9, top_k 50, min_p 0.05):
  ``llama8b_batch4_step_ratio`` / ``llama8b_batch8_step_ratio`` = step time over the one-slot step's,
  the path each step took (``last_step_path``, ``last_step_slots``); and greedy tokens of 4 slots decoding
  together against each decoding alone (the model's lm_head given wide greedy margins:
  decode_gpu.plant_successor).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import replace

import torch

from decode_gpu import LLAMA_ROPE, ROOT, build_llama, capture, log, plant_successor, rope_tables, step_timing, \
    time_graph

SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05)  # (repetition_penalty needs a prefilled prompt)
TILE_VARIANTS = {  # (not timed by default: run S-B1 found none better than the defaults)
    "default": None,
    "n32_k128": {p: (32, 128, 4, 4) for p in ("qkv", "o", "gate_up", "down")} | {"lm_head": (32, 128, 4, 4)},
    "n16_k512_w8": {p: (16, 512, 8, 3) for p in ("qkv", "o", "gate_up", "down")} | {"lm_head": (16, 256, 4, 4)},
    "n16_k256_w8": {p: (16, 256, 8, 4) for p in ("qkv", "o", "gate_up", "down")} | {"lm_head": (16, 128, 4, 6)},
}


SHAPES = {"qkv": (6144, 4096, dict()), "o": (4096, 4096, dict(residual=True)),
          "gate_up": (28672, 4096, dict(silu=True)), "down": (4096, 14336, dict(residual=True)),
          "lm_head": (128256, 4096, dict())}  # the batched decoder normalises the rows in their own launch
GEMV_VARIANTS = [("swap", 1, (32, 128, 4, 6)), ("swap", 1, (32, 256, 4, 4)), ("swap", 1, (16, 128, 4, 6)),
                 ("swap", 1, (64, 64, 4, 8)), ("dot", 0, (16, 256, 4, 4)), ("fma", 2, (8, 128, 4, 4))]


def gemv_sweep(X, s: dict) -> dict:
    """us per launch (4 weight copies in one graph, median) of each variant per projection and row count."""
    from xl_cuda.batch import rows_gemv  # noqa: E402 (decode_gpu.load_cuda_pkg registered the package)
    from xl_cuda import gemv as G

    res: dict = {}
    dt, g = torch.bfloat16, torch.Generator(device="cuda").manual_seed(9)
    for name, (n, k, kw) in SHAPES.items():
        copies = 2 if name == "lm_head" else 4
        ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=g) * k ** -0.5 for _ in range(copies)]
        nw = torch.ones(k, device="cuda", dtype=dt)
        nbytes = n * k * 2
        for b in (2, 8):
            x = torch.randn(b, k, device="cuda", dtype=dt, generator=g)
            out = torch.zeros(b, n // 2 if kw.get("silu") else n, device="cuda",
                              dtype=torch.float32 if name == "lm_head" else dt)
            cands = [(f"{v}_{t[0]}x{t[1]}w{t[2]}s{t[3]}", v, m, t) for v, m, t in GEMV_VARIANTS]
            cands += [("cublas", "cublas", None, None)]
            if b == 2:
                cands += [("one_token", "one", None, None)]
            for label, v, mode, tile in cands:
                def fn():
                    for w in ws:
                        if v == "cublas":
                            torch.matmul(x, w.t(), out=out[:, : w.shape[0]] if not kw.get("silu") else None)
                        elif v == "one":
                            if kw.get("silu"):
                                G.gemv_silu(x[0], w, out[0], norm_w=nw, block_n=4, block_k=512, num_warps=4, stages=6)
                            else:
                                G.gemv(x[0], w, out[0], norm_w=nw if kw.get("norm") else None,
                                       residual=out[0] if kw.get("residual") else None, block_n=16, block_k=256,
                                       num_warps=4, stages=6)
                        else:
                            rows_gemv(x, w, out, norm_w=nw if kw.get("norm") else None,
                                      residual=out if kw.get("residual") else None, silu=kw.get("silu", False),
                                      block_n=tile[0], block_k=tile[1], num_warps=tile[2], stages=tile[3], mode=mode)
                try:
                    if v == "cublas" and kw.get("silu"):
                        continue
                    us = time_graph(capture(fn), iters=30, warmup=3) * 1e3 / copies
                    res[f"{name}_b{b}_{label}_us"] = us
                except Exception as e:  # noqa: BLE001
                    res[f"{name}_b{b}_{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
            best = sorted((v, key) for key, v in res.items() if key.startswith(f"{name}_b{b}_") and key.endswith("_us"))
            log(f"  gemv {name} b{b} ({nbytes / 1e6:.0f} MB): " + ", ".join(
                f"{key[len(name) + len(str(b)) + 3:-3]} {us:.1f}us ({nbytes / us / 1e6:.2f} TB/s)" for us, key in best[:6]))
        del ws
        torch.cuda.empty_cache()
    return res


def batch_step_ms(X, model, s: dict, batch: int, ctx: int, opts) -> float:
    """Graph-timed ms of one batched step, ``batch`` rows in slots 0..batch-1 at context ctx."""
    max_tokens = ctx + 256
    kv = torch.empty(s["layers"], 2, batch + 1, max_tokens, s["hkv"], s["d"], dtype=torch.bfloat16, device="cuda")
    kv.normal_(generator=torch.Generator(device="cuda").manual_seed(2))
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = X.GqaBatchDecoder(model, [kv[i, 0] for i in range(s["layers"])], [kv[i, 1] for i in range(s["layers"])],
                            cos, sin, batch, opts, max_steps=max_tokens)

    def arm():
        dec.set_rows([1 + r for r in range(batch)], [ctx] * batch, list(range(batch)))

    runner = capture(dec.step, 1, before_capture=arm)
    arm()
    ms = time_graph(runner, iters=40, warmup=3)
    del runner, dec, kv
    return ms


# A/B in the same run: the batched QKV with the rope in its epilogue (off by default: runs F2, B5), and the
# one-launch attention (FastOptions.attn_one_launch, off by default) on the single and the 4-row step
FUSED_ROPE = dict(batch_fused_rope=True)
NORM_FIRST = dict(norm_late=False)  # the RMSNorms before the GEMVs (the default folds them in: run N4)
ONE_LAUNCH = dict(attn_one_launch=True)


def decoder_timing(X, model, s: dict, ctx: int = 1024, sweep_tiles: bool = False) -> dict:
    opts = X.FastOptions()
    res = {"single_ms": step_timing(X, model, s, ctx, opts, steps_per_replay=1)}
    for b in (2, 4, 8):
        res[f"batch{b}_ms"] = batch_step_ms(X, model, s, b, ctx, opts)
        res[f"batch{b}_ratio"] = res[f"batch{b}_ms"] / res["single_ms"]
    log(f"  decoder graphs at {ctx}: single {res['single_ms']:.3f} ms, " + ", ".join(
        f"batch {b} {res[f'batch{b}_ms']:.3f} ms ({res[f'batch{b}_ratio']:.3f}x)" for b in (2, 4, 8)))
    for b in (4, 8):
        res[f"fused_rope_batch{b}_ms"] = batch_step_ms(X, model, s, b, ctx, replace(opts, **FUSED_ROPE))
    first = replace(opts, **NORM_FIRST)
    res["norm_first_single_ms"] = step_timing(X, model, s, ctx, first, steps_per_replay=1)
    for b in (4, 8):
        res[f"norm_first_batch{b}_ms"] = batch_step_ms(X, model, s, b, ctx, first)
        res[f"norm_first_batch{b}_ratio"] = res[f"norm_first_batch{b}_ms"] / res["norm_first_single_ms"]
    log(f"  norms before the GEMVs (norm_late=False): single {res['norm_first_single_ms']:.3f} ms, batch 4 "
        f"{res['norm_first_batch4_ms']:.3f} ({res['norm_first_batch4_ratio']:.3f}x), batch 8 "
        f"{res['norm_first_batch8_ms']:.3f} ({res['norm_first_batch8_ratio']:.3f}x)")
    one = replace(opts, **ONE_LAUNCH)
    res["one_launch_single_ms"] = step_timing(X, model, s, ctx, one, steps_per_replay=1)
    res["one_launch_batch4_ms"] = batch_step_ms(X, model, s, 4, ctx, one)
    log(f"  rope in the QKV epilogue (batch_fused_rope): batch 4 {res['fused_rope_batch4_ms']:.3f} ms, batch 8 "
        f"{res['fused_rope_batch8_ms']:.3f} ms; one-launch attention: "
        f"single {res['one_launch_single_ms']:.3f} ms, batch 4 {res['one_launch_batch4_ms']:.3f} ms")
    for name, tiles in TILE_VARIANTS.items() if sweep_tiles else ():
        if tiles is None:
            continue
        try:
            o = replace(opts, batch_tiles=tiles)
            for b in (4, 8):
                res[f"tiles_{name}_batch{b}_ms"] = ms = batch_step_ms(X, model, s, b, ctx, o)
                log(f"  tiles {name}: batch {b} {ms:.3f} ms ({ms / res['single_ms']:.3f}x)")
        except Exception:  # noqa: BLE001
            res[f"tiles_{name}_error"] = traceback.format_exc()[-600:]
            log(res[f"tiles_{name}_error"])
        gc.collect()
        torch.cuda.empty_cache()
    return res


def engine_timing(model, s: dict, ctx: int = 1024, steps: int = 48) -> dict:
    """Engine.step time with 1 / 4 / 8 active slots (module docstring), and batched vs alone tokens."""
    import sys

    sys.path.insert(0, str(ROOT))
    from decode_gpu_sampling import hf_config, hf_tensors
    from services.decode.engine import Engine
    from shared.events import SamplingParams

    engine = Engine.from_hf_tensors(hf_config(s), hf_tensors(model, s), num_slots=8, max_seq_len=ctx + 512,
                                    device="cuda", dtype=torch.bfloat16, model_name="llama3-8b-shape", fast_path="auto")
    res: dict = {"fast_path": engine.fast_path_reason or "on",
                 "batch_graphs": sorted(engine.fast_path.batches) if engine.fast_path is not None else []}
    g = torch.Generator(device="cuda").manual_seed(3)
    for slot in range(8):
        engine.slot_buffer(slot).view(torch.bfloat16).normal_(generator=g)

    def start(slot: int, sampled: bool, max_tokens: int):
        engine.inject(slot, ctx)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(dict(SAMPLED, seed=100 + slot) if sampled else {}))
        engine.start(slot, 1000 + 17 * slot, sp)

    def measure(n: int, n_sampled: int = 0) -> tuple[float, list]:
        for slot in range(n):
            start(slot, slot < n_sampled, 10_000)
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        t0, served = time.perf_counter(), set()
        for _ in range(steps):
            engine.step()
            served.add((engine.last_step_path, engine.last_step_slots))
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / steps * 1e3
        for slot in range(n):
            engine.cancel(slot)
            engine.release(slot)
        return ms, sorted(served)

    for n, n_sampled, key in ((1, 0, "step1"), (4, 0, "step4"), (8, 0, "step8"), (1, 1, "step1_sampled"),
                              (8, 4, "step8_half_sampled"), (1, 0, "step1_again")):
        res[f"{key}_ms"], res[f"{key}_paths"] = measure(n, n_sampled)
        log(f"  engine {key}: {res[f'{key}_ms']:.3f} ms/step {res[f'{key}_paths']}")
    engine.fast_path.run_ahead = False  # the same steps, each token read before the next replay
    for n, key in ((1, "step1_no_run_ahead"), (4, "step4_no_run_ahead")):
        res[f"{key}_ms"], res[f"{key}_paths"] = measure(n)
        log(f"  engine {key}: {res[f'{key}_ms']:.3f} ms/step")
    engine.fast_path.run_ahead = True
    res["batch4_step_ratio_no_run_ahead"] = res["step4_no_run_ahead_ms"] / res["step1_no_run_ahead_ms"]
    base = min(res["step1_ms"], res["step1_again_ms"])
    res["batch4_step_ratio"] = res["step4_ms"] / base
    res["batch8_step_ratio"] = res["step8_ms"] / base
    res["batch8_half_sampled_step_ratio"] = res["step8_half_sampled_ms"] / base

    n_tok, alone = 24, {}
    for slot in range(4):  # greedy tokens: alone, then the 4 together
        start(slot, False, n_tok)
        toks = []
        while engine.active_slots():
            toks += engine.step()[slot].token_ids
        alone[slot] = toks
        engine.release(slot)
    for slot in range(4):
        start(slot, False, n_tok)
    together: dict = {slot: [] for slot in range(4)}
    while engine.active_slots():
        for slot, out in engine.step().items():
            together[slot] += out.token_ids
    for slot in range(4):
        engine.release(slot)
    res["batched_tokens_equal_alone"] = [next((i for i, (a, b) in enumerate(zip(alone[k], together[k])) if a != b),
                                              len(alone[k])) for k in range(4)]
    res["compared_tokens"] = n_tok
    log(f"  engine: batch 4 {res['batch4_step_ratio']:.3f}x, batch 8 {res['batch8_step_ratio']:.3f}x, 8 half sampled "
        f"{res['batch8_half_sampled_step_ratio']:.3f}x the one-slot step; batched tokens equal alone for "
        f"{res['batched_tokens_equal_alone']} of {n_tok}")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return res


def run_batch(X, R: dict) -> None:
    """Part "batch" of decode_gpu.py: fills R's llama8b_batch* fields."""
    from decode_gpu import LLAMA8B

    s = LLAMA8B
    model = build_llama(X, s)
    plant_successor(model, s)
    try:
        if os.environ.get("DECODE_GPU_BATCH_SWEEP", "1") != "0":  # 0: skip the GEMV sweep (a shorter run)
            R["llama8b_batch_gemv_sweep"] = gemv_sweep(X, s)
    except Exception:  # noqa: BLE001
        R["llama8b_batch_gemv_sweep_error"] = traceback.format_exc()[-1500:]
        log(R["llama8b_batch_gemv_sweep_error"])
    try:
        R["llama8b_batch_decoder"] = d = decoder_timing(X, model, s)
        R["llama8b_batch4_decoder_ratio"], R["llama8b_batch8_decoder_ratio"] = d["batch4_ratio"], d["batch8_ratio"]
    except Exception:  # noqa: BLE001
        R["llama8b_batch_decoder_error"] = traceback.format_exc()[-1500:]
        log(R["llama8b_batch_decoder_error"])
    gc.collect()
    torch.cuda.empty_cache()
    try:
        R["llama8b_batch_engine"] = e = engine_timing(model, s)
        R["llama8b_batch4_step_ratio"], R["llama8b_batch8_step_ratio"] = e["batch4_step_ratio"], e["batch8_step_ratio"]
        R["llama8b_batch_path"] = f"Engine API, fast_path=auto: {e['step8_paths']}"
    except Exception:  # noqa: BLE001
        R["llama8b_batch_engine_error"] = traceback.format_exc()[-1500:]
        log(R["llama8b_batch_engine_error"])
    del model
    gc.collect()
    torch.cuda.empty_cache()
