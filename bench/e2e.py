"""End-to-end latency at concurrency 1: express lane vs standard lane vs vLLM alone, one run.

    python bench/e2e.py [--requests 20] [--max-tokens 64] [--arch llama]
    python bench/e2e.py --router-url URL --vllm-url URL --nats-url URL --model NAME   # a running stack

Without ``--router-url`` it starts ``expresslane up`` (tiny model, one decode node) and stops it at
the end. For each lane it streams the same chat requests one at a time (greedy, ``ignore_eos``)
and measures, at the client: TTFT (request sent -> first token) and TPOT ((last token - first
token) / (tokens - 1)); p50 and p99 of each. vLLM alone is the prefill vLLM asked directly (no
router). The handoff breakdown of the express requests comes from the bus (``xl.>``): extract and
transfer times reported in ``KvReady``, and inject (+ engine start) as the time from the later of
``DecodeStart`` and ``KvReady`` to ``DecodeStarted``. Prints a table and writes
``bench/results/e2e-<utc time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.processes import free_port, stop_process_groups  # noqa: E402

PROMPTS = [
    "Tell me about express lanes on a highway.",
    "Write a short poem about the sea and the wind.",
    "Explain what a KV cache is in two sentences.",
    "List three reasons to measure latency at the client.",
]


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """Stream one chat completion; client-side TTFT/TPOT in ms, and the request id."""
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        lane = r.headers.get("x-expresslane-lane", "vllm")
        rid = r.headers.get("x-request-id", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for c in json.loads(line[6:]).get("choices", []):
                n = len(c.get("token_ids") or [])
                if n:
                    stamps.append((now, n))
    num_tokens = sum(n for _, n in stamps)
    ttft_ms = (stamps[0][0] - t0) * 1000
    tpot_ms = ((stamps[-1][0] - stamps[0][0]) * 1000 / (num_tokens - 1)) if num_tokens > 1 else float("nan")
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "num_tokens": num_tokens, "lane": lane, "request_id": rid}


class BusWatch:
    """Arrival times of the express handoff events, per request id."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    async def start(self, nats_url: str) -> None:
        from shared import events, subjects
        from shared.bus import Bus

        self.bus = await Bus.connect(nats_url, name="bench")

        async def on_any(event, msg) -> None:
            now_ms = time.time() * 1000
            rid = getattr(event, "request_id", None)
            if rid is None:
                return
            rec = self.seen.setdefault(rid, {})
            if isinstance(event, events.KvReady):
                rec.update(kv_ready_at=now_ms, extract_ms=event.extract_ms, transfer_ms=event.transfer_ms)
            elif isinstance(event, events.DecodeStart):
                rec["start_at"] = now_ms
            elif isinstance(event, events.DecodeStarted):
                rec["started_at"] = now_ms

        await self.bus.subscribe(subjects.ALL, on_any, events.AnyEvent)

    def breakdown(self, rid: str) -> dict | None:
        rec = self.seen.get(rid, {})
        if "kv_ready_at" not in rec or "started_at" not in rec:
            return None
        ready = max(rec["kv_ready_at"], rec.get("start_at", 0))
        return {"extract_ms": rec["extract_ms"], "transfer_ms": rec["transfer_ms"],
                "inject_ms": max(0.0, rec["started_at"] - ready)}

    async def close(self) -> None:
        await self.bus.close()


