"""The coordinator and decode node as real processes on a real nats-server (JetStream).

Each test gets its own nats-server (so the coordinator's KV bucket and report stream start empty),
runs ``expresslane coordinator`` and ``expresslane decode`` as subprocesses on the tiny Llama, and
ends with the leak check: no lease, no waiting claim, every decode slot free. Tests wait for
conditions and assert outcomes, never durations: how fast leases fail or slots come back is
measured by ``bench/chaos.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra.processes import free_port
from shared import subjects
from shared.bus import Bus, BusNoResponders
from shared.events import (
    CancelRequest, ClaimGranted, ClaimRejected, ClaimReply, ClaimRequest, DecodeStart,
    HandoffEvent, KvReady, RequestFailed, RequestFinished, SamplingParams, TokenMessage, TokensGenerated,
)

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 200  # nodes of tests about a node's death: dead after 3 missed beats (0.6 s)
# Every other node: a busy 2-core machine can starve a process for longer than 0.6 s, and a node
# taken for dead there fails the test's leases for a reason the test is not about.
TOLERANT_HEARTBEAT_MS = 2000


class Proc:
    """One service subprocess with its log file and its /health port."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.port = name, args, free_port()
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_OMP_THREADS_BIND="0-1")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "infra.cli", *self.args,
                                      "--http-port", str(self.port)],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def health(self) -> tuple[int, dict]:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0)
            return r.status_code, r.json()
        except (httpx.HTTPError, ValueError):
            return 0, {}

    async def wait_healthy(self, timeout_s: float = 60.0, until=lambda h: True) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited: {self.tail()}"
            status, body = await asyncio.to_thread(self.health)
            if status == 200 and until(body):
                return body
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.name} not healthy in {timeout_s} s: {self.tail()}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=60)
        finally:
            self.log.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.log.close()

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Stack:
    """A nats-server, a coordinator, decode nodes, and a bus client recording handoff events."""

    def __init__(self, nats, model_dir: Path, log_dir: Path) -> None:
        self.nats, self.model_dir, self.log_dir = nats, model_dir, log_dir
        self.procs: list[Proc] = []
        self.events: list[HandoffEvent] = []
        self.traceparents: dict[tuple[str, str], str] = {}  # (request id, state) -> traceparent
        self.bus: Bus | None = None

    async def open(self) -> Stack:
        self.bus = await Bus.connect(self.nats.url, name="test")

        async def on_event(ev, msg):
            self.events.append(ev)
            self.traceparents[(ev.request_id, ev.state)] = (msg.headers or {}).get("traceparent", "")

        await self.bus.subscribe(subjects.HANDOFF_ALL, on_event, HandoffEvent)
        return self

    async def coordinator(self, *extra: str, role: str = "leader") -> Proc:
        """Start a coordinator and wait until it has its ``role``; the leader is ``self.coord``."""
        p = Proc(f"coordinator-{len(self.procs)}", ["coordinator", "--nats-url", self.nats.url,
                                                     "--log-format", "json", "--tick-ms", "20", *extra],
                 self.log_dir).start()
        self.procs.append(p)
        await p.wait_healthy(30, until=lambda h: h["role"] == role)
        if role == "leader":
            self.coord = p
        return p

    async def decode(self, node_id: str, slots: int = 1, *extra: str,
                     heartbeat_ms: int = TOLERANT_HEARTBEAT_MS) -> Proc:
        p = Proc(node_id, ["decode", "--nats-url", self.nats.url, "--model", str(self.model_dir),
                           "--slots", str(slots), "--node-id", node_id, "--max-seq-len", "256",
                           "--heartbeat-ms", str(heartbeat_ms), "--log-format", "json",
                           # a stop waits min(drain timeout, 2 heartbeats) for leases in flight:
                           # 1 s here, a test of draining itself passes its own
                           "--drain-timeout-s", "1", *extra],
                 self.log_dir).start()
        self.procs.append(p)
        await p.wait_healthy(120)
        await self.coord.wait_healthy(10, until=lambda h: node_id in h["nodes"])
        return p

    async def claim(self, rid: str, wait_ms: int = 5000, timeout_s: float = 10.0):
        """Claim as the router does: while no coordinator listens (a leader that stepped down on a
        slow renewal, until it or a standby takes the key again), ask again within the claim's wait."""
        claim = ClaimRequest(request_id=rid, model=self.model_dir.name, num_prompt_tokens=8,
                             max_tokens=16, wait_ms=wait_ms)
        deadline = time.monotonic() + max(wait_ms / 1000, timeout_s)
        while True:
            try:
                return await self.bus.request(subjects.CLAIM, claim, ClaimReply, timeout_s)
            except BusNoResponders:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def states(self, rid: str) -> list[str]:
        return [e.state for e in self.events if e.request_id == rid]

    async def wait_state(self, rid: str, state: str, timeout_s: float = 10.0) -> float:
        t0 = time.monotonic()
        while state not in self.states(rid):
            assert time.monotonic() - t0 < timeout_s, f"{rid}: no {state} in {self.states(rid)}"
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    async def assert_no_leak(self, decodes: list[Proc], timeout_s: float = 10.0) -> None:
        """No lease, no waiting claim, every slot of every decode node free."""
        await self.coord.wait_healthy(timeout_s, until=lambda h: h["leases"] == 0 and h["queued"] == 0)
        for d in decodes:
            await d.wait_healthy(timeout_s, until=lambda h: h["active"] == [] and
                                 len(h["free_slots"]) == h["total_slots"])

    async def close(self) -> None:
        """Stop everything; print the log tail of any process that exited badly (not killed)."""
        if self.bus is not None:
            await self.bus.close()
        for p in reversed(self.procs):  # all stop at once: each drains on its own
            p.signal(signal.SIGTERM)
        for p in reversed(self.procs):
            p.stop()
        for p in self.procs:
            if p.proc is not None and p.proc.returncode not in (0, None, -9):
                print(f"--- {p.name} exited {p.proc.returncode}\n{p.tail()}")


