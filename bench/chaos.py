"""Faults and load on the embedded stack (tiny model, CPU): what is lost, hung, leaked, and how fast
the lane recovers. One run, every figure from that run.

    python bench/chaos.py [--only load200,abort_storm,...] [--clients 200] [--aborts 500]

Starts ``expresslane up`` (2 decode nodes x 2 slots, one vLLM prefill with the express connector)
and runs, in order:

- ``load200``: N concurrent streaming express clients (greedy, ``ignore_eos``): each must be served
  with every token or answered 429 with ``Retry-After``; none may hang or be lost.
- ``abort_storm``: M concurrent streaming clients, cut off in one burst once the slots are busy:
  the time until every lease, decode slot and staging slot is free again, and whether any leaked.
- ``decode_kill``: streams in flight when a decode node is SIGKILLed: each stream's token ids must
  equal an uninterrupted greedy run (vLLM's own) - tokens lost or repeated are counted.
- ``prefill_cpu``: the prefill vLLM's CPU (all its processes, % of one core, a 10 s window) while
  idle after serving express requests, the same for a plain vLLM without the connector, and 10 s
  after a receiver died in the middle of a write (``dead_receiver_prefill_cpu_pct``).
- ``checksum``: a second stack whose prefill sums every segment (XXH3) and corrupts every second
  transfer on purpose after summing: each must be caught before injection and its request
  migrated with unchanged output; the sums' cost comes from bench/kv_checksum.py's results.
- ``coordinator_failover`` / ``nats_node_kill``: their own processes (bench/chaos_coordinator.py,
  bench/chaos_nats.py).

Throughout, every handoff event on the bus is watched: a slot granted while another live lease
holds it counts in ``slots_double_granted``. Prints a table and writes ``bench/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos_coordinator import Ledger  # noqa: E402
from infra.processes import free_port, group_cpu_s, stop_process_groups  # noqa: E402

PROMPTS = ["Tell me about express lanes on a highway.", "Write a short poem about the sea.",
           "Explain what a KV cache is.", "List three reasons to measure latency."]


# ---------------------------------------------------------------- the stack


class Stack:
    """``expresslane up`` in the background and what its stack.json says."""

    def __init__(self, decode_nodes: int, slots: int, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="expresslane-chaos-"))
        self.port = free_port()
        cmd = [sys.executable, "-m", "infra.cli", "up", "--port", str(self.port), "--decode-nodes",
               str(decode_nodes), "--slots", str(slots), "--workdir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, start_new_session=True, env={**os.environ, **(env or {})})
        watchdog = threading.Timer(900, lambda: os.killpg(self.proc.pid, signal.SIGTERM))
        watchdog.start()
        try:
            for line in self.proc.stdout:
                print("  up: " + line.rstrip(), flush=True)
                if "endpoints:" in line:
                    break
            else:
                raise RuntimeError("expresslane up exited or did not come up within 900 s")
        except BaseException:
            self.stop()
            raise
        finally:
            watchdog.cancel()
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.info = json.loads((self.workdir / "stack.json").read_text())
        self.router = self.info["router_url"]
        self.model = self.info["model"]
        self.nats_url = self.info["nats_url"]
        self.vllm = self.info["processes"]["prefill"]["health_url"].removesuffix("/health")

    def health(self, name: str) -> dict:
        return httpx.get(self.info["processes"][name]["health_url"], timeout=5).json()

    def decode_nodes(self) -> list[str]:
        return [n for n in self.info["processes"] if n.startswith("decode-")]

    def leftovers(self) -> dict:
        """What is still held: leases and waiting claims, busy decode slots, busy staging slots."""
        from services.prefill.staging import read_stats

        coord = self.health("coordinator")
        warm = len(self.health("router").get("warm_leases", []))  # held ready on purpose
        out = {"leases": coord["leases"] - warm, "queued": coord["queued"]}
        for name in self.decode_nodes():
            with contextlib.suppress(httpx.HTTPError):
                h = self.health(name)
                out[name] = h["total_slots"] - len(h["free_slots"]) + len(h["active"])
        stats = read_stats(self.info["staging_stats_path"])
        out["staging_busy"] = stats["total"] - stats["free"]
        return {k: v for k, v in out.items() if v}

    async def wait_clean(self, timeout_s: float) -> tuple[float, dict]:
        """Seconds until nothing is held (polled every 10 ms), and what was left if it timed out.
        ``self.last_held_s``: per kind of thing held, when it was last seen held (seconds)."""
        t0 = time.monotonic()
        left: dict = {}
        self.last_held_s = {}
        while time.monotonic() - t0 < timeout_s:
            left = await asyncio.to_thread(self.leftovers)
            for kind in left:
                self.last_held_s[kind] = round(time.monotonic() - t0, 3)
            if not left:
                return time.monotonic() - t0, {}
            await asyncio.sleep(0.01)
        return time.monotonic() - t0, left

    def stop(self) -> None:
        stop_process_groups([self.proc], grace_s=60.0)


class GrantWatch:
    """Every handoff event on the bus: double grants (a slot granted while another live lease holds
    it: bench.chaos_coordinator.Ledger), grants, and why legs failed."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.num_claimed = 0
        self.failed: dict[str, str] = {}  # leg id -> reason

    async def start(self, nats_url: str) -> None:
        from shared import subjects
        from shared.bus import Bus
        from shared.events import HandoffEvent

        self.bus = await Bus.connect(nats_url, name="bench-chaos")

        async def on_event(ev, _msg) -> None:
            self.ledger.on_event(ev)
            self.num_claimed += ev.state == "claimed"
            if ev.state == "failed":
                self.failed[ev.request_id] = ev.reason

        await self.bus.subscribe(subjects.HANDOFF_ALL, on_event, HandoffEvent)

    async def close(self) -> None:
        await self.bus.close()