def start_stack(args: argparse.Namespace) -> tuple[subprocess.Popen, dict]:
    """``expresslane up`` in the background; returns it and the urls it printed."""
    port, prefill_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="expresslane-bench-"))
    cmd = [sys.executable, "-m", "infra.cli", "up", "--port", str(port), "--prefill-port", str(prefill_port),
           "--decode-nodes", "1", "--slots", "1", "--arch", args.arch, "--workdir", str(workdir)]
    if args.model_dir:
        cmd += ["--model", args.model_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    urls = {"router": f"http://127.0.0.1:{port}", "vllm": f"http://127.0.0.1:{prefill_port}"}
    # A stack that stays silent is stopped at the deadline, which also ends the read below.
    watchdog = threading.Timer(900, lambda: os.killpg(proc.pid, signal.SIGTERM))
    watchdog.start()
    try:
        for line in proc.stdout:
            print("  up: " + line.rstrip(), flush=True)
            if line.startswith("nats-server"):
                urls["nats"] = line.split()[-1]
            if "expresslane is up" in line:
                urls["model"] = line.split("(model ")[1].rstrip(")\n")
                return proc, urls
        raise RuntimeError("expresslane up exited or did not come up within 900 s")
    except BaseException:
        stop_process_groups([proc], grace_s=60.0)
        raise
    finally:
        watchdog.cancel()


async def run(args: argparse.Namespace, urls: dict) -> dict:
    watch = BusWatch()
    await watch.start(urls["nats"])
    lanes = {
        "express": (f"{urls['router']}/v1/chat/completions", {"x-expresslane": "on"}),
        "standard": (f"{urls['router']}/v1/chat/completions", {"x-expresslane": "off"}),
        "vllm_alone": (f"{urls['vllm']}/v1/chat/completions", {}),
    }
    out: dict = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for lane, (url, headers) in lanes.items():
            samples = []
            for i in range(args.warmup + args.requests):
                body = {"model": urls["model"], "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True,
                        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
                res = await one_stream(client, url, body, headers)
                if lane != "vllm_alone" and res["lane"] != lane:
                    raise RuntimeError(f"asked for the {lane} lane, served by {res['lane']}")
                if i >= args.warmup:
                    samples.append(res)
            out[lane] = {
                "ttft_ms_p50": pct([s["ttft_ms"] for s in samples], 0.5),
                "ttft_ms_p99": pct([s["ttft_ms"] for s in samples], 0.99),
                "tpot_ms_p50": pct([s["tpot_ms"] for s in samples], 0.5),
                "tpot_ms_p99": pct([s["tpot_ms"] for s in samples], 0.99),
                "num_requests": len(samples),
                "samples": samples,
            }
    await asyncio.sleep(0.5)
    parts = [b for s in out["express"]["samples"] if (b := watch.breakdown(s["request_id"]))]
    out["handoff"] = {f"{k}_p50": pct([p[k] for p in parts], 0.5) for k in ("extract_ms", "transfer_ms", "inject_ms")}
    out["handoff"].update({f"{k}_p99": pct([p[k] for p in parts], 0.99) for k in ("extract_ms", "transfer_ms", "inject_ms")})
    out["handoff"]["num_requests"] = len(parts)
    await watch.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-url", default="")
    p.add_argument("--vllm-url", default="")
    p.add_argument("--nats-url", default=os.environ.get("EXPRESSLANE_NATS_URL", ""))
    p.add_argument("--model", default="", help="served model name (with --router-url)")
    p.add_argument("--model-dir", default="", help="checkpoint for the stack this script starts")
    p.add_argument("--arch", default="llama")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    proc = None
    if args.router_url:
        urls = {"router": args.router_url, "vllm": args.vllm_url, "nats": args.nats_url, "model": args.model}
    else:
        proc, urls = start_stack(args)
    try:
        result = asyncio.run(run(args, urls))
    finally:
        if proc is not None:
            stop_process_groups([proc], grace_s=60.0)
    result["config"] = {"model": urls["model"], "requests": args.requests, "max_tokens": args.max_tokens,
                        "concurrency": 1, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(f"\n{'lane':<12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}   (ms, concurrency 1)")
    for lane in ("express", "standard", "vllm_alone"):
        r = result[lane]
        print(f"{lane:<12}{r['ttft_ms_p50']:>10.1f}{r['ttft_ms_p99']:>10.1f}{r['tpot_ms_p50']:>10.2f}{r['tpot_ms_p99']:>10.2f}")
    h = result["handoff"]
    print(f"handoff (express, p50/p99 ms): extract {h['extract_ms_p50']:.2f}/{h['extract_ms_p99']:.2f}  "
          f"transfer {h['transfer_ms_p50']:.2f}/{h['transfer_ms_p99']:.2f}  "
          f"inject+start {h['inject_ms_p50']:.2f}/{h['inject_ms_p99']:.2f}  ({h['num_requests']} requests)")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"e2e-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
