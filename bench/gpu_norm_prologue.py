"""What the batch-1 GEMVs' RMSNorm prologue costs on the step's critical path (Llama-family shapes, one GPU).

The QKV and gate/up GEMVs of every layer (and the lm_head) normalise their input vector first: each program
waits for the previous kernel (PDL), reads the whole vector from L2, reduces its sum of squares, and only then
starts its pipelined weight stream (the first weight tile is loaded before the wait). This probe times a chain
of the step's four GEMVs a layer - QKV (rope + cache write), o (+ residual), gate/up (silu), down
(+ residual) - over every layer's own weights (more bytes than L2 holds), on PDL as in the product, in one
CUDA graph, three ways: with the two norm prologues a layer, with the norm folded into the weight stream
(``norm_late``), and without any norm (the kernels' NORM flag off, the same bytes streamed). The last bounds
what taking the norm off the critical path could save a step; the attention is left out (it does not touch
the norms).

    python bench/gpu_norm_prologue.py [--shapes qwen3_8b,llama3_8b] [--out bench/results/gpu_norm_prologue.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from decode_gpu import capture, copy_bandwidth, load_cuda_pkg, log, time_graph  # bench/ is on sys.path

SHAPES = {
    "qwen3_8b": dict(hidden=4096, layers=36, hq=32, hkv=8, d=128, inter=12288),
    "llama3_8b": dict(hidden=4096, layers=32, hq=32, hkv=8, d=128, inter=14336),
    "qwen25_7b": dict(hidden=3584, layers=28, hq=28, hkv=4, d=128, inter=18944),
}


def chain(X, s: dict, norm: str, opts, dev: str = "cuda") -> tuple[Callable[[], None], int]:
    G = X.gemv
    dt = torch.bfloat16
    h, hq, hkv, d, inter = s["hidden"], s["hq"], s["hkv"], s["d"], s["inter"]
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g) * shape[-1] ** -0.5).to(dt)

    layers = [dict(wqkv=w((hq + 2 * hkv) * d, h), wo=w(h, hq * d), wgu=w(2 * inter, h), wd=w(h, inter),
                   n1=torch.ones(h, device=dev, dtype=dt), n2=torch.ones(h, device=dev, dtype=dt))
              for _ in range(s["layers"])]
    nbytes = sum(t.numel() * 2 for l in layers for k, t in l.items() if k.startswith("w"))
    x = torch.randn(h, device=dev, dtype=dt)
    q = torch.empty(hq * d, device=dev, dtype=dt)
    act = torch.empty(inter, device=dev, dtype=dt)
    kc = torch.zeros(4096, hkv, d, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    pos = torch.tensor([100], dtype=torch.int32, device=dev)
    half = d // 2
    cos = torch.ones(4096, half, device=dev, dtype=dt)
    sin = torch.zeros(4096, half, device=dev, dtype=dt)
    t = opts.tiles

    def kw(name):
        bn, bk, nw, st = t[name]
        return dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, pdl=dev == "cuda", **(
            {"norm_late": True} if norm == "late" and name in ("qkv", "gate_up") else {}))

    def step():
        for l in layers:
            G.gemv_qkv_rope(x, l["wqkv"], l["n1"] if norm != "none" else None, 1e-6, q, kc, vc, pos, cos, sin,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=d, **kw("qkv"))
            G.gemv(q, l["wo"], x, residual=x, **kw("o"))
            G.gemv_silu(x, l["wgu"], act, norm_w=l["n2"] if norm != "none" else None, eps=1e-6, **kw("gate_up"))
            G.gemv(act, l["wd"], x, residual=x, **kw("down"))
    return step, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3_8b,llama3_8b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_norm_prologue.json"))
    args = ap.parse_args()
    X = load_cuda_pkg()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from services.decode.engine.cuda import FastOptions

    opts = FastOptions()
    R: dict = {"device": torch.cuda.get_device_name(), "copy_bw_TBps": copy_bandwidth(), "tiles": opts.tiles}
    log(f"copy bandwidth {R['copy_bw_TBps']:.3f} TB/s")
    for key in args.shapes.split(","):
        s = SHAPES[key]
        graphs = {}
        for norm in ("early", "late", "none"):
            fn, nbytes = chain(X, s, norm, opts)
            graphs[norm] = capture(fn)
        times = {k: [] for k in graphs}
        for _ in range(args.rounds):  # alternated, so drift hits all alike
            for norm in graphs:
                times[norm].append(time_graph(graphs[norm], iters=20))
        best = {k: min(v) for k, v in times.items()}
        R[key] = {"ms": best, "rounds_ms": times, "gemv_bytes": nbytes, "layers": s["layers"],
                  "early_minus_none_us_per_layer": (best["early"] - best["none"]) * 1e3 / s["layers"],
                  "early_minus_late_us_per_layer": (best["early"] - best["late"]) * 1e3 / s["layers"],
                  "early_TBps": nbytes / (best["early"] * 1e-3) / 1e12}
        log(f"  {key}: GEMV chain {best['early']:.3f} ms with the norm prologues, {best['late']:.3f} with the norm "
            f"in the stream, {best['none']:.3f} with none ({R[key]['early_minus_none_us_per_layer']:.2f} / "
            f"{R[key]['early_minus_late_us_per_layer']:.2f} us a layer); {R[key]['early_TBps']:.2f} TB/s early")
        del graphs
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(R, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
