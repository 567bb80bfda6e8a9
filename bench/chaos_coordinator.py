"""Coordinator failover under load: SIGKILL the leading coordinator, measure until claims are
granted again, and count what was lost.

    python bench/chaos_coordinator.py [--kills 3] [--workers 3]
    # or, from bench/chaos.py:  await measure_failover()

Starts its own nats-server (infra.nats.NatsServer, JetStream in a temp dir), two ``expresslane
coordinator`` processes and one ``expresslane decode`` node on a generated tiny Llama; this process
plays router and prefill: ``workers`` clients claim a slot, publish KV-ready and the decode start,
read the tokens, and claim again, without pause. A claim with no answer (no leader right now, or a
leader that died under it) is sent again with the same request id, as the router's retry does.

Each kill: the leader is SIGKILLed while the load runs, the standby takes over, the killed one is
started again (it becomes the standby) before the next kill. Figures (one run):

- ``coordinator_failover_ms``: kill -> the first grant of a claim *sent after* the kill (so it can
  only come from the new leader); the median of the kills, ``..._max_ms`` the worst.
- ``coordinator_failover_leases_lost``: leases granted (before, across or after a kill) that did
  not end ``completed`` once the load stopped and drained (failed, or never ended).
- ``coordinator_failover_double_grants``: a slot granted while another lease on it had not ended.
- ``coordinator_failover_requests``: requests served end to end during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.nats import DEV_CONFIG, NatsServer  # noqa: E402
from infra.processes import free_port, stop_process_groups  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import Bus, BusTimeout  # noqa: E402
from shared.events import (  # noqa: E402
    ClaimGranted, ClaimRejected, ClaimReply, ClaimRequest, DecodeStart, HandoffEvent, KvReady,
    RequestFailed, RequestFinished, SamplingParams, TokenMessage,
)

TERMINAL = {"completed", "failed", "cancelled"}
CLAIM_TIMEOUT_S = 0.5  # a claim the dead leader swallowed is sent again after this


class Service:
    """One ``expresslane`` service process in its own process group, with /health."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.port = name, args, free_port()
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> Service:
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="0-1")
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "infra.cli", *self.args, "--http-port", str(self.port)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def health(self) -> dict:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            return {}

    async def wait(self, until, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}); log {self.log_path}")
            body = await asyncio.to_thread(self.health)
            if body and until(body):
                return body
            await asyncio.sleep(0.02)
        raise RuntimeError(f"{self.name}: condition not met in {timeout_s} s; log {self.log_path}")

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(timeout=10)


class Ledger:
    """Every lease seen on the bus: who holds each slot, how each lease ended."""

    def __init__(self) -> None:
        self.holder: dict[tuple[str, int], str] = {}
        self.outcome: dict[str, str] = {}  # lease id -> last state
        self.double_grants = 0

    def on_event(self, ev: HandoffEvent) -> None:
        if not ev.lease_id:
            return
        if ev.state == "claimed":
            previous = self.holder.get((ev.node_id, ev.slot))
            if previous not in (None, ev.lease_id) and self.outcome.get(previous) not in TERMINAL:
                self.double_grants += 1
            self.holder[(ev.node_id, ev.slot)] = ev.lease_id
        if self.outcome.get(ev.lease_id) not in TERMINAL:
            self.outcome[ev.lease_id] = ev.state


class Load:
    """``workers`` clients claiming and decoding without pause; grant times after each kill."""

    def __init__(self, bus: Bus, model: str, workers: int) -> None:
        self.bus, self.model, self.num_workers = bus, model, workers
        self.stop = asyncio.Event()
        self.kill_at: float | None = None
        self.first_grant_after_kill: float | None = None
        self.num_served = 0
        self.errors: list[str] = []

    async def claim(self, rid: str) -> ClaimGranted:
        while True:
            sent_at = time.monotonic()
            try:
                reply = await self.bus.request(subjects.CLAIM, ClaimRequest(
                    request_id=rid, model=self.model, num_prompt_tokens=8, max_tokens=4,
                    wait_ms=30_000), ClaimReply, CLAIM_TIMEOUT_S)
            except BusTimeout:  # no leader now, or the leader died under this claim
                await asyncio.sleep(0.005)
                continue
            if isinstance(reply, ClaimRejected):
                await asyncio.sleep(max(reply.retry_after_ms, 5) / 1000)
                continue
            if self.kill_at is not None and sent_at > self.kill_at and self.first_grant_after_kill is None:
                self.first_grant_after_kill = time.monotonic()
            return reply

    async def run_one(self, grant: ClaimGranted) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def on_token(ev, _msg):
            queue.put_nowait(ev)

        sub = await self.bus.subscribe(subjects.req_tokens(grant.request_id), on_token, TokenMessage)
        slot = grant.target.slot.slot
        await self.bus.publish(subjects.kv_ready(grant.node_id), KvReady(
            request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
            node_id=grant.node_id, slot=slot, num_tokens=8,
            layout_version=grant.target.layout.layout_version, nbytes=0))
        await self.bus.publish(subjects.decode_start(grant.node_id), DecodeStart(
            request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
            slot=slot, first_token_id=1, num_prompt_tokens=8,
            sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), 60)
                except asyncio.TimeoutError:  # counted (its lease ends failed), the load goes on
                    self.errors.append(f"{grant.request_id}: no end within 60 s")
                    return
                if isinstance(ev, (RequestFinished, RequestFailed)):
                    if isinstance(ev, RequestFailed):
                        self.errors.append(f"{grant.request_id}: {ev.reason}")
                    return
        finally:
            await sub.unsubscribe()

    async def worker(self, name: str) -> None:
        n = 0
        while not self.stop.is_set():
            grant = await self.claim(f"{name}-{n}")
            await self.run_one(grant)
            self.num_served += 1
            n += 1