def chat(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}


async def stream_one(client: httpx.AsyncClient, stack: Stack, body: dict, on_token=None) -> dict:
    """One streaming express request: its status, Retry-After, token ids and usage."""
    out: dict = {"status": 0, "token_ids": [], "prompt_token_ids": None, "usage": None}
    async with client.stream("POST", f"{stack.router}/v1/chat/completions", json=body,
                             headers={"x-expresslane": "on"}) as r:
        out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
        out["request_id"] = r.headers.get("x-request-id", "")
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            out["prompt_token_ids"] = out["prompt_token_ids"] or event.get("prompt_token_ids")
            out["usage"] = event.get("usage") or out["usage"]
            for choice in event.get("choices", []):
                out["token_ids"] += choice.get("token_ids") or []
            if on_token is not None:
                on_token(out)
    return out


# ---------------------------------------------------------------- scenarios


async def load(stack: Stack, num_clients: int, max_tokens: int = 16, timeout_s: float = 600) -> dict:
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int):
            body = chat(stack.model, PROMPTS[i % len(PROMPTS)], max_tokens)
            try:
                return await asyncio.wait_for(stream_one(client, stack, body), timeout_s)
            except asyncio.TimeoutError:
                return {"status": "hung"}
            except httpx.HTTPError as exc:
                return {"status": f"error: {type(exc).__name__}"}

        results = await asyncio.gather(*(one(i) for i in range(num_clients)))
    served = [r for r in results if r["status"] == 200 and len(r["token_ids"]) == max_tokens
              and (r["usage"] or {}).get("completion_tokens") == max_tokens]
    rejected = [r for r in results if r["status"] == 429 and (r.get("retry_after") or "").isdigit()]
    hung = [r for r in results if r["status"] == "hung"]
    recovery_s, left = await stack.wait_clean(30.0)
    return {"load200_requests_total": num_clients, "load200_requests_served": len(served),
            "load200_requests_rejected_429": len(rejected), "load200_requests_hung": len(hung),
            "load200_requests_lost": num_clients - len(served) - len(rejected) - len(hung),
            "load200_leaked": left}


