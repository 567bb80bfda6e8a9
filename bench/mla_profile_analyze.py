"""Analysis of a torch.profiler chrome trace of the DeepSeek-V2-Lite-shaped plain step (MLA fast path).

Usable on the device (called by decode_gpu_mla_profile.py) and here:  python3 bench/mla_profile_analyze.py TRACE.json META.json
META: {"bytes": {role: bytes per launch}, "copy_bw_TBps": float, "plain_us": float, "steps_per_replay": int,
       "n_replays": int}
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}

ROLE = {  # (family, occurrence inside the layer) -> role
    ("_gemv_rows_kernel", 0): "wqkv_a GEMV (+attn_norm prologue)",
    ("_mla_prep_kernel", 0): "mla_prep (q_pe rope; kv_a_norm + k_pe rope -> cache)",
    ("bmm", 0): "q_nope x w_uk bmm (cuBLAS)",
    ("_attn_split_kernel", 0): "attention split (16 splits x 4 v-chunks)",
    ("_attn_combine_kernel", 0): "attention combine",
    ("bmm", 1): "o_lat x w_uv bmm (cuBLAS)",
    ("_gemv_rows_kernel", 1): "wo GEMV (+residual)",
    ("_rmsnorm_kernel", 0): "mlp_norm rmsnorm",
    ("_gemv_rows_kernel", 2): "router GEMV",
    ("_router_topk_kernel", 0): "router top-k",
    ("_moe_gate_up_kernel", 0): "MoE gate/up + SiLU (6 routed + 2 shared)",
    ("_moe_down_kernel", 0): "MoE down (8 experts)",
    ("_moe_reduce_kernel", 0): "MoE reduce + residual",
}
DENSE = {"_moe_gate_up_kernel": "L0 dense gate/up + SiLU (inter 10944)", "_moe_down_kernel": "L0 dense down",
         "_moe_reduce_kernel": "L0 dense reduce + residual"}
POST = {"_rmsnorm_kernel": "final rmsnorm", "_gemv_kernel": "lm_head GEMV + block argmax", "_pick_kernel": "greedy pick + emit"}


def family(name: str) -> str:
    if name.startswith("_"):
        return name
    low = name.lower()
    if "nvjet" in low or "gemm" in low or "cublas" in low or "cutlass" in low:
        return "bmm"
    return name[:70]


def load_gpu_events(trace_path: str) -> tuple[list[dict], list[dict]]:
    with open(trace_path) as f:
        tr = json.load(f)
    evs = tr["traceEvents"] if isinstance(tr, dict) else tr
    gpu = [e for e in evs if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    cpu = [e for e in evs if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu.sort(key=lambda e: e["ts"])
    return gpu, cpu


def split_replays(gpu: list[dict], cpu: list[dict], n_replays: int, gap_us: float = 15.0) -> list[list[dict]]:
    """Kernels of each graph replay: by the correlation id of the cudaGraphLaunch, else by idle gaps."""
    launches = {e["args"].get("correlation") for e in cpu if "GraphLaunch" in e.get("name", "") and "args" in e}
    launches.discard(None)
    if launches:
        groups = defaultdict(list)
        for e in gpu:
            c = e.get("args", {}).get("correlation")
            if c in launches:
                groups[c].append(e)
        out = [sorted(g, key=lambda e: e["ts"]) for _, g in sorted(groups.items())]
        if len(out) == n_replays:
            return out
    out, cur = [], []
    for e in gpu:
        if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > gap_us:
            out.append(cur)
            cur = []
        cur.append(e)
    if cur:
        out.append(cur)
    return out


def split_steps(seq: list[dict]) -> list[list[dict]]:
    steps, cur = [], []
    for e in seq:
        cur.append(e)
        if e["name"] == "_pick_kernel":
            steps.append(cur)
            cur = []
    if cur:
        steps.append(cur)
    return steps


def label_step(step: list[dict]) -> list[str]:
    """Role of each kernel of one plain step, in order."""
    names = [e["name"] for e in step]
    prep = [i for i, n in enumerate(names) if n == "_mla_prep_kernel"]
    labels = [None] * len(names)
    if not prep:
        return [family(n) for n in names]
    starts = [p - 1 for p in prep]
    last_reduce = max((i for i, n in enumerate(names) if n == "_moe_reduce_kernel"), default=len(names) - 1)
    for i in range(0, starts[0]):
        labels[i] = "embed gather" if "index" in names[i].lower() else "pre: " + family(names[i])
    for li, s in enumerate(starts):
        end = starts[li + 1] if li + 1 < len(starts) else last_reduce + 1
        occ = defaultdict(int)
        for i in range(s, end):
            fam = family(names[i])
            k = occ[fam]
            occ[fam] += 1
            if li == 0 and fam in DENSE:
                labels[i] = DENSE[fam]
            else:
                labels[i] = ROLE.get((fam, k), f"other: {fam} #{k}")
    for i in range(last_reduce + 1, len(names)):
        labels[i] = POST.get(names[i], "post: " + family(names[i]))
    return labels


def analyze(trace_path: str, meta: dict) -> dict:
    gpu, cpu = load_gpu_events(trace_path)
    spr = meta.get("steps_per_replay", 1)
    reps = [gpu] if meta.get("no_split") else split_replays(gpu, cpu, meta.get("n_replays", 0))
    role_dur = defaultdict(list)  # role -> per-launch durations
    role_gap = defaultdict(list)  # role -> gap before each launch (inside a replay)
    role_cnt = defaultdict(int)
    grid = {}
    spans, busy, gaps_tot, nsteps, nk = [], [], [], 0, []
    for rep in reps:
        span = rep[-1]["ts"] + rep[-1]["dur"] - rep[0]["ts"]
        b = sum(e["dur"] for e in rep)
        steps = split_steps(rep)
        spans.append(span / max(1, len(steps)))
        busy.append(b / max(1, len(steps)))
        gaps_tot.append((span - b) / max(1, len(steps)))
        prev_end = None
        for st in steps:
            nsteps += 1
            nk.append(len(st))
            for e, lab in zip(st, label_step(st)):
                role_dur[lab].append(e["dur"])
                role_cnt[lab] += 1
                if prev_end is not None:
                    role_gap[lab].append(max(0.0, e["ts"] - prev_end))
                prev_end = e["ts"] + e["dur"]
                a = e.get("args", {})
                if lab not in grid and "grid" in a:
                    grid[lab] = {"grid": a.get("grid"), "block": a.get("block"),
                                 "regs": a.get("registers per thread"), "smem": a.get("shared memory")}
    bw = meta.get("copy_bw_TBps", 4.2)
    by = meta.get("bytes", {})
    rows = []
    for lab, ds in role_dur.items():
        per_step = sum(ds) / nsteps
        per_launch = sum(ds) / len(ds)
        nb = by.get(lab)
        ideal = (nb / (bw * 1e12) * 1e6) * (len(ds) / nsteps) if nb else 0.0
        rows.append({"role": lab, "launches_per_step": len(ds) / nsteps, "us_per_step": per_step,
                     "us_per_launch": per_launch, "min_us": min(ds), "max_us": max(ds),
                     "MB_per_launch": nb / 1e6 if nb else None,
                     "GBps": nb / (per_launch * 1e-6) / 1e9 if nb else None,
                     "ideal_us_per_step_at_copy_bw": ideal, "excess_us_per_step": per_step - ideal,
                     "gap_before_us_per_step": sum(role_gap[lab]) / nsteps,
                     "gap_before_us_mean": (sum(role_gap[lab]) / len(role_gap[lab])) if role_gap[lab] else None,
                     **({"launch": grid[lab]} if lab in grid else {})})
    rows.sort(key=lambda r: -r["us_per_step"])
    res = {"n_replays_found": len(reps), "n_steps": nsteps, "kernels_per_step": sum(nk) / max(1, len(nk)),
           "span_us_per_step": sum(spans) / max(1, len(spans)), "kernel_us_per_step": sum(busy) / max(1, len(busy)),
           "gap_us_per_step": sum(gaps_tot) / max(1, len(gaps_tot)), "rows": rows}
    if meta.get("plain_us"):
        res["plain_us_no_profiler"] = meta["plain_us"]
        res["gap_vs_unprofiled_us"] = meta["plain_us"] - res["kernel_us_per_step"]
    return res


def table(res: dict, title: str = "") -> str:
    L = [f"### {title}" if title else "",
         f"steps {res['n_steps']}, kernels/step {res['kernels_per_step']:.0f}, span/step {res['span_us_per_step']:.1f} us, "
         f"kernel time/step {res['kernel_us_per_step']:.1f} us, gaps/step {res['gap_us_per_step']:.1f} us"
         + (f", unprofiled step {res['plain_us_no_profiler']:.1f} us" if "plain_us_no_profiler" in res else ""),
         "",
         "| role | launches/step | us/step | us/launch (min-max) | MB/launch | GB/s | ideal us/step | excess us/step | gap before, us/step |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        mb = f"{r['MB_per_launch']:.2f}" if r["MB_per_launch"] else "~0"
        gb = f"{r['GBps']:.0f}" if r["GBps"] else "-"
        L.append(f"| {r['role']} | {r['launches_per_step']:.0f} | {r['us_per_step']:.1f} | {r['us_per_launch']:.2f} "
                 f"({r['min_us']:.1f}-{r['max_us']:.1f}) | {mb} | {gb} | {r['ideal_us_per_step_at_copy_bw']:.1f} | "
                 f"{r['excess_us_per_step']:.1f} | {r['gap_before_us_per_step']:.1f} |")
    return "\n".join(L)


if __name__ == "__main__":
    meta = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
    r = analyze(sys.argv[1], meta)
    print(table(r, sys.argv[1]))
