"""On a GPU: the compiled FP8-KV decode attention against the torch reference on the dequantized cache.

    python3 bench/gpu_fp8_kv_attention.py [--out PATH]

For E4M3 and E5M2 bytes (engine/kvquant.quantize, per-layer k/v scales), the split-K attention
(cuda/attention.DecodeAttention: two launches and one launch) at short and long positions and tiles
(one and many loop iterations per split) and with a query beyond fp16's range (scaled into it for
the dot): relative L2 error and max-abs error against reference.attention in fp32, next to the
same check of a bf16 cache (the output's bf16 rounding bounds both). The CPU tests run these
kernels under Triton's interpreter, which takes the conversion that the compiled kernels replace
with their byte unpacking (kvfp8.fp8_kv_unpack); this is that code's check on real hardware.
Writes ``bench/results/gpu_fp8_kv_attention.json``; ``all_ok`` when every case is within 6e-3
relative L2 and 2 bf16 ulps of the largest output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.decode.engine.cuda import reference  # noqa: E402
from services.decode.engine.cuda.attention import DecodeAttention  # noqa: E402
from services.decode.engine.cuda.kvfp8 import kv_fmt  # noqa: E402
from services.decode.engine.kvquant import dequantize, quantize  # noqa: E402

DEV = "cuda"  # --device cpu: a smoke run under TRITON_INTERPRET=1
CASES = [  # (positions, pos, num_splits, block_s)
    (256, 200, 4, 64), (8192, 8000, 32, 128), (8192, 8191, 16, 64), (4096, 1000, 32, 32)]


def check(fmt: str | None, t: int, pos: int, splits: int, block_s: int, one_launch: bool, q_gain: float) -> dict:
    hq, hkv, d = 32, 8, 128
    g = torch.Generator(device=DEV).manual_seed(t + pos)
    k16 = (torch.randn(t, hkv, d, generator=g, device=DEV) * 0.4).to(torch.bfloat16)
    v16 = (torch.randn(t, hkv, d, generator=g, device=DEV) * 0.2).to(torch.bfloat16)
    q = (torch.randn(hq, d, generator=g, device=DEV) * q_gain).to(torch.bfloat16)
    ks, vs = 0.03, 0.011
    if fmt:
        k, v = quantize(k16, ks, fmt), quantize(v16, vs, fmt)
        kd, vd = dequantize(k, ks, fmt), dequantize(v, vs, fmt)
    else:
        k, v, kd, vd = k16, v16, k16.float(), v16.float()
    out = torch.full((hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=splits, block_s=block_s,
                           one_launch=one_launch, device=DEV)
    attn(q, k, v, torch.tensor([pos], dtype=torch.int32, device=DEV), out, stride_kt=hkv * d,
         stride_vt=hkv * d, kv_fmt=kv_fmt(fmt), k_scale=ks if fmt else 1.0, v_scale=vs if fmt else 1.0)
    if DEV == "cuda":
        torch.cuda.synchronize()
    want = reference.attention(q.float()[None], kd.float(), vd.float(), pos, d**-0.5)[0]
    rel = ((out.float() - want).norm() / want.norm()).item()
    mx = (out.float() - want).abs().max().item()
    ok = bool(torch.isfinite(out.float()).all()) and rel < 6e-3 and mx <= 2 * want.abs().max().item() * 2**-8
    return {"rel_l2": rel, "max_abs": mx, "ok": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_fp8_kv_attention.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", type=int, default=len(CASES), help="the first N of CASES")
    args = p.parse_args()
    global DEV
    DEV = args.device
    out: dict = {"bench": "gpu_fp8_kv_attention", "device": torch.cuda.get_device_name(0) if DEV == "cuda" else DEV,
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    ok = True
    for fmt in ("fp8_e4m3", "fp8_e5m2", None):
        for t, pos, splits, block_s in CASES[:args.cases]:
            for one_launch in (False, True):
                for q_gain in (1.0, 4e4):
                    key = (f"{fmt or 'bf16'}_t{t}_pos{pos}_{splits}x{block_s}_{'one' if one_launch else 'two'}"
                           f"_q{q_gain:g}")
                    try:
                        out[key] = r = check(fmt, t, pos, splits, block_s, one_launch, q_gain)
                    except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
                        out[key] = r = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    ok &= r["ok"]
                    print(key, r, flush=True)
    out["all_ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print("all_ok", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