async def abort_storm(stack: Stack, num_clients: int, timeout_s: float = 120) -> dict:
    """Open streams from a client process, wait until the decode slots are busy, then kill that
    process: the kernel closes every client socket at once (a burst no client library can make
    by cancelling its streams one by one). Recovery runs from the kill until nothing is held."""
    status_path = Path(tempfile.mkdtemp(prefix="xl-storm-")) / "clients.json"
    clients = subprocess.Popen([sys.executable, __file__, "--storm-clients", stack.router, stack.model,
                                str(num_clients), str(status_path)])
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = sum(len(stack.health(n)["active"]) for n in stack.decode_nodes())
            total = sum(stack.health(n)["total_slots"] for n in stack.decode_nodes())
            if busy == total:
                break
            await asyncio.sleep(0.05)
        status = json.loads(status_path.read_text()) if status_path.exists() else {}
        t_burst = time.monotonic()
        clients.kill()
        clients.wait()
    finally:
        if clients.poll() is None:
            clients.kill()
    closed_s = time.monotonic() - t_burst
    recovery_s, left = await stack.wait_clean(30.0)
    return {"abort_storm_clients": num_clients, "abort_storm_open_at_burst": status.get("open"),
            "abort_storm_recovery_ms": None if left else round((closed_s + recovery_s) * 1000, 1),
            "abort_storm_clients_closed_ms": round(closed_s * 1000, 1),
            # clients that ended before the burst, by status (429 when the queue was full)
            "abort_storm_ended_before_burst": status.get("ended"),
            "abort_storm_last_held_ms": {k: round((closed_s + v) * 1000, 1)
                                         for k, v in stack.last_held_s.items()},
            "abort_storm_leaked": sum(left.values()), "abort_storm_left": left}


async def storm_clients(router: str, model: str, num_clients: int, status_path: Path) -> None:
    """The abort storm's clients (``--storm-clients``): stream until killed, writing how many are
    open and how the others ended every 50 ms."""
    target = types.SimpleNamespace(router=router)
    ended: collections.Counter = collections.Counter()
    num_open = 0
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> None:
            nonlocal num_open
            num_open += 1
            try:
                r = await stream_one(client, target, chat(model, PROMPTS[i % 4], 1500))
                ended[str(r["status"])] += 1
            except Exception as exc:  # noqa: BLE001 - counted, the storm goes on
                ended[type(exc).__name__] += 1
            finally:
                num_open -= 1

        tasks = [asyncio.create_task(one(i)) for i in range(num_clients)]
        while True:
            tmp = status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"open": num_open, "ended": dict(ended)}))
            tmp.replace(status_path)
            await asyncio.sleep(0.05)
        del tasks