async def run_request(stack: Stack, grant: ClaimGranted, prompt_len: int, max_tokens: int,
                      first_token_id: int = 1, kv_ready: bool = True,
                      kv_tokens: int | None = None) -> asyncio.Queue:
    """Pretend to be prefill + router: KV-ready (no bytes: the test model tolerates any KV) and
    start; returns the queue of the request's token messages."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_token(ev, _msg):
        queue.put_nowait(ev)

    await stack.bus.subscribe(subjects.req_tokens(grant.request_id), on_token, TokenMessage)
    if kv_ready:
        await stack.bus.publish(subjects.kv_ready(grant.node_id), KvReady(
            request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
            node_id=grant.node_id, slot=grant.target.slot.slot, num_tokens=kv_tokens or prompt_len,
            layout_version=grant.target.layout.layout_version, nbytes=0))
    await stack.bus.publish(subjects.decode_start(grant.node_id), DecodeStart(
        request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
        slot=grant.target.slot.slot, first_token_id=first_token_id, num_prompt_tokens=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return queue


async def collect(queue: asyncio.Queue, timeout_s: float = 30.0,
                  tokens: list[int] | None = None) -> tuple[list[int], object]:
    """The request's token ids (after ``tokens`` already taken) and its terminal event."""
    tokens = list(tokens or [])
    while True:
        ev = await asyncio.wait_for(queue.get(), timeout_s)
        if isinstance(ev, TokensGenerated):
            assert ev.index == 1 + len(tokens), (ev.index, len(tokens))
            tokens += ev.token_ids
        else:
            return tokens, ev


@pytest.fixture
async def stack(make_nats_server, tiny_model, tmp_path):
    s = await Stack(make_nats_server(), tiny_model("llama"), tmp_path).open()
    try:
        yield s
    finally:
        await s.close()