async def measure_failover(kills: int = 3, workers: int = 3, slots: int = 4,
                           workdir: Path | None = None) -> dict:
    """Run the scenario (module docstring); returns the figures as a flat dict."""
    from infra.tinymodel import make_model

    workdir = Path(workdir or tempfile.mkdtemp(prefix="expresslane-failover-"))
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model = make_model("llama", workdir / "tiny-llama")
    nats = NatsServer(workdir / "nats", config_file=DEV_CONFIG, log_path=log_dir / "nats-server.log",
                      stop_with_parent=True)
    nats.start(timeout_s=15.0)
    services: list[Service] = []
    bus: Bus | None = None
    try:
        def coordinator(i: int) -> Service:
            s = Service(f"coordinator-{i}", ["coordinator", "--nats-url", nats.url,
                                             "--coordinator-id", f"c{i}"], log_dir).start()
            services.append(s)
            return s

        coords = [coordinator(0)]
        await coords[0].wait(lambda h: h.get("role") == "leader")
        coords.append(coordinator(1))
        await coords[1].wait(lambda h: h.get("role") == "standby")
        node = Service("d1", ["decode", "--nats-url", nats.url, "--model", str(model), "--slots",
                              str(slots), "--node-id", "d1", "--max-seq-len", "256"], log_dir).start()
        services.append(node)
        await node.wait(lambda h: True, timeout_s=300)
        for c in coords:
            await c.wait(lambda h: "d1" in h.get("nodes", []))

        bus = await Bus.connect(nats.url, name="bench-failover")
        ledger = Ledger()

        async def on_event(ev, _msg):
            ledger.on_event(ev)

        await bus.subscribe(subjects.HANDOFF_ALL, on_event, HandoffEvent)
        load = Load(bus, model.name, workers)
        tasks = [asyncio.create_task(load.worker(f"w{i}")) for i in range(workers)]
        failover_ms: list[float] = []
        for k in range(kills):
            await asyncio.sleep(1.0)  # load on the current leader
            leader = next(c for c in coords if c.health().get("role") == "leader")
            standby = next(c for c in coords if c is not leader)
            load.first_grant_after_kill = None
            load.kill_at = time.monotonic()
            leader.kill()
            while load.first_grant_after_kill is None:
                if time.monotonic() - load.kill_at > 60:
                    raise RuntimeError(f"no claim granted within 60 s of killing {leader.name}; "
                                       f"logs in {log_dir}")
                await asyncio.sleep(0.005)
            failover_ms.append((load.first_grant_after_kill - load.kill_at) * 1000)
            load.kill_at = None
            await standby.wait(lambda h: h.get("role") == "leader", 30)
            coords = [standby, coordinator(len(services))]  # the next standby
            await coords[1].wait(lambda h: h.get("role") == "standby" and "d1" in h.get("nodes", []))
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        # Drain: every lease ends and the leader holds nothing.
        await coords[0].wait(lambda h: h.get("leases") == 0 and h.get("queued") == 0, 60)
        lost = sum(1 for state in ledger.outcome.values() if state != "completed")
        return {
            "coordinator_failover_ms": round(statistics.median(failover_ms), 1),
            "coordinator_failover_max_ms": round(max(failover_ms), 1),
            "coordinator_failover_kills": kills,
            "coordinator_failover_leases_lost": lost,
            "coordinator_failover_double_grants": ledger.double_grants,
            "coordinator_failover_requests": load.num_served,
            "coordinator_failover_request_errors": len(load.errors),
        }
    finally:
        if bus is not None:
            await bus.close()
        stop_process_groups([s.popen for s in services if s.popen is not None], grace_s=10.0)
        nats.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=3, help="leader kills (default 3)")
    p.add_argument("--workers", type=int, default=3, help="concurrent clients (default 3)")
    args = p.parse_args()
    result = asyncio.run(measure_failover(kills=args.kills, workers=args.workers))
    result["config"] = {"kills": args.kills, "workers": args.workers, "slots": 4,
                        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos_coordinator.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
