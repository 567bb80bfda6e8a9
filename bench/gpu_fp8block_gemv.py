"""Block-scaled FP8 one-token GEMVs (moe.gemv_rows over fp8block.BlockFp8, 128 x 128 scales, activations
rounded per 128-feature group) on one GPU: bandwidth per tile against a plain copy, beside the per-channel FP8
kernel (fp8.gemv_fp8, the product's tile) and the bf16 gemv_rows on the same shapes (issue 17).

    python bench/gpu_fp8block_gemv.py [--out bench/results/gpu_fp8block_gemv.json]

Shapes: the Llama-3-8B projections and DeepSeek-V3's dense ones (wq_b, wo, one expert's gate/up and down).
Timing as bench/gpu_fp8_gemv.py (a CUDA graph over enough weight copies that none is read from L2); each tile's
output is checked against the torch twin (per-group rounded input times the dequantized weight, float32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_fp8_gemv import copy_gbs, time_graph  # noqa: E402
from services.decode.engine.cuda import fp8block, moe  # noqa: E402
from services.decode.engine.cuda.fp8 import gemv_fp8  # noqa: E402
from services.decode.engine.cuda.kernel_helpers import act_round, act_scale  # noqa: E402


@triton.jit
def _block_fma_3d_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KB, BLOCK_N: tl.constexpr, G: tl.constexpr,
                         STAGES: tl.constexpr):
    # variant: the weight tile loaded as [BLOCK_N, G, 128] and x as [G, 128], so the per-group rounding needs no
    # reshape (a layout conversion through shared memory every K step in gemv_rows' FMA path); one token, ACT
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    srow = (pid * BLOCK_N) // 128
    gi = tl.arange(0, G)
    c = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_N, G, 128), tl.float32)
    for k in tl.range(0, K, G * 128, num_stages=STAGES):
        offs = k + gi[:, None] * 128 + c[None, :]
        x = tl.load(x_ptr + offs).to(tl.float32)
        sx = act_scale(tl.max(tl.abs(x), axis=1))
        sw = tl.load(s_ptr + srow * KB + k // 128 + gi)
        xs = act_round(x, 1.0 / sx[:, None]).to(tl.float32) * (sx * sw)[:, None]
        w = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * K + offs[None, :, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * xs[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


def block_fma_3d(x, w: fp8block.BlockFp8, out, block_n=8, groups=4, num_warps=4, stages=3):
    n, k = w.shape
    _block_fma_3d_kernel[(n // block_n,)](x, w.w, w.scale, out, n, k, w.scale.shape[-1], BLOCK_N=block_n, G=groups,
                                          STAGES=stages, num_warps=num_warps)
    return out


TILES_3D = [(bn, g * 128, 4, st) for bn in (8, 16, 32) for g in (2, 4, 8) for st in (3, 4)]  # block_k = G x 128

SHAPES = {"llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_gate_up": (28672, 4096),
          "llama_down": (4096, 14336), "v3_wq_b": (24576, 1536), "v3_wo": (7168, 16384),
          "v3_expert_gate_up": (4096, 7168), "v3_expert_down": (7168, 2048)}
TILES = [(bn, bk, 4, st) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for st in (3, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench/results/gpu_fp8block_gemv.json"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    torch.manual_seed(0)
    copy = copy_gbs()
    print(f"copy {copy:.0f} GB/s  {torch.cuda.get_device_name()}", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "shapes": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w32 = torch.randn(n, k, device="cuda") * 0.02
        blocks = w32.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
        scale = (blocks / 448.0).float()
        w8 = (w32 / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        nbytes = n * k + 4 * scale.numel()
        copies = max(2, -(-300_000_000 // nbytes))
        ws = [fp8block.BlockFp8(w8.clone(), scale, 128, 128, act=True) for _ in range(copies)]
        x = (torch.randn(k, device="cuda") * 3).to(torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        want = fp8block.quantize_groups(x.float()[None], 128)[0] @ ws[0].dequantize(torch.float32).T
        def sweep(tiles, run, label: str) -> list[dict]:
            """Each tile's output error against the twin and its time; ``run(i, tile)`` reads weight copy i."""
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
                out_rows.append({"tile": list(tile), "us": ms * 1e3, "gbs": nbytes / ms / 1e6, "rel_err": err})
            return out_rows

        rows = sweep(TILES, lambda i, t: moe.gemv_rows(x.view(1, -1), ws[i], y.view(1, -1), block_n=t[0], block_k=t[1],
                                                       num_warps=t[2], stages=t[3]), "gemv_rows")
        rows3 = sweep(TILES_3D, lambda i, t: block_fma_3d(x, ws[i], y, block_n=t[0], groups=t[1] // 128, num_warps=t[2],
                                                          stages=t[3]), "3d")
        best3 = max(rows3, key=lambda r: r["gbs"]) if rows3 else None
        # the per-channel FP8 kernel and the bf16 gemv_rows over the same shape, for the same bytes a weight
        rs = (w32.abs().amax(dim=1) / 448.0).float()
        wc = [(w32 / rs[:, None]).to(torch.float8_e4m3fn) for _ in range(copies)]
        ref = {}
        ms = time_graph(lambda i: gemv_fp8(x, wc[i], rs, y, act=True, block_n=16, block_k=512, stages=3), copies)
        ref["channel_fp8"] = {"us": ms * 1e3, "gbs": (n * k + 4 * n) / ms / 1e6}
        del wc
        wb = [w32.to(torch.bfloat16) for _ in range(max(2, copies // 2))]
        ms = time_graph(lambda i: moe.gemv_rows(x.view(1, -1), wb[i], y.view(1, -1), block_n=8, block_k=512,
                                                 num_warps=4, stages=3), len(wb))
        ref["bf16"] = {"us": ms * 1e3, "gbs": 2 * n * k / ms / 1e6}
        del wb
        best = max(rows, key=lambda r: r["gbs"]) if rows else None
        prod = next((r for r in rows if r["tile"] == [8, 512, 4, 3]), None)
        print(f"{name:18s} block FP8 best {best['tile']} {best['us']:7.1f} us {best['gbs']:6.0f} GB/s err "
              f"{best['rel_err']:.1e} | product tile (8,512,4,3) {prod and round(prod['us'], 1)} us | channel FP8 "
              f"{ref['channel_fp8']['us']:.1f} us {ref['channel_fp8']['gbs']:.0f} GB/s | bf16 {ref['bf16']['us']:.1f} us "
              f"{ref['bf16']['gbs']:.0f} GB/s", flush=True)
        if best3:
            print(f"{'':18s} 3-D variant best {best3['tile']} {best3['us']:7.1f} us {best3['gbs']:6.0f} GB/s err "
                  f"{best3['rel_err']:.1e}", flush=True)
        out["shapes"][name] = {"n": n, "k": k, "best": best, "rows": rows, "best_3d": best3, "rows_3d": rows3, **ref}
        del ws, w8, w32
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
