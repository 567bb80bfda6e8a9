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

from gpu_fp8_gemv import copy_gbs, sweep_tiles, time_graph  # noqa: E402
from services.decode.engine.cuda import fp8block, moe  # noqa: E402
from services.decode.engine.cuda.fp8 import gemv_fp8  # noqa: E402
from services.decode.engine.cuda.gemv import interpreting  # noqa: E402
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


@triton.jit
def _dot8(a, b, acc, UPCAST: tl.constexpr):
    # FP8 operands on the tensor cores; under the interpreter in float32 (exact products of FP8 values)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _block_dot_swap_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KB, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                           CHANNEL: tl.constexpr, UPCAST: tl.constexpr):
    # variant: the weight tile as the tensor-core dot's A operand ([BLOCK_N, 128] FP8 bytes, M = BLOCK_N rows: a
    # warpgroup MMA reading the tile from shared memory, no per-element conversion), the token's FP8 activations
    # broadcast to a 16-column B operand; one 128-column block a K step, its partial dot times the block's weight
    # scale and the group's activation scale. CHANNEL: per-row weight scales s_ptr [N] and one activation scale a
    # token (compressed-tensors FP8_DYNAMIC), so the dot accumulates in place over the whole row
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    srow = (pid * BLOCK_N) // 128
    c = tl.arange(0, 128)
    c16 = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    if CHANNEL:
        kk = tl.arange(0, 1024)
        m = tl.zeros((1024,), tl.float32)
        for k0 in range(0, K, 1024):
            m = tl.maximum(m, tl.abs(tl.load(x_ptr + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)))
        s_tok = act_scale(tl.max(m, axis=0))
        inv_tok = 1.0 / s_tok
    for k in tl.range(0, K, 128, num_stages=STAGES):
        x = tl.load(x_ptr + k + c).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (k + c)[None, :], eviction_policy="evict_first")
        if CHANNEL:
            xq = act_round(x, inv_tok)
            acc = _dot8(w, tl.trans(tl.broadcast_to(xq[None, :], (16, 128))), acc, UPCAST)
        else:
            sx = act_scale(tl.max(tl.abs(x), axis=0))
            xq = act_round(x, 1.0 / sx)
            part = _dot8(w, tl.trans(tl.broadcast_to(xq[None, :], (16, 128))), tl.zeros((BLOCK_N, 16), tl.float32),
                         UPCAST)
            acc += part * (tl.load(s_ptr + srow * KB + k // 128) * sx)
    y = tl.sum(tl.where(c16[None, :] == 0, acc, 0.0), axis=1)
    if CHANNEL:
        y = y * s_tok * tl.load(s_ptr + rows)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


def block_dot_swap(x, w, scale, out, block_n=64, num_warps=4, stages=4, channel=False):
    """out = x @ w^T by :func:`_block_dot_swap_kernel`: ``w`` FP8 bytes [N, K] (N a multiple of block_n, K of 128),
    ``scale`` its [N / 128, K / 128] block scales, or with ``channel`` its [N] row scales."""
    n, k = w.shape
    _block_dot_swap_kernel[(n // block_n,)](x, w, scale, out, n, k, k // 128, BLOCK_N=block_n, STAGES=stages,
                                            CHANNEL=channel, UPCAST=interpreting(), num_warps=num_warps)
    return out


@triton.jit
def _bf16_dot_swap_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          STAGES: tl.constexpr, UPCAST: tl.constexpr):
    # the swapped dot over bf16 weights (the DeepSeek-V2-Lite experts' shapes): the weight tile as the A operand,
    # the token broadcast to 16 columns, fp32 sums in place
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    c16 = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        m = k + c < K
        x = tl.load(x_ptr + k + c, mask=m, other=0.0)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (k + c)[None, :], mask=m[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = _dot8(w, tl.trans(tl.broadcast_to(x[None, :], (16, BLOCK_K))), acc, UPCAST)
    y = tl.sum(tl.where(c16[None, :] == 0, acc, 0.0), axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


def bf16_dot_swap(x, w, out, block_n=64, block_k=64, num_warps=4, stages=4):
    n, k = w.shape
    _bf16_dot_swap_kernel[(n // block_n,)](x, w, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
                                           UPCAST=interpreting(), num_warps=num_warps)
    return out


# the DeepSeek-V2-Lite MoE layer's bytes as one GEMV each (8 experts' gate/up rows over hidden 2048; their down
# rows over the 1408-wide intermediate): bf16 only, the product's FMA tile against the swapped dot
BF16_SHAPES = {"v2lite_experts_gate_up": (22528, 2048), "v2lite_experts_down": (16384, 1408)}
TILES_BF16_SWAP = [(bn, bk, nw, st) for bn, bk, nw in ((64, 64, 4), (64, 128, 4), (128, 64, 8))
                   for st in (3, 4, 6)]


TILES_SWAP = [(bn, 128, nw, st) for bn, nw in ((64, 4), (128, 4), (128, 8)) for st in (3, 4, 6)]


TILES_3D = [(bn, g * 128, 4, st) for bn in (8, 16, 32) for g in (2, 4, 8) for st in (3, 4)]  # block_k = G x 128

SHAPES = {"llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_gate_up": (28672, 4096),
          "llama_down": (4096, 14336), "v3_wq_b": (24576, 1536), "v3_wo": (7168, 16384),
          "v3_expert_gate_up": (4096, 7168), "v3_expert_down": (7168, 2048)}
TILES = [(bn, bk, 4, st) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for st in (3, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench/results/gpu_fp8block_gemv.json"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--bf16-shapes", default=",".join(BF16_SHAPES),
                   help="bf16 shapes for the FMA tile against the swapped dot ('' for none)")
    p.add_argument("--quick", action="store_true", help="the product tile, the 3-D variant's best-known and the "
                   "swapped dot only (for a short device call)")
    args = p.parse_args()
    global TILES, TILES_3D, TILES_SWAP
    if args.quick:
        TILES = [(32, 512, 4, 3), (32, 512, 4, 4)]
        TILES_3D = [(32, 512, 4, 3), (16, 1024, 4, 3)]
        TILES_SWAP = [(64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 8, 4)]
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
            return sweep_tiles(name, label, tiles, run, y, want, copies, nbytes)

        rows = sweep(TILES, lambda i, t: moe.gemv_rows(x.view(1, -1), ws[i], y.view(1, -1), block_n=t[0], block_k=t[1],
                                                       num_warps=t[2], stages=t[3]), "gemv_rows")
        rows3 = sweep(TILES_3D, lambda i, t: block_fma_3d(x, ws[i], y, block_n=t[0], groups=t[1] // 128, num_warps=t[2],
                                                          stages=t[3]), "3d")
        best3 = max(rows3, key=lambda r: r["gbs"]) if rows3 else None
        rows_sw = sweep(TILES_SWAP, lambda i, t: block_dot_swap(x, ws[i].w, ws[i].scale, y, block_n=t[0],
                                                                 num_warps=t[2], stages=t[3]), "swap")
        best_sw = max(rows_sw, key=lambda r: r["gbs"]) if rows_sw else None
        # the per-channel FP8 kernel and the bf16 gemv_rows over the same shape, for the same bytes a weight
        rs = (w32.abs().amax(dim=1) / 448.0).float()
        wc = [(w32 / rs[:, None]).to(torch.float8_e4m3fn) for _ in range(copies)]
        ref = {}
        ms = time_graph(lambda i: gemv_fp8(x, wc[i], rs, y, act=True, block_n=16, block_k=512, stages=3), copies)
        ref["channel_fp8"] = {"us": ms * 1e3, "gbs": (n * k + 4 * n) / ms / 1e6}
        want = y.float().clone()  # the per-channel kernel's output: the swapped kernel's per-channel form against it
        ch_rows = sweep_tiles(name, "swap channel", TILES_SWAP,
                              lambda i, t: block_dot_swap(x, wc[i], rs, y, block_n=t[0], num_warps=t[2], stages=t[3],
                                                          channel=True), y, want, copies, n * k + 4 * n)
        ref["channel_swap_best"] = max(ch_rows, key=lambda r: r["gbs"]) if ch_rows else None
        ref["channel_swap_rows"] = ch_rows
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
        if best_sw:
            print(f"{'':18s} swapped dot best {best_sw['tile']} {best_sw['us']:7.1f} us {best_sw['gbs']:6.0f} GB/s err "
                  f"{best_sw['rel_err']:.1e}", flush=True)
        cb = ref["channel_swap_best"]
        if cb:
            print(f"{'':18s} per-channel swapped dot best {cb['tile']} {cb['us']:7.1f} us {cb['gbs']:6.0f} GB/s err "
                  f"{cb['rel_err']:.1e}", flush=True)
        out["shapes"][name] = {"n": n, "k": k, "best": best, "rows": rows, "best_3d": best3, "rows_3d": rows3,
                               "best_swap": best_sw, "rows_swap": rows_sw, **ref}
        Path(args.out).write_text(json.dumps(out, indent=1))  # each shape as it completes (a timeout keeps them)
        del ws, w8, w32
        torch.cuda.empty_cache()
    for name in args.bf16_shapes.split(",") if args.bf16_shapes else []:
        n, k = BF16_SHAPES[name]
        copies = max(2, -(-300_000_000 // (2 * n * k)))
        wb = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = (torch.randn(k, device="cuda") * 3).to(torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ wb[0].float().T
        res = {}
        for label, tiles, run in (
                ("fma", [(8, 512, 4, 3), (8, 256, 4, 4)], lambda i, t: moe.gemv_rows(
                    x.view(1, -1), wb[i], y.view(1, -1), block_n=t[0], block_k=t[1], num_warps=t[2], stages=t[3])),
                ("swap", TILES_BF16_SWAP, lambda i, t: bf16_dot_swap(x, wb[i], y, block_n=t[0], block_k=t[1],
                                                                      num_warps=t[2], stages=t[3]))):
            rs = sweep_tiles(name, label, tiles, run, y, want, copies, 2 * n * k)
            res[label] = rs
            b = max(rs, key=lambda r: r["gbs"]) if rs else None
            if b:
                print(f"{name:24s} bf16 {label:5s} best {b['tile']} {b['us']:7.1f} us {b['gbs']:6.0f} GB/s err "
                      f"{b['rel_err']:.1e}", flush=True)
        out["shapes"][name] = {"n": n, "k": k, **res}
        del wb
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
