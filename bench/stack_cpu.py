"""What each process of a running stack spends on a request: CPU ms per request, per service and lane.

    python bench/stack_cpu.py --stack-file WORKDIR/stack.json [--requests 60] [--max-tokens 16]
        [--lanes vllm_alone,standard,express] [--gap-ms 50]

On a host where every service shares a few cores (``expresslane up`` on a 2-core machine), a
request's latency is decided as much by what the other processes do at the same moment as by its
own path: the express lane's first token comes from vLLM while the KV write, KV-ready, the decode
node's and the coordinator's handling of it run beside it. This script sends ``--requests``
sequential streamed chat requests per lane (greedy, ``ignore_eos``, ``--gap-ms`` apart, after 3
not counted), as ``bench/e2e.py`` does, and reads every stack process's CPU time (user + system,
``/proc/PID/stat``) before and after each lane: the difference over the lane's requests is the CPU
each service spent per request. Client-side TTFT, the first decode gap (first -> second token) and
ITL and TPOT p50 are printed beside it. Writes ``bench/results/stack_cpu-<time>.json``.

Each service runs in its own process group (stack.json names its leader; nats-server is found by
its command line); a group's CPU is split into its leader and the rest (``prefill/child``: vLLM's
engine core).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import one_stream, read_stack_file, source_state  # noqa: E402
from infra.processes import group_cpu_s, process_cpu_s  # noqa: E402

LANE_HEADERS = {"express": {"x-expresslane": "on"}, "standard": {"x-expresslane": "off"}}


def stack_groups(stack: dict) -> dict[str, int]:
    """service name -> its process group (each service is started in its own group, pgid == pid)."""
    groups = {name: proc["pid"] for name, proc in stack["processes"].items() if proc.get("pid")}
    for pid_dir in Path("/proc").glob("[0-9]*"):  # nats-server: not a process stack.json names
        try:
            cmd = (pid_dir / "cmdline").read_bytes().split(b"\0")[0]
            leads = int(pid_dir.name) == os.getpgid(int(pid_dir.name))
        except OSError:
            continue
        if cmd.endswith(b"nats-server") and leads:
            groups.setdefault("nats-server", int(pid_dir.name))
    return groups


def cpu_by_service(groups: dict[str, int]) -> dict[str, float]:
    """CPU ms per service: its whole group, and apart its leader and the rest (vLLM's engine core is
    a child of the prefill's API server)."""
    out: dict[str, float] = {}
    for name, pgid in groups.items():
        total, leader = group_cpu_s(pgid) * 1000, (process_cpu_s(pgid) or 0.0) * 1000
        out[name] = leader
        if total - leader > 0:
            out[f"{name}/child"] = total - leader
    return out


async def run_lane(client: httpx.AsyncClient, urls: dict, lane: str, n: int, max_tokens: int,
                   gap_s: float) -> list[dict]:
    url = (urls["vllm"] if lane == "vllm_alone" else urls["router"]) + "/v1/chat/completions"
    out = []
    for i in range(n):
        body = {"model": urls["model"], "stream": True, "ignore_eos": True, "return_token_ids": True,
                "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Tell me about express lanes, number {i % 7}."}]}
        out.append(await one_stream(client, url, body, LANE_HEADERS.get(lane, {})))
        await asyncio.sleep(gap_s)
    return out


def summary(samples: list[dict]) -> dict:
    ttft = [s["ttft_ms"] for s in samples]
    gap1 = [s["itl_ms"][0] for s in samples if s["itl_ms"]]
    itl = [x for s in samples for x in s["itl_ms"][1:]]
    tpot = [s["tpot_ms"] for s in samples if s["num_tokens"] > 1]
    q = statistics.quantiles(ttft, n=4) if len(ttft) > 1 else [ttft[0]] * 3
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p25_ms": q[0], "ttft_p75_ms": q[2],
            "first_gap_p50_ms": statistics.median(gap1) if gap1 else None,
            "itl_p50_ms": statistics.median(itl) if itl else None,
            "tpot_p50_ms": statistics.median(tpot) if tpot else None, "lanes_served": sorted({s["lane"] for s in samples})}


async def main_async(args: argparse.Namespace) -> dict:
    urls = read_stack_file(Path(args.stack_file))
    groups = stack_groups(json.loads(Path(args.stack_file).read_text()))
    result: dict = {"lanes": {}}
    async with httpx.AsyncClient(timeout=120) as client:
        for lane in args.lanes:
            await run_lane(client, urls, lane, 3, args.max_tokens, args.gap_ms / 1000)
            before = cpu_by_service(groups)
            samples = await run_lane(client, urls, lane, args.requests, args.max_tokens, args.gap_ms / 1000)
            after = cpu_by_service(groups)
            per_request = {name: round((after[name] - before.get(name, 0.0)) / args.requests, 2)
                           for name in after}
            result["lanes"][lane] = {**summary(samples), "cpu_ms_per_request": dict(
                sorted(per_request.items(), key=lambda kv: -kv[1]))}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack-file", required=True, help="stack.json of a running `expresslane up`")
    p.add_argument("--requests", type=int, default=60, help="per lane, after 3 not counted")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lanes", default="vllm_alone,standard,express",
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--gap-ms", type=float, default=50.0, help="pause between requests")
    p.add_argument("--out", default="", help="JSON path (default bench/results/stack_cpu-<time>.json)")
    args = p.parse_args()
    bad = [lane for lane in args.lanes if lane not in ("vllm_alone", "standard", "express")]
    if bad:
        p.error(f"unknown lane(s) {bad}: use vllm_alone, standard, express")
    result = asyncio.run(main_async(args))
    result["config"] = {"requests": args.requests, "max_tokens": args.max_tokens, "gap_ms": args.gap_ms,
                        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        **source_state()}
    for lane, r in result["lanes"].items():
        print(f"{lane:10s} TTFT p50 {r['ttft_p50_ms']:6.2f} ms (p25 {r['ttft_p25_ms']:.2f}, p75 {r['ttft_p75_ms']:.2f})"
              f"  first gap {r['first_gap_p50_ms'] or 0:5.2f}  ITL p50 {r['itl_p50_ms'] or 0:5.2f}"
              f"  TPOT p50 {r['tpot_p50_ms'] or 0:5.2f}")
        print("           CPU ms per request: " + ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_request"].items()))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out or ROOT / "bench" / "results" / f"stack_cpu-{stamp}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