# ---------------------------------------------------------------- tests


async def test_last_of_n_plus_one_claims_waits_then_is_granted(stack):
    await stack.coordinator("--compact-interval-s", "1")
    node = await stack.decode("d1", 2)
    grants = [await stack.claim(f"r{i}") for i in range(2)]
    assert all(isinstance(g, ClaimGranted) for g in grants)
    assert sorted(g.target.slot.slot for g in grants) == [0, 1]
    waiting = asyncio.create_task(stack.claim("r2", wait_ms=20_000, timeout_s=30))
    await stack.wait_state("r2", "queued")
    assert not waiting.done()
    metrics = httpx.get(f"http://127.0.0.1:{stack.coord.port}/metrics", timeout=5).text
    assert "xl_coord_queue_depth 1.0" in metrics and "xl_coord_free_slots 0.0" in metrics
    assert "# TYPE xl_coord_gc_pause_seconds histogram" in metrics and "xl_coord_gc_frozen_objects" in metrics
    tokens, end = await collect(await run_request(stack, grants[0], prompt_len=8, max_tokens=4))
    assert isinstance(end, RequestFinished) and len(tokens) == 4
    assert (end.finish_reason, end.usage.completion_tokens) == ("length", 5)
    third = await asyncio.wait_for(waiting, 10)
    assert isinstance(third, ClaimGranted) and third.target.slot.slot == grants[0].target.slot.slot
    assert third.generation > max(g.generation for g in grants)
    assert stack.states("r0") == ["claimed", "kv_ready", "decoding", "completed"]
    # the grant's handoff event goes out after its reply: wait for it to arrive here too
    await stack.wait_state("r2", "claimed")
    assert stack.states("r2")[:2] == ["queued", "claimed"]
    for g in (grants[1], third):
        _, end = await collect(await run_request(stack, g, prompt_len=8, max_tokens=3))
        assert isinstance(end, RequestFinished) and end.usage.completion_tokens == 4
    await stack.assert_no_leak([node])
    # Ended leases leave nothing behind in the state bucket either (delete markers are purged).
    js = stack.bus.nc.jetstream()
    deadline = time.monotonic() + 15
    while (await js.stream_info(f"KV_{subjects.COORD_KV_BUCKET}")).state.messages > 2:  # meta, leader
        assert time.monotonic() < deadline, "delete markers were not purged"
        await asyncio.sleep(0.2)


async def test_queue_full_is_rejected_with_retry_after(stack):
    await stack.coordinator("--max-queue", "1", "--retry-after-ms", "750")
    node = await stack.decode("d1", 1)
    first = await stack.claim("r0")
    waiting = asyncio.create_task(stack.claim("r1", wait_ms=20_000, timeout_s=30))
    await stack.wait_state("r1", "queued")
    rejected = await stack.claim("r2")
    assert isinstance(rejected, ClaimRejected)
    assert (rejected.reason, rejected.retry_after_ms) == ("queue_full", 750)
    # a waiting claim that is cancelled is answered at once
    await stack.bus.publish(subjects.req_cancel("r1"), CancelRequest(request_id="r1"))
    cancelled = await asyncio.wait_for(waiting, 10)
    assert isinstance(cancelled, ClaimRejected) and cancelled.reason == "cancelled"
    # a claim whose deadline passes in the queue is rejected with retry advice too
    late = await stack.claim("r3", wait_ms=300)
    assert isinstance(late, ClaimRejected) and (late.reason, late.retry_after_ms) == ("deadline", 750)
    _, end = await collect(await run_request(stack, first, prompt_len=8, max_tokens=2))
    assert isinstance(end, RequestFinished)
    # A start that disagrees with the KV it would decode from fails, never decodes garbage.
    bad = await stack.claim("r4")
    queue = await run_request(stack, bad, prompt_len=8, max_tokens=2, kv_tokens=7)
    tokens, end = await collect(queue)
    assert tokens == [] and isinstance(end, RequestFailed) and "7 tokens" in end.reason
    await stack.wait_state("r4", "failed")
    # r4 may wait in the queue until the coordinator has heard that r0's lease ended
    assert [s for s in stack.states("r4") if s != "queued"] == ["claimed", "kv_ready", "failed"]
    await stack.assert_no_leak([node])


