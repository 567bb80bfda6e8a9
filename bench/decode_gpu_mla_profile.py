"""Where the time of the DeepSeek-V2-Lite-shaped plain decode step goes (H200), kernel by kernel.

Builds the model exactly as bench/decode_gpu_mla.py does (random bf16, 27 layers, 1K context, batch 1),
captures the plain fast-path step as the bench does (GraphedFn, 4 steps per replay), times it without
the profiler, profiles graph replays (and, for comparison, eager steps) with torch.profiler (CUDA
activities), then times a few single-knob variants of the whole step (tiles of the T=1 MoE / GEMV
kernels, attention split layout) and the per-launch cost of a chain of trivial kernels in a graph.

Run from the repository root:  python3 bench/decode_gpu_mla_profile.py   (results under $OUT; run P2 in
bench/NOTES-gpu.md, bench/results/decode_gpu_mla_profile.json). Timings taken after torch.profiler ran in a
process are slower and noisier: profile last, or in a process of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

T0 = time.time()
ROOT = Path.cwd()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from decode_gpu import capture, copy_bandwidth, load_cuda_pkg  # noqa: E402
from decode_gpu_mla import DSV2_LITE, build, step_bytes, time_replays  # noqa: E402
import mla_profile_analyze as A  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
SWEEP_DEADLINE_S = float(os.environ.get("SWEEP_DEADLINE_S", "330"))
R: dict = {}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save():
    (OUT / "results.json").write_text(json.dumps(R, indent=1, default=str))


@triton.jit
def _tiny_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


def launch_floor():
    """Per-launch time of a chain of 378 trivial dependent Triton kernels in one CUDA graph."""
    out = {}
    x = torch.zeros(264 * 1024, device="cuda")
    for progs in (1, 16, 132, 264):
        fn = lambda p=progs: [_tiny_kernel[(p,)](x, p * 1024, BLOCK=1024, num_warps=4) for _ in range(378)]  # noqa: E731
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        ms = time_replays(g.replay, 20)
        out[f"grid{progs}_us_per_launch"] = round(ms * 1e3 / 378, 3)
        del g
    return out


def main():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as bench/decode_gpu.py
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    R["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    R["copy_bw_TBps"] = copy_bandwidth()
    log("copy bandwidth", R["copy_bw_TBps"])
    X = load_cuda_pkg()
    s, ctx = DSV2_LITE, 1024
    t = time.time()
    model = build(X, s)
    mt = ctx + 1024
    caches = [torch.randn(mt, s["r"] + s["rope"], device="cuda").to(torch.bfloat16) for _ in range(s["layers"] + 1)]
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = fr.cos(), fr.sin()
    log(f"model built in {time.time() - t:.1f} s")
    by = step_bytes(model, s, ctx)
    R["step_bytes"] = by
    R["roofline_ms"] = by["total"] / (R["copy_bw_TBps"] * 1e12) * 1e3
    L1 = model.layers[1]
    per_exp = 3 * s["hidden"] * s["moe_inter"] * 2
    nexp = s["top_k"] + s["shared"]
    role_bytes = {
        "wqkv_a GEMV (+attn_norm prologue)": L1.wqkv_a.numel() * 2,
        "q_nope x w_uk bmm (cuBLAS)": L1.w_uk.numel() * 2,
        "o_lat x w_uv bmm (cuBLAS)": L1.w_uv_t.numel() * 2,
        "wo GEMV (+residual)": L1.wo.numel() * 2,
        "router GEMV": L1.router.numel() * 2,
        "attention split (16 splits x 4 v-chunks)": (ctx + 1) * (s["r"] + s["rope"]) * 2,
        "MoE gate/up + SiLU (6 routed + 2 shared)": nexp * per_exp * 2 // 3,
        "MoE down (8 experts)": nexp * per_exp // 3,
        "L0 dense gate/up + SiLU (inter 10944)": model.layers[0].gate_up.numel() * 2,
        "L0 dense down": model.layers[0].down.numel() * 2,
        "lm_head GEMV + block argmax": model.lm_head.numel() * 2,
    }
    R["role_bytes"] = role_bytes
    save()

    D = X.mla_decoder
    dec = D.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096)
    st = lambda: dec.set_state(1, ctx)  # noqa: E731

    def time_plain(tag, iters=30):
        g = capture(dec.plain_step, steps_per_replay=4, before_capture=st)
        st()
        a = time_replays(g, iters) / 4
        st()
        b = time_replays(g, iters) / 4
        del g
        # one step from the fixed state: logits for a same-function check of the variant
        g1 = capture(dec.plain_step, steps_per_replay=1, before_capture=st)
        st()
        g1()
        torch.cuda.synchronize()
        lg = dec.logits[1][0].clone()
        del g1
        st()
        return (a + b) / 2 * 1e3, abs(a - b) * 1e3, lg

    # ---- 1. the step without the profiler (as the bench: 4 steps per replay, median of 30, twice)
    plain_us, spread, base_logits = time_plain("base")
    R["plain_us"] = plain_us
    R["plain_us_spread_two_runs"] = spread
    g1 = capture(dec.plain_step, steps_per_replay=1, before_capture=st)
    st()
    R["plain_us_1step_replays"] = time_replays(g1, 30) * 1e3
    log(f"plain step {plain_us:.1f} us (spread {spread:.1f}); 1-step replays {R['plain_us_1step_replays']:.1f} us; "
        f"roofline {R['roofline_ms'] * 1e3:.0f} us ({by['total'] / 1e9:.3f} GB)")
    save()

    # ---- 2. profile graph replays: 3 replays of the 4-step graph (sync between) and 4 of the 1-step graph
    g4 = capture(dec.plain_step, steps_per_replay=4, before_capture=st)
    meta = {"bytes": role_bytes, "copy_bw_TBps": R["copy_bw_TBps"], "plain_us": plain_us}
    for name, g, n, spr in (("graph4", g4, 3, 4), ("graph1", g1, 4, 1)):
        st()
        for _ in range(2):
            g()
        torch.cuda.synchronize()
        st()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                g()
                torch.cuda.synchronize()
        path = OUT / f"trace_{name}.json"
        prof.export_chrome_trace(str(path))
        try:
            res = A.analyze(str(path), {**meta, "steps_per_replay": spr, "n_replays": n})
            R[f"profile_{name}"] = res
            log(A.table(res, f"graph replays ({name})"))
        except Exception:
            R[f"profile_{name}_error"] = traceback.format_exc()[-1500:]
            log(R[f"profile_{name}_error"])
        save()
    del g4, g1
    # eager steps (kernels isolated by the host's launch time), 3 steps
    st()
    dec.plain_step()
    torch.cuda.synchronize()
    st()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            dec.plain_step()
        torch.cuda.synchronize()
    path = OUT / "trace_eager.json"
    prof.export_chrome_trace(str(path))
    try:
        res = A.analyze(str(path), {**meta, "n_replays": 1, "no_split": True, "plain_us": None})
        R["profile_eager"] = res
        log(A.table(res, "eager steps"))
    except Exception:
        R["profile_eager_error"] = traceback.format_exc()[-1500:]
        log(R["profile_eager_error"])
    save()

    # ---- 3. per-launch floor of a graph chain
    try:
        R["launch_floor"] = launch_floor()
        log("launch floor", R["launch_floor"])
    except Exception:
        R["launch_floor_error"] = traceback.format_exc()[-800:]
    save()

    # ---- 4. one-knob variants of the whole step (us per step; delta against the base)
    V = R.setdefault("variants", {})

    def variant(group, label, apply, undo):
        if time.time() - T0 > SWEEP_DEADLINE_S:
            V.setdefault(group, {})[label] = "skipped (deadline)"
            return
        try:
            apply()
            us, sp, lg = time_plain(label, iters=20)
            rel = ((lg - base_logits).abs().max() / base_logits.abs().max()).item()
            V.setdefault(group, {})[label] = {"us": round(us, 1), "delta_us": round(us - plain_us, 1),
                                              "spread": round(sp, 1), "logits_rel_diff": rel}
            log(f"  {group} {label}: {us:.1f} us ({us - plain_us:+.1f}), logits rel diff {rel:.2e}")
        except Exception as e:
            V.setdefault(group, {})[label] = "error: " + repr(e)[:300]
            log(f"  {group} {label}: error {e!r}"[:400])
        finally:
            undo()
            save()

    stack = dec.stacks[1]
    moe = stack.moe
    base_tiles = moe.tiles
    for gu in [(8, 256, 4, 6), (4, 512, 4, 6), (8, 512, 4, 4), (16, 256, 4, 4), (16, 256, 8, 4), (4, 256, 4, 6)]:
        variant("moe_gate_up_tile", str(gu), lambda gu=gu: setattr(moe, "tiles", (gu, base_tiles[1])),
                lambda: setattr(moe, "tiles", base_tiles))
    for dn in [(8, 256, 4, 6), (16, 512, 4, 5), (16, 256, 4, 6), (4, 512, 4, 6), (8, 128, 4, 6), (16, 128, 4, 6)]:
        variant("moe_down_tile", str(dn), lambda dn=dn: setattr(moe, "tiles", (base_tiles[0], dn)),
                lambda: setattr(moe, "tiles", base_tiles))

    # T=1 wqkv_a / wo GEMVs: gemv_rows tiles, or the Llama path's _gemv_kernel
    M = X.mla
    orig_gemv_rows = M.gemv_rows

    def patch(which, how):
        def wrapped(x, w, out, **kw):
            if x.shape[0] == 1 and x.dim() == 2 and w.shape == getattr(L1, which).shape:
                kind, (bn, bk, nw, stg) = how
                if kind == "rows":
                    return orig_gemv_rows(x, w, out, **{**kw, "block_n": bn, "block_k": bk, "num_warps": nw,
                                                         "stages": stg})
                res = kw.get("residual")
                return X.gemv.gemv(x.view(-1), w, out.view(-1), norm_w=kw.get("norm_w"), eps=kw.get("eps", 1e-6),
                                   residual=res.view(-1) if res is not None else None, block_n=bn, block_k=bk,
                                   num_warps=nw, stages=stg)
            return orig_gemv_rows(x, w, out, **kw)
        return lambda: setattr(M, "gemv_rows", wrapped)

    unpatch = lambda: setattr(M, "gemv_rows", orig_gemv_rows)  # noqa: E731
    for which in ("wqkv_a", "wo"):
        for how in [("rows", (8, 256, 4, 6)), ("rows", (16, 256, 4, 6)), ("rows", (4, 512, 4, 6)),
                    ("rows", (16, 512, 4, 4)), ("gemv", (8, 256, 4, 6)), ("gemv", (16, 256, 4, 6)),
                    ("gemv", (16, 512, 4, 3))]:
            variant(f"{which}_gemv", f"{how[0]}{how[1]}", patch(which, how), unpatch)

    # attention: (splits, block_s, v_chunks, warps)
    Att = X.attention.DecodeAttention
    base_attn = stack.attn
    d = model.dims
    for cfg in [(32, 32, 4, 4), (8, 64, 4, 4), (16, 64, 4, 4), (32, 16, 4, 4), (16, 32, 2, 4), (16, 32, 8, 4),
                (64, 16, 4, 4)]:
        sp, bs, vc, nw = cfg
        variant("attention", str(cfg),
                lambda sp=sp, bs=bs, vc=vc, nw=nw: setattr(stack, "attn", Att(
                    num_q_heads=d.num_heads, num_kv_heads=1, d_main=d.kv_lora_rank, d_v=d.kv_lora_rank, d_rope=d.rope,
                    num_tokens=1, num_splits=sp, block_s=bs, sm_scale=d.sm_scale, num_warps=nw, v_chunks=vc,
                    device="cuda")),
                lambda: setattr(stack, "attn", base_attn))
    R["wall_s"] = time.time() - T0
    save()
    log("done", R["wall_s"])


if __name__ == "__main__":
    try:
        main()
    except Exception:
        R["fatal"] = traceback.format_exc()[-3000:]
        print(R["fatal"], flush=True)
        save()
        sys.exit(1)
