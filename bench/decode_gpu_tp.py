"""Tensor-parallel decode on one multi-GPU host (NCCL): bench/results/decode_gpu_tp.json and a table.

    python bench/decode_gpu_tp.py [--tp 2] [--parts allreduce,llama8b,llama70b,moe] [--layers-70b 8]

One process per GPU (torch.multiprocessing, NCCL), each the rank of one engine, every engine call made
on every rank (as a tensor-parallel decode node's ranks do). Random bf16 weights, no checkpoint.

- ``allreduce``: a bf16 all-reduce of 8 KB and 16 KB (the residual of hidden 4096 / 8192), NCCL eager
  and captured 64 to a CUDA graph, and torch's symmetric-memory one-shot all-reduce (peer-mapped
  buffers, no NVLink multicast) likewise: ``nccl_allreduce_us_p50`` (graph, 16 KB),
  ``one_shot_allreduce_us_p50`` and ``allreduce_us_p50`` (the product's: NCCL, what its graphs capture).
- ``llama8b``: the Engine API (Llama-3-8B shape, 1K-token context, greedy), one rank alone and ``--tp``
  ranks: ``llama8b_tp2_over_tp1`` (tokens/s ratio, same run).
- ``llama70b``: Llama-3-70B's layer shape cut to ``--layers-70b`` layers (the whole vocabulary),
  ``--tp`` ranks, 1K context: ``llama70b_tp2_ctx1k_tok_s`` scaled to 80 layers by the measured per-layer
  time, and ``llama70b_tp2_frac_roofline``: the bytes one rank reads a step (its weight shards, its KV
  heads) over one GPU's copy bandwidth, against the measured step.
- ``moe``: DeepSeek-V2-Lite's layer shape cut to 8 layers, experts sliced (``moe_parallel="tp"``) and
  whole per rank (``"ep"``): ``moe_tp_step_ms``, ``moe_ep_step_ms`` (the reference step: the
  DeepSeek-family fast path is single-GPU).

Every measured engine step says which path it took (``*_paths``); a tensor-parallel Llama-family step
runs the sharded fast path (cuda/llama.py) with its two all-reduces a layer in the step's graph.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_engine import DSV2_LITE_8L, copy_bandwidth_bytes_per_s  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "decode_gpu_tp.json"
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "eos_token_id": 128001, "bos_token_id": 128000, "hidden_act": "silu"}
LLAMA8B = dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8)
LLAMA70B = dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8)
CONTEXT, STEPS = 1024, 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graph_us(fn, per_graph: int = 64, repeats: int = 20) -> float:
    """Per-call microseconds of ``fn`` captured ``per_graph`` times in one CUDA graph (p50 of repeats)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / per_graph)
    return statistics.median(times)