async def test_killing_decode_node_fails_its_leases_within_three_heartbeats(stack):
    # Short transfer timeout: r0's writer might still be live, so its slot stays fenced that long.
    # Death (3 beats of 0.4 s) comes well before r0's transfer deadline (5 s).
    await stack.coordinator("--transfer-timeout-ms", "5000", "--fence-grace-ms", "500")
    node = await stack.decode("d1", 2, heartbeat_ms=2 * HEARTBEAT_MS)
    claimed = await stack.claim("r0")
    ready = await stack.claim("r1")
    await run_request(stack, ready, prompt_len=8, max_tokens=4, kv_ready=True)
    await stack.wait_state("r1", "completed")
    ready = await stack.claim("r2")  # leave this one in kv_ready (no start)
    await stack.bus.publish(subjects.kv_ready("d1"), KvReady(
        request_id="r2", lease_id=ready.lease_id, generation=ready.generation, node_id="d1",
        slot=ready.target.slot.slot, num_tokens=8, layout_version=1, nbytes=0))
    await stack.wait_state("r2", "kv_ready")
    node.kill()
    await stack.wait_state("r0", "failed", timeout_s=30)
    await stack.wait_state("r2", "failed", timeout_s=30)
    failed = [e for e in stack.events if e.state == "failed"]
    assert {(e.request_id, e.reason, e.node_id) for e in failed} == {
        ("r0", "node_dead", "d1"), ("r2", "node_dead", "d1")}
    assert stack.states("r0") == ["claimed", "failed"]
    assert stack.states("r2") == ["claimed", "kv_ready", "failed"]
    # No live node serves the model: whether the claim arrives inside the coordinator's start-up
    # warm-up (it waits for nodes to announce themselves, then is turned away) or after it, the
    # answer is the same.
    gone = await stack.claim("r3", wait_ms=5000, timeout_s=30)
    assert isinstance(gone, ClaimRejected) and gone.reason == "no_compatible_node"
    # r0's slot stays fenced until its transfer deadline + grace (tests/unit/coordinator), then
    # nothing is left.
    await stack.assert_no_leak([])


async def test_coordinator_restart_mid_handoff_loses_no_lease(stack):
    coord = await stack.coordinator()
    node = await stack.decode("d1", 2)
    grant = await stack.claim("r0")
    other = await stack.claim("r1")
    waiting = asyncio.create_task(stack.claim("r2", wait_ms=30_000, timeout_s=60))
    await stack.wait_state("r2", "queued")
    coord.kill()
    # While the coordinator is down the transfer completes and the router starts decoding.
    queue = await run_request(stack, grant, prompt_len=8, max_tokens=6)
    tokens, end = await collect(queue)
    assert isinstance(end, RequestFinished) and len(tokens) == 6
    await stack.coordinator()  # resumes: leases and queue from the KV bucket, reports from the stream
    await stack.wait_state("r0", "completed")
    assert stack.states("r0") == ["claimed", "kv_ready", "decoding", "completed"]
    # r0's slot went to the claim that was waiting when the coordinator died, on its old inbox.
    third = await asyncio.wait_for(waiting, 10)
    assert isinstance(third, ClaimGranted) and third.target.slot.slot == grant.target.slot.slot
    assert third.generation > other.generation  # generations never repeat across the restart
    await stack.wait_state("r2", "claimed")  # published after the reply
    assert stack.states("r2") == ["queued", "claimed"]
    await stack.coord.wait_healthy(10, until=lambda h: h["leases"] == 2 and h["queued"] == 0)
    for g in (other, third):  # r1's lease survived the restart too
        _, end = await collect(await run_request(stack, g, prompt_len=8, max_tokens=2))
        assert isinstance(end, RequestFinished)
        await stack.wait_state(g.request_id, "completed")
    await stack.assert_no_leak([node])