def vllm_greedy(stack: Stack, prompt_ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": stack.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{stack.vllm}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def decode_kill(stack: Stack, num_streams: int = 4, max_tokens: int = 200) -> dict:
    """Streams in flight on every node; one node is SIGKILLed once each has 10 tokens."""
    victim = stack.decode_nodes()[0]
    ready = asyncio.Event()
    counts: dict[int, int] = {}

    def progress(i):
        def on_token(out):
            counts[i] = len(out["token_ids"])
            if len(counts) == num_streams and min(counts.values()) >= 10:
                ready.set()
        return on_token

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_one(client, stack, chat(stack.model, PROMPTS[i % 4], max_tokens),
                                                progress(i))) for i in range(num_streams)]
        await asyncio.wait_for(ready.wait(), 300)
        os.kill(stack.info["processes"][victim]["pid"], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    lost = repeated = completed = 0
    for r in results:
        want = await asyncio.to_thread(vllm_greedy, stack, r["prompt_token_ids"], max_tokens)
        got = r["token_ids"]
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        lost += len(want) - same
        repeated += len(got) - same
        completed += got == want
    return {"decode_kill_streams_total": num_streams, "decode_kill_streams_completed": completed,
            "decode_kill_tokens_lost": lost, "decode_kill_tokens_repeated": repeated}


def cpu_pct(pgid: int, settle_s: float = 10.0, window_s: float = 10.0) -> float:
    time.sleep(settle_s)
    c0 = group_cpu_s(pgid)
    time.sleep(window_s)
    return round((group_cpu_s(pgid) - c0) / window_s * 100, 1)


def prefill_pgid(stack: Stack) -> int:
    return stack.info["processes"]["prefill"]["pid"]  # `up` starts each in its own group


def plain_vllm_idle_cpu(stack: Stack) -> float:
    """A plain vLLM (no connector) on the same model, idle after serving a few requests."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", stack.model,
           "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        for prompt in PROMPTS:
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": stack.model, "prompt": prompt, "max_tokens": 16})
        return cpu_pct(proc.pid)
    finally:
        stop_process_groups([proc], grace_s=30.0)


def dead_receiver_cpu(stack: Stack) -> float:
    """A receiver stalls mid-write (SIGSTOP) and is then killed; the prefill's CPU 10 s later."""
    from infra.receiver import ReceiverProcess
    from shared.events import SlotTarget, TransferTarget
    from shared.handoff import Handoff, request_params
    from shared.kvlayout import kv_shape_from_hf_config, layout_spec

    config = json.loads((Path(stack.model) / "config.json").read_text())
    layout = layout_spec(kv_shape_from_hf_config(config, include_mtp=False), "float32", 2048)
    rx = ReceiverProcess("mooncake", layout.slot_nbytes)
    rid = f"chaos-{uuid.uuid4().hex[:8]}"
    target = TransferTarget(node_id="chaos-node", transport="mooncake", endpoint=rx.endpoint,
                            slot=SlotTarget(slot=0, base_addr=rx.addr, nbytes=rx.nbytes), layout=layout)
    params = request_params(Handoff(request_id=rid, lease_id=f"lease-{rid}", generation=1, target=target))
    body = {"model": stack.model, "prompt": [1] + [7] * 500, "max_tokens": 1, "kv_transfer_params": params}
    os.kill(rx.proc.pid, signal.SIGSTOP)
    try:
        httpx.post(f"{stack.vllm}/v1/completions", json=body, timeout=120)
        time.sleep(0.5)  # the write is under way against a receiver that does not answer
    finally:
        rx.kill()
        rx.close()
    return cpu_pct(prefill_pgid(stack))


async def prefill_cpu(stack: Stack) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(4):
            await stream_one(client, stack, chat(stack.model, PROMPTS[i], 16))
    await stack.wait_clean(30.0)
    idle = await asyncio.to_thread(cpu_pct, prefill_pgid(stack))
    plain = await asyncio.to_thread(plain_vllm_idle_cpu, stack)
    dead = await asyncio.to_thread(dead_receiver_cpu, stack)
    return {"idle_prefill_cpu_pct": idle, "idle_plain_vllm_cpu_pct": plain,
            "dead_receiver_prefill_cpu_pct": dead}


async def checksum(num_requests: int = 4, max_tokens: int = 16) -> dict:
    """A stack whose prefill sums every segment and, on purpose, corrupts every second transfer
    after summing: each corrupted hand-off must be caught at the decode node and its request
    migrated, with output equal to an uninterrupted greedy run."""
    env = {"EXPRESSLANE_KV_CHECKSUM": "1", "EXPRESSLANE_FAULT_FLIP_KV_BYTE_EVERY": "2"}
    stack = await asyncio.to_thread(Stack, 2, 1, env)
    watch = GrantWatch()
    try:
        await watch.start(stack.nats_url)
        detected_and_migrated = correct = 0
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(num_requests):
                body = chat(stack.model, PROMPTS[i % len(PROMPTS)], max_tokens)
                body["messages"][0]["content"] += f" ({i})"
                out = await stream_one(client, stack, body)
                want = await asyncio.to_thread(vllm_greedy, stack, out["prompt_token_ids"], max_tokens)
                correct += out["token_ids"] == want
                rid = out.get("request_id", "")
                legs = {leg: reason for leg, reason in watch.failed.items() if leg.startswith(rid)}
                detected_and_migrated += (out["token_ids"] == want and "checksum" in legs.values())
        await asyncio.sleep(0.5)
        failures = list(watch.failed.values())
        await watch.close()
        return {"checksum_requests": num_requests, "checksum_requests_correct": correct,
                "checksum_failures_seen": failures.count("checksum"),
                "checksum_detected_and_migrated": detected_and_migrated,
                **checksum_overhead()}
    finally:
        await asyncio.to_thread(stack.stop)


def checksum_overhead() -> dict:
    """From bench/kv_checksum.py's last results: the sums' cost against the transfer they guard."""
    path = ROOT / "bench" / "results" / "kv_checksum.json"
    if not path.exists():
        return {"checksum_overhead_frac": None}
    rows = json.loads(path.read_text())["rows"]
    tiny = [r for r in rows if r["transfer_basis"].startswith("measured") and r["threads"] == 1]
    big = [r for r in rows if r["shape"] == "llama-3-8b" and r["num_tokens"] == 8192
           and r["transfer_basis"] == "25GB/s" and r["threads"] == 1]
    return {"checksum_overhead_frac": round(max(r["checksum_overhead_frac"] for r in tiny), 3) if tiny else None,
            "checksum_overhead_frac_llama3_8b_8k_25gbps": round(big[0]["checksum_overhead_frac"], 2) if big else None}


async def optional(module: str, func: str) -> dict:
    """A scenario that brings its own processes, from its own module (skipped when absent)."""
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        return {f"{module}.skipped": str(exc)}
    result = fn()
    return await result if asyncio.iscoroutine(result) else result


# ---------------------------------------------------------------- main

SCENARIOS = ("load200", "abort_storm", "prefill_cpu", "decode_kill", "coordinator_failover",
             "nats_node_kill", "checksum")


async def run(args: argparse.Namespace) -> dict:
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    out: dict = {}
    if only & {"load200", "abort_storm", "prefill_cpu", "decode_kill"}:
        stack = await asyncio.to_thread(Stack, 2, 2)
        watch = GrantWatch()
        try:
            await watch.start(stack.nats_url)
            if "load200" in only:
                out.update(await load(stack, args.clients))
            if "abort_storm" in only:
                out.update(await abort_storm(stack, args.aborts))
            if "prefill_cpu" in only:
                out.update(await prefill_cpu(stack))
            if "decode_kill" in only:  # last: the killed node restarts under `up`'s supervision
                out.update(await decode_kill(stack))
            out["slots_double_granted"] = watch.ledger.double_grants
            out["stack_claims_granted"] = watch.num_claimed
            await watch.close()
        finally:
            await asyncio.to_thread(stack.stop)
    if "coordinator_failover" in only:
        out.update(await optional("bench.chaos_coordinator", "measure_failover"))
    if "nats_node_kill" in only:
        out.update(await optional("bench.chaos_nats", "measure_nats_node_kill"))
    if "checksum" in only:
        out.update(await checksum())
    return out


def main() -> int:
    if sys.argv[1:2] == ["--storm-clients"]:
        router, model, num, path = sys.argv[2:6]
        asyncio.run(storm_clients(router, model, int(num), Path(path)))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SCENARIOS)}; "
                   "updates those scenarios' keys in bench/results/chaos.json and keeps the rest "
                   "(config.runs: when and with which settings each was last run)")
    p.add_argument("--clients", type=int, default=200, help="concurrent clients of the load scenario")
    p.add_argument("--aborts", type=int, default=500, help="clients cut off in the abort storm")
    args = p.parse_args()
    result = asyncio.run(run(args))
    result["config"] = {"clients": args.clients, "aborts": args.aborts, "decode_nodes": 2, "slots": 2,
                        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    width = max(len(k) for k in result)
    for key, value in result.items():
        if key != "config":
            print(f"{key:<{width}}  {value}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "chaos.json"
    if args.only and path.exists():  # a subset run updates its scenarios' keys, keeps the others
        merged = json.loads(path.read_text())
        settings = {"utc": result["config"]["utc"], "clients": args.clients, "aborts": args.aborts}
        runs = {**merged.get("config", {}).get("runs", {}),
                **{name: settings for name in args.only.split(",")}}
        config = merged.get("config", {})  # the full run's
        merged.update(result)
        merged["config"] = {**config, "runs": runs}
        result = merged
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