def _eager_us(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def allreduce(rank: int) -> dict:
    import torch.distributed as dist

    log(f"rank {rank}: all-reduce")
    out = {}
    for hidden in (4096, 8192):
        x = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
        kb = hidden * 2 // 1024
        out[f"nccl_eager_{kb}kb_us"] = _eager_us(lambda: dist.all_reduce(x))
        out[f"nccl_graph_{kb}kb_us"] = _graph_us(lambda: dist.all_reduce(x))
        try:  # torch's one-shot all-reduce over peer-mapped (symmetric) buffers
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD
            buf = symm_mem.empty(hidden, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(buf, group.group_name)
            buf.copy_(x)

            def one_shot():
                torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)

            out[f"one_shot_eager_{kb}kb_us"] = _eager_us(one_shot)
            out[f"one_shot_graph_{kb}kb_us"] = _graph_us(one_shot)
        except Exception as e:  # noqa: BLE001 - recorded, the rest of the run goes on
            out["one_shot_error"] = f"{type(e).__name__}: {e}"
    return out


def _engine(raw: dict, tp, device: str = "cuda", **options):
    """An engine over random bf16 weights of ``raw``'s shape, drawn on ``device`` (every rank draws the same
    whole tensors, then keeps its shards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.decode.engine import Engine

    t0 = time.perf_counter()
    cfg = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: p.shape for n, p in hf.named_parameters()}
    biases = {n: b.shape for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    tensors = {n: torch.zeros(shape, dtype=torch.float32, device=device) for n, shape in biases.items()}
    for i, (name, shape) in enumerate(shapes.items()):
        g = torch.Generator(device=device).manual_seed(i)
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        tensors[name] = t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, 0.02, generator=g)
    engine = Engine.from_hf_tensors(raw, tensors, tp=tp, max_seq_len=CONTEXT + STEPS + 16, device=device,
                                    dtype="bfloat16", **options)
    del tensors
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"rank {tp.rank}: {raw['num_hidden_layers']}-layer {raw['model_type']} engine in {time.perf_counter() - t0:.1f} s, "
        f"fast path: {engine.fast_path_reason or 'on'}")
    return engine


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def _decode(engine, steps: int = STEPS) -> dict:
    from shared.events import SamplingParams

    vocab = min(1000, engine.cfg.vocab_size)
    prompt = [int(t) for t in torch.randint(0, vocab, (CONTEXT,), generator=torch.Generator().manual_seed(0))]
    for n in (8, steps):  # a warm-up request, then the measured one
        first = int(engine.prefill(0, prompt).argmax())
        engine.start(0, first, SamplingParams(max_tokens=n, ignore_eos=True))
        _sync(engine)
        t0, emitted, paths = time.perf_counter(), 0, set()
        while engine.active_slots():
            emitted += len(engine.step()[0].token_ids)
            paths.add(engine.last_step_path)
        _sync(engine)
        elapsed = time.perf_counter() - t0
        engine.release(0)
    return {"tok_s": emitted / elapsed, "step_ms": elapsed / emitted * 1e3, "paths": sorted(paths),
            "fast_path_reason": engine.fast_path_reason}


def _bytes_per_rank_step(raw: dict, size: int, layers: int) -> int:
    """Bytes one rank reads a batch-1 step: its weight shards (no embedding table) + its KV at CONTEXT."""
    h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    d = h // raw["num_attention_heads"]
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
    per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i) // size + 2 * h
    kv_bytes = 2 * layers * CONTEXT * kv // size * 2
    return 2 * (layers * per_layer + v * h // size + h) + kv_bytes


def rank_main(rank: int, size: int, port: int, parts: list[str], layers_70b: int, out_dir: str) -> None:
    import torch.distributed as dist

    from services.decode.engine.tp import TensorParallel

    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(minutes=10), device_id=torch.device("cuda", rank))
    tp = TensorParallel(rank, size, dist.group.WORLD)
    r: dict = {"rank": rank}
    try:
        if "allreduce" in parts:
            r["allreduce"] = allreduce(rank)
        if "llama8b" in parts:
            r["llama8b_tp"] = _decode(_engine(LLAMA8B, tp, device))
        if "llama70b" in parts:
            cut = dict(LLAMA70B, num_hidden_layers=layers_70b)
            r["llama70b_tp"] = _decode(_engine(cut, tp, device))
            half = dict(cut, num_hidden_layers=max(1, layers_70b // 2))
            r["llama70b_tp_half"] = _decode(_engine(half, tp, device))  # per-layer time, to scale to 80 layers
        if "moe" in parts:
            for mode in ("tp", "ep"):
                r[f"moe_{mode}"] = _decode(_engine(DSV2_LITE_8L, tp, device, moe_parallel=mode,
                                                   num_speculative_tokens=0),
                                           steps=64)
        torch.save(r, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--parts", default="allreduce,llama8b,llama70b,moe")
    p.add_argument("--layers-70b", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if torch.cuda.device_count() < args.tp:
        print(f"decode_gpu_tp: {args.tp} GPUs needed, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    import tempfile

    import torch.multiprocessing as mp

    R: dict = {"bench": "decode_gpu_tp", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "gpus": [torch.cuda.get_device_name(i) for i in range(args.tp)], "tp": args.tp, "context": CONTEXT,
               "torch": torch.__version__}
    R["copy_bandwidth_tb_s"] = copy_bandwidth_bytes_per_s("cuda") / 1e12
    if "llama8b" in parts:  # one rank alone, in this process, before the group
        from services.decode.engine.tp import TensorParallel

        R["llama8b_tp1"] = _decode(_engine(LLAMA8B, TensorParallel.single()))
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args.tp, _free_port(), parts, args.layers_70b, tmp), nprocs=args.tp,
                           join=True, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(args.tp)]
    r0 = ranks[0]
    bw = R["copy_bandwidth_tb_s"] * 1e12
    t = f"tp{args.tp}"  # keys name the rank count this run had (the keys: tp2)
    if "allreduce" in parts:
        a = r0["allreduce"]
        R["allreduce"] = [x["allreduce"] for x in ranks]
        R["nccl_allreduce_us_p50"] = a["nccl_graph_16kb_us"]
        R["one_shot_allreduce_us_p50"] = a.get("one_shot_graph_16kb_us")
        R["allreduce_us_p50"] = a["nccl_graph_16kb_us"]  # what the product's graphs capture
    if "llama8b" in parts:
        R[f"llama8b_{t}"] = r0["llama8b_tp"]
        R[f"llama8b_{t}_over_tp1"] = r0["llama8b_tp"]["tok_s"] / R["llama8b_tp1"]["tok_s"]
    if "llama70b" in parts:
        full, half, n = r0["llama70b_tp"], r0["llama70b_tp_half"], args.layers_70b
        per_layer_ms = (full["step_ms"] - half["step_ms"]) / (n - max(1, n // 2))
        step80_ms = full["step_ms"] + (80 - n) * per_layer_ms
        R[f"llama70b_{t}_measured"] = {"layers": n, **full, "per_layer_ms": per_layer_ms}
        R[f"llama70b_{t}_ctx1k_tok_s"] = 1e3 / step80_ms
        R[f"llama70b_{t}_frac_roofline"] = _bytes_per_rank_step(LLAMA70B, args.tp, 80) / bw / (step80_ms / 1e3)
        R[f"llama70b_{t}_frac_roofline_cut"] = (_bytes_per_rank_step(dict(LLAMA70B), args.tp, n) / bw
                                                / (full["step_ms"] / 1e3))
        R[f"llama70b_{t}_layer_tb_s"] = _bytes_per_rank_step(dict(LLAMA70B, vocab_size=0), args.tp, 1) / per_layer_ms / 1e9
    if "moe" in parts:
        R["moe_tp"], R["moe_ep"] = r0["moe_tp"], r0["moe_ep"]
        R["moe_tp_step_ms"], R["moe_ep_step_ms"] = r0["moe_tp"]["step_ms"], r0["moe_ep"]["step_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(R, indent=1))
    for k, v in R.items():
        if not isinstance(v, (dict, list)):
            print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