async def test_nats_restart_both_services_reconnect_and_no_lease_is_lost(stack):
    await stack.coordinator()
    node = await stack.decode("d1", 2, heartbeat_ms=HEARTBEAT_MS)  # the outage outlasts 3 beats
    grant = await stack.claim("r0")
    _, end = await collect(await run_request(stack, grant, prompt_len=8, max_tokens=2))
    assert isinstance(end, RequestFinished)
    await stack.wait_state("r0", "completed")
    inflight = await stack.claim("r1")  # a handoff in flight across the restart
    await stack.bus.publish(subjects.kv_ready("d1"), KvReady(
        request_id="r1", lease_id=inflight.lease_id, generation=inflight.generation,
        node_id="d1", slot=inflight.target.slot.slot, num_tokens=8, layout_version=1, nbytes=0))
    await stack.wait_state("r1", "kv_ready")
    await asyncio.to_thread(stack.nats.stop)
    await asyncio.sleep(6 * HEARTBEAT_MS / 1000)  # down for longer than 3 heartbeats
    await asyncio.to_thread(stack.nats.start, 15.0)
    t0 = time.monotonic()
    await stack.coord.wait_healthy(30, until=lambda h: h["connected"] and h["free_slots"] == 1)
    await node.wait_healthy(30, until=lambda h: h["connected"])
    print(f"nats-server restarted -> services ready again in {(time.monotonic() - t0) * 1000:.0f} ms")
    deadline = time.monotonic() + 10
    while not stack.bus.is_connected:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    # The coordinator did not take its own outage for the node's death: r1 goes on.
    tokens, end = await collect(await run_request(stack, inflight, prompt_len=8, max_tokens=3,
                                                  kv_ready=False))
    assert isinstance(end, RequestFinished) and len(tokens) == 3
    await stack.wait_state("r1", "completed")
    assert stack.states("r1") == ["claimed", "kv_ready", "decoding", "completed"]
    grant = await stack.claim("r2")
    assert isinstance(grant, ClaimGranted)
    tokens, end = await collect(await run_request(stack, grant, prompt_len=8, max_tokens=3))
    assert isinstance(end, RequestFinished) and len(tokens) == 3
    await stack.wait_state("r2", "completed")
    await stack.assert_no_leak([node])


async def test_cancel_frees_the_slot(stack):
    await stack.coordinator()
    # Room for far more tokens than a decode produces while a cancel crosses the bus.
    node = await stack.decode("d1", 1, "--max-seq-len", "2048")
    grant = await stack.claim("r0")
    queue = await run_request(stack, grant, prompt_len=8, max_tokens=2000)
    first = await asyncio.wait_for(queue.get(), 30)
    assert isinstance(first, TokensGenerated)
    await stack.bus.publish(subjects.req_cancel("r0"), CancelRequest(request_id="r0"))
    end = None
    while end is None:
        ev = await asyncio.wait_for(queue.get(), 30)
        end = ev if not isinstance(ev, TokensGenerated) else None
    assert isinstance(end, RequestFinished) and end.finish_reason == "cancelled"
    assert end.usage.completion_tokens < 2001
    await stack.wait_state("r0", "cancelled")
    await stack.coord.wait_healthy(30, until=lambda h: h["leases"] == 0 and h["free_slots"] == 1)
    assert stack.states("r0") == ["claimed", "kv_ready", "decoding", "cancelled"]
    assert queue.empty()  # nothing after the terminal event
    await stack.assert_no_leak([node])
    stack.coord.stop()  # every line written; the cancel also went to the node's .ended subject, logged once
    lines = [json.loads(line) for line in stack.coord.log_path.read_text().splitlines() if line.startswith("{")]
    assert [line["state"] for line in lines if line["event"] == "handoff" and line["request_id"] == "r0"] == [
        "claimed", "kv_ready", "decoding", "cancelled"]


