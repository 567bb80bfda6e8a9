"""FP8 batch-1 GEMV variants on one GPU: bandwidth of each against a plain copy (issue 17's lever).

    python bench/gpu_fp8_gemv.py [--out bench/results/gpu_fp8_gemv.json]

For the Llama-3-8B projections (qkv 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336),
FP8 weights with per-row scales and FP8_DYNAMIC activations (one scale per token):
- ``cvt``: engine/cuda/fp8.py's ``gemv_fp8`` (weights widened to fp32 in registers, FMA);
- ``dot``: the activation tile quantized to FP8 in registers and multiplied with the FP8 weight tile
  on the tensor cores (``tl.dot`` of a 16-row tile whose first row is the token), fp32 accumulate.
Each variant runs from a CUDA graph of back-to-back launches over enough weight copies that none is
read from L2; GB/s = weight + scale bytes / time. Outputs are checked against the torch twin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.decode.engine.cuda.fp8 import _prologue, gemv_fp8, gemv_fp8_reference  # noqa: E402


@triton.jit
def _gemv_fp8_dot_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, eps, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    ws = tl.load(ws_ptr + rows, mask=rmask, other=0.0)
    inv_rms, s, inv_s = _prologue(x_ptr, x_ptr, K, eps, False, True, K_POW2)
    r16 = tl.arange(0, 16)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK_K)
        kmask = offs < K
        x = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inv_s, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        xa = tl.broadcast_to(q[None, :], (16, BLOCK_K))
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc = tl.dot(xa, tl.trans(w), acc)
    y = tl.sum(tl.where(r16[:, None] == 0, acc, 0.0), axis=0) * s * ws
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


def gemv_fp8_dot(x, w, ws, out, block_n=64, block_k=256, num_warps=4, stages=3):
    n, k = w.shape
    _gemv_fp8_dot_kernel[(triton.cdiv(n, block_n),)](x, w, ws, out, n, k, 1e-5, K_POW2=triton.next_power_of_2(k),
                                                    BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
                                                    num_warps=num_warps)
    return out


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CVT = [dict(block_n=bn, block_k=bk, num_warps=4, stages=st)
       for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for st in (3, 5, 6) if bn * bk <= 16384]
DOT = [dict(block_n=bn, block_k=bk, num_warps=4, stages=st)
       for bn in (16, 32) for bk in (128, 256, 512) for st in (4, 6)]


def time_graph(fn, copies: int, reps: int = 5) -> float:
    """ms per launch: a CUDA graph of 4 x copies launches (each copy read 4 times, none from L2)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for i in range(copies):
                fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / (4 * copies))
    return statistics.median(times)


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (read + write bytes), after the clocks have come up."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):
        dst.copy_(src)
    ms = time_graph(lambda i: dst.copy_(src), 1, reps=9)
    return 2 * src.numel() / ms / 1e6


def sweep_tiles(name: str, label: str, tiles, run, y, want, copies: int, nbytes: int) -> list[dict]:
    """Each tile's output ``y`` error against ``want`` and its time (``nbytes`` a launch); ``run(i, tile)`` reads
    weight copy i; a tile the compiler refuses is reported and left out."""
    out_rows = []
    for tile in tiles:
        try:
            run(0, tile)
            torch.cuda.synchronize()
            err = ((y.float() - want).abs().max() / want.abs().max()).item()
            ms = time_graph(lambda i: run(i, tile), copies)
        except Exception as exc:  # a tile the compiler refuses
            print(f"  {name} {label} {tile}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        out_rows.append({"tile": tile if isinstance(tile, dict) else list(tile), "us": ms * 1e3,
                         "gbs": nbytes / ms / 1e6, "rel_err": err})
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench/results/gpu_fp8_gemv.json"))
    p.add_argument("--quick", action="store_true", help="the product's tiles and a few neighbours (cvt only)")
    args = p.parse_args()
    kinds = [("cvt", CVT, lambda i, v: gemv_fp8(x, ws[i], scale, y, act=True, **v)),
             ("dot", DOT, lambda i, v: gemv_fp8_dot(x, ws[i], scale, y, **v))]
    if args.quick:
        quick = [dict(block_n=bn, block_k=bk, num_warps=4, stages=st) for bn, bk, st in
                 ((16, 512, 3), (32, 256, 6), (16, 1024, 3), (32, 512, 4), (64, 256, 4), (16, 256, 6))]
        kinds = [("cvt", quick, kinds[0][2])]
    torch.manual_seed(0)
    copy = copy_gbs()
    print(f"copy {copy:.0f} GB/s  {torch.cuda.get_device_name()}", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k + 4 * n
        copies = max(2, -(-300_000_000 // nbytes))
        w32 = torch.randn(n, k, device="cuda") * 0.02
        scale = (w32.abs().amax(dim=1) / 448.0).float()
        w8 = (w32 / scale[:, None]).to(torch.float8_e4m3fn)
        ws = [w8.clone() for _ in range(copies)]
        x = (torch.randn(k, device="cuda") * 3).to(torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        want = gemv_fp8_reference(x, w8, scale, act=True).float()
        rows = []
        for kind, variants, fn in kinds:
            for r in sweep_tiles(name, kind, variants, fn, y, want, copies, nbytes):
                rows.append({"kind": kind, **r.pop("tile"), **r, "frac_copy": r["gbs"] / copy})
        best = {kind: max((r for r in rows if r["kind"] == kind), key=lambda r: r["gbs"], default=None)
                for kind in [k_[0] for k_ in kinds]}
        for kind, r in best.items():
            if r:
                print(f"{name:8s} {kind}: {r['us']:7.1f} us {r['gbs']:6.0f} GB/s {r['frac_copy']:.3f} of copy "
                      f"err {r['rel_err']:.2e}  {dict((k_, r[k_]) for k_ in ('block_n', 'block_k', 'num_warps', 'stages'))}",
                      flush=True)
        out["shapes"][name] = {"n": n, "k": k, "best": best, "rows": rows}
        del ws, w8, w32
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