async def test_sigterm_drains_decode_node_and_coordinator(stack):
    coord = await stack.coordinator()
    second = await stack.coordinator(role="standby")  # one leader at a time: the other waits
    node = await stack.decode("d1", 1, "--drain-timeout-s", "30")
    await second.wait_healthy(10, until=lambda h: "d1" in h["nodes"] and h["leases"] == 0)
    second.stop()
    grant = await stack.claim("r0")
    queue = await run_request(stack, grant, prompt_len=8, max_tokens=200)
    first = await asyncio.wait_for(queue.get(), 30)
    assert isinstance(first, TokensGenerated)
    node.signal(signal.SIGTERM)  # the running request finishes, no new lease lands on the node
    tokens, end = await collect(queue, tokens=first.token_ids)
    assert isinstance(end, RequestFinished) and end.finish_reason == "length"
    assert len(tokens) == 200
    assert await asyncio.to_thread(node.proc.wait, 30) == 0
    refused = await stack.claim("r1", wait_ms=0)
    assert isinstance(refused, ClaimRejected) and refused.reason == "no_compatible_node"
    await stack.wait_state("r0", "completed")
    node = await stack.decode("d2", 1)
    held = await stack.claim("r2")
    waiting = asyncio.create_task(stack.claim("r3", wait_ms=20_000, timeout_s=30))
    await stack.wait_state("r3", "queued")
    coord.signal(signal.SIGTERM)  # waiting claims are turned away, the lease is kept
    turned_away = await asyncio.wait_for(waiting, 10)
    assert isinstance(turned_away, ClaimRejected) and turned_away.reason == "coordinator_stopping"
    assert turned_away.retry_after_ms > 0
    assert await asyncio.to_thread(coord.proc.wait, 30) == 0
    await stack.coordinator()
    await stack.coord.wait_healthy(10, until=lambda h: h["leases"] == 1 and h["queued"] == 0)
    _, end = await collect(await run_request(stack, held, prompt_len=8, max_tokens=2))
    assert isinstance(end, RequestFinished)
    await stack.assert_no_leak([node])


async def test_one_trace_spans_claim_transfer_and_decode(stack, otlp_receiver, monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: export promptly
    await stack.coordinator()
    node = await stack.decode("d1", 1)
    tracer = TracerProvider().get_tracer("test")  # the router's part, in this process
    with tracer.start_as_current_span("router.request") as root:
        grant = await stack.claim("r0")
        _, end = await collect(await run_request(stack, grant, prompt_len=8, max_tokens=3))
    assert isinstance(end, RequestFinished)
    await stack.wait_state("r0", "completed")
    trace_id = format(root.get_span_context().trace_id, "032x")
    want = {"coordinator.claim", "coordinator.KvReady", "decode", "coordinator.DecodeStarted",
            "coordinator.SlotReleased"}
    spans = await asyncio.to_thread(otlp_receiver.wait_for, lambda spans: want <= {
        s.name for s in spans if s.trace_id == trace_id}, 20)
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    assert mine["decode"].service_name == "decode"
    assert mine["coordinator.claim"].service_name == "coordinator"
    # the node's reports are children of its decode span
    assert mine["coordinator.DecodeStarted"].parent_span_id == mine["decode"].span_id
    assert mine["decode"].attributes["expresslane.request_id"] == "r0"
    # every lifecycle event the coordinator published went out in the request's trace, those made
    # from the node's reports (applied in batches) included
    assert {state: tp.split("-")[1] if tp else "" for (rid, state), tp in stack.traceparents.items()
            if rid == "r0"} == {s: trace_id for s in ("claimed", "kv_ready", "decoding", "completed")}
    await stack.assert_no_leak([node])
