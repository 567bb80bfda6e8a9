"""``expresslane decode``: a decode node: the engine, its registered receive buffers, token streaming.

Contract:
- At start: load the engine (``--model``, ``--slots``, ``--max-seq-len``), register every slot's
  buffer with the transport once (services.decode.receiver), then publish ``NodeAvailable`` on
  ``xl.node.<node>.avail`` every ``--heartbeat-ms`` (and at once whenever a slot frees or NATS
  comes back): free slots, model, protocol and layout versions, endpoint, slot buffer addresses.
- A lease starts when both its ``DecodeStart`` (``xl.decode.<node>.start``) and ``KvReady``
  (``xl.kv.ready.<node>``) of the same generation are here, in either order; stale halves are
  ignored and counted. Start = inject the KV already in the slot + engine.start; then
  ``DecodeStarted`` goes to the coordinator.
- One decode loop runs ``engine.step()`` over all active slots in a worker thread (the event loop
  stays responsive); each step's new token ids go out as ``TokensGenerated`` on
  ``xl.req.<id>.tokens`` (``index`` counts the completion's tokens, the prefill's first token is 0).
- End: ``RequestFinished`` (usage, speculation stats) on the tokens subject, the slot is released,
  availability republished, then ``SlotReleased`` to the coordinator. ``CancelRequest`` stops a
  request before the next step. A coordinator ``HandoffEvent`` failed/cancelled for a lease of this
  node ends it here too (and is answered with ``SlotReleased`` so the coordinator can free it).
- HTTP ``/health`` and ``/metrics``. SIGTERM: publish ``NodeDraining``, finish running requests
  (up to ``--drain-timeout-s``, then fail them as retryable), unregister, exit 0. NATS restarts:
  nats-py reconnects and resubscribes; availability is republished on reconnect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.decode.receiver import Pending, Receiver, SlotBook
from shared import config as shared_config
from shared import subjects
from shared.bus import Bus, BusUnavailable
from shared.http_status import serve_status
from shared.events import (
    PROTOCOL_VERSION, CancelRequest, DecodeStart, DecodeStarted, HandoffEvent, KvFailed, KvMessage,
    KvReady, NodeAvailable, NodeDraining, RequestFailed, RequestFinished, SlotReleased,
    TokensGenerated, Usage,
)
from shared.log import get_logger, setup_logging
from shared.tracing import setup_tracing


@dataclass
class Active:
    """A request decoding in one slot."""

    lease: Pending
    next_index: int  # completion index of the next token to emit
    num_completion_tokens: int
    started_at: float
    span: trace.Span


class DecodeNode:
    def __init__(self, engine, receiver: Receiver, bus: Bus, args: argparse.Namespace) -> None:
        self.engine, self.receiver, self.bus, self.args = engine, receiver, bus, args
        self.node_id: str = args.node_id
        self.book = SlotBook(num_slots=args.slots)
        self.active: dict[int, Active] = {}
        self.to_start: list[int] = []
        self.to_stop: dict[int, tuple[str, str, bool]] = {}  # slot -> (outcome, reason, notify)
        self.start_ctx: dict[str, otel_context.Context] = {}
        self.wake = asyncio.Event()
        self.seq = 0
        self.is_draining = False
        self.counters: Counter[str] = Counter()
        self.tracer = trace.get_tracer("expresslane.decode")
        self.log = get_logger("decode", node_id=self.node_id)
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.step_seconds = Histogram("xl_decode_step_seconds", "One engine step over all slots",
                                      registry=self.registry,
                                      buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        sub = self.bus.subscribe
        self._subs += [
            await sub(subjects.kv_ready(self.node_id), self._on_kv, KvMessage),
            await sub(subjects.decode_start(self.node_id), self._on_start, DecodeStart),
            await sub(subjects.REQ_CANCEL_ALL, self._on_cancel, CancelRequest),
            await sub(subjects.HANDOFF_ALL, self._on_handoff, HandoffEvent),
        ]
        self.bus.add_reconnect_callback(self._heartbeat)
        await self._heartbeat()
        self.http = await serve_status(self.args.http_host, self.args.http_port,
                                       {"/health": self._health, "/metrics": self._metrics})
        self._tasks += [asyncio.create_task(self._heartbeat_loop()),
                        asyncio.create_task(self._decode_loop())]
        self.log.info("decode_ready", http_port=self.http.sockets[0].getsockname()[1],
                      model=self.engine.model_name, slots=self.args.slots,
                      transport=self.receiver.name, endpoint=self.receiver.endpoint)

    async def drain(self) -> None:
        """Stop taking leases, let running requests finish (bounded), then stop."""
        self.is_draining = True
        await self._heartbeat()
        t0 = time.monotonic()
        deadline = t0 + self.args.drain_timeout_s
        # Leases granted just before NodeDraining may still be on their way (prefill running):
        # give them a moment, then wait for every pending and active request (bounded).
        settle_s = min(self.args.drain_timeout_s, 2 * self.args.heartbeat_ms / 1000)
        while time.monotonic() < deadline and (
            self.active or self.to_start or len(self.book.free_slots()) < self.args.slots
            or time.monotonic() - t0 < settle_s
        ):
            await asyncio.sleep(0.05)
        for slot in list(self.active):
            self.to_stop[slot] = ("failed", "node_stopping", True)
        self.wake.set()
        while self.active and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)
        for sub in self._subs:
            await _quietly(sub.unsubscribe())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._heartbeat()
        self.http.close()
        self.log.info("decode_stopped", stale_ignored=self.book.num_stale)

    # ------------------------------------------------------------ availability

    async def _heartbeat(self) -> None:
        self.seq += 1
        now = int(time.time() * 1000)
        if self.is_draining:
            await self.bus.publish(subjects.node_avail(self.node_id),
                                   NodeDraining(node_id=self.node_id, sent_at_ms=now))
            return
        await self.bus.publish(subjects.node_avail(self.node_id), NodeAvailable(
            node_id=self.node_id, model=self.engine.model_name, protocol_version=PROTOCOL_VERSION,
            total_slots=self.args.slots, free_slots=self.book.free_slots(),
            transports=[self.receiver.name], endpoints={self.receiver.name: self.receiver.endpoint},
            slots=self.receiver.slot_targets(), layout=self.engine.layout,
            heartbeat_interval_ms=self.args.heartbeat_ms, seq=self.seq, sent_at_ms=now,
            nixl_metadata_b64=self.receiver.metadata_b64, max_seq_len=self.args.max_seq_len))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.heartbeat_ms / 1000)
            try:
                await self._heartbeat()
            except Exception:
                self.log.exception("heartbeat_failed")

    # ------------------------------------------------------------ handlers

    async def _on_start(self, msg: DecodeStart, _) -> None:
        self.start_ctx[msg.lease_id] = otel_context.get_current()
        await self._add_half(msg.slot, msg)

    async def _on_kv(self, msg: KvReady | KvFailed, _) -> None:
        if msg.node_id != self.node_id:
            return
        if isinstance(msg, KvReady):
            if msg.layout_version != self.engine.layout.layout_version:
                self.counters["kv_layout_mismatch"] += 1
                return await self._end_lease(msg.slot, msg.lease_id, msg.generation, msg.request_id,
                                             "failed", f"layout version {msg.layout_version}")
            return await self._add_half(msg.slot, msg)
        await self._end_lease(msg.slot, msg.lease_id, msg.generation, msg.request_id, "failed",
                              f"transfer_failed: {msg.reason}")

    async def _add_half(self, slot: int, half: DecodeStart | KvReady) -> None:
        was_free = slot in self.book.free_slots()
        ready, superseded = self.book.add(slot, half)
        for old in superseded:
            self.start_ctx.pop(old.lease_id, None)
        if ready is not None:
            self.to_start.append(slot)
            self.wake.set()
        if was_free and slot not in self.book.free_slots():
            await self._heartbeat()  # the slot just became busy

    async def _on_cancel(self, msg: CancelRequest, _) -> None:
        found = self.book.find(msg.request_id)
        if found is None:
            return
        slot, lease = found
        await self._end_lease(slot, lease.lease_id, lease.generation, lease.request_id,
                              "cancelled", msg.reason, notify=True)

    async def _on_handoff(self, ev: HandoffEvent, _) -> None:
        if ev.node_id != self.node_id or ev.state not in ("failed", "cancelled"):
            return
        if ev.lease_id in self.book.ended or not 0 <= ev.slot < self.args.slots:
            return
        # The router already knows (it migrates or has cancelled): no terminal event from here.
        await self._end_lease(ev.slot, ev.lease_id, ev.generation, ev.request_id, ev.state,
                              ev.reason, notify=ev.state == "cancelled")

    async def _end_lease(self, slot: int, lease_id: str, generation: int, request_id: str,
                         outcome: str, reason: str, notify: bool = False) -> None:
        """End a lease that is pending, active or unknown here; tell the coordinator."""
        active = self.active.get(slot)
        if active is not None and active.lease.lease_id == lease_id:
            self.to_stop[slot] = (outcome, reason, notify)  # the loop stops it before the next step
            self.wake.set()
            return
        if not 0 <= slot < self.args.slots or lease_id in self.book.ended:
            return
        self.book.end(slot, lease_id, generation)
        self.start_ctx.pop(lease_id, None)
        await self._released(slot, lease_id, generation, request_id, outcome, reason)

    async def _released(self, slot, lease_id, generation, request_id, outcome, reason) -> None:
        await self._heartbeat()  # availability first, so the coordinator sees the slot free
        await self.bus.publish(subjects.COORD_REPORT, SlotReleased(
            request_id=request_id, lease_id=lease_id, generation=generation, node_id=self.node_id,
            slot=slot, outcome=outcome, reason=reason))
        self.counters[f"released.{outcome}"] += 1
        if self.book.ready_after_release(slot) is not None:
            self.to_start.append(slot)
            self.wake.set()

    # ------------------------------------------------------------ decode loop

    async def _decode_loop(self) -> None:
        while True:
            if not (self.active or self.to_start or self.to_stop):
                await self.wake.wait()
            self.wake.clear()
            try:
                await self._apply_stops()
                await self._apply_starts()
                if not self.active:
                    continue
                t0 = time.perf_counter()
                outputs = await asyncio.to_thread(self.engine.step)
                self.step_seconds.observe(time.perf_counter() - t0)
                for slot, out in outputs.items():
                    try:
                        await self._emit(slot, out.token_ids, out.finish_reason)
                    except Exception:  # one request's trouble stops that request only
                        self.log.exception("emit_failed", slot=slot)
                        self.to_stop[slot] = ("failed", "emit_failed", False)
            except Exception:
                self.log.exception("decode_loop_failed")
                for slot in list(self.active):
                    self.to_stop[slot] = ("failed", "engine_error", True)
                await asyncio.sleep(0.1)

    async def _apply_starts(self) -> None:
        starts, self.to_start = self.to_start, []
        for slot in starts:
            s = self.book.slots[slot]
            if s.active is not None or s.pending is None or not s.pending.is_ready:
                continue
            lease = self.book.activate(slot)
            start, kv = lease.start, lease.kv
            span = self.tracer.start_span(
                "decode", context=self.start_ctx.pop(lease.lease_id, None),
                attributes={"expresslane.request_id": lease.request_id, "expresslane.slot": slot,
                            "expresslane.node_id": self.node_id})
            self.active[slot] = Active(lease, 1 + start.num_tokens_already_sent,
                                       1 + start.num_tokens_already_sent, time.perf_counter(), span)
            try:
                if start.num_tokens_already_sent == 0 and kv.num_tokens != start.num_prompt_tokens:
                    raise ValueError(f"the KV holds {kv.num_tokens} tokens but the prompt has "
                                     f"{start.num_prompt_tokens}")
                self.engine.inject(slot, kv.num_tokens)
                self.engine.start(slot, start.first_token_id, start.sampling)
            except Exception as exc:  # bad sizes or params: the request fails, the node lives on
                self.log.warning("start_failed", request_id=lease.request_id, error=str(exc))
                await self._finish(slot, "failed", f"start_failed: {exc}", notify=True)
                continue
            with trace.use_span(span, end_on_exit=False):
                await self.bus.publish(subjects.COORD_REPORT, DecodeStarted(
                    request_id=lease.request_id, lease_id=lease.lease_id,
                    generation=lease.generation, node_id=self.node_id, slot=slot))
            self.log.info("decode_started", request_id=lease.request_id, slot=slot,
                          lease_id=lease.lease_id, generation=lease.generation,
                          num_tokens=kv.num_tokens, max_tokens=start.sampling.max_tokens)
            if start.sampling.max_tokens <= 0:
                await self._finish(slot, "completed", "", finish_reason="length")

    async def _apply_stops(self) -> None:
        stops, self.to_stop = self.to_stop, {}
        for slot, (outcome, reason, notify) in stops.items():
            if slot in self.active:
                self.engine.cancel(slot)
                await self._finish(slot, outcome, reason, finish_reason="cancelled", notify=notify)

    async def _emit(self, slot: int, token_ids: list[int], finish_reason: str | None) -> None:
        a = self.active.get(slot)
        if a is None:
            return
        if token_ids:
            with trace.use_span(a.span, end_on_exit=False):
                await self.bus.publish(subjects.req_tokens(a.lease.request_id), TokensGenerated(
                    request_id=a.lease.request_id, index=a.next_index, token_ids=list(token_ids)))
            a.next_index += len(token_ids)
            a.num_completion_tokens += len(token_ids)
            self.counters["tokens_generated"] += len(token_ids)
        if finish_reason is not None:
            await self._finish(slot, "completed", "", finish_reason=finish_reason)

    async def _finish(self, slot: int, outcome: str, reason: str, finish_reason: str = "stop",
                      notify: bool = True) -> None:
        """Publish the terminal event, release the engine slot and the lease."""
        a = self.active.pop(slot)
        lease = a.lease
        rid = lease.request_id
        with trace.use_span(a.span, end_on_exit=True):
            try:
                subjects.req_tokens(rid)
            except ValueError:  # no subject can carry it: nobody to tell
                notify = False
            if notify and outcome == "failed":
                await self.bus.publish(subjects.req_tokens(rid), RequestFailed(
                    request_id=rid, reason=reason, retryable=True))
            elif notify:
                await self.bus.publish(subjects.req_tokens(rid), RequestFinished(
                    request_id=rid, finish_reason=finish_reason,
                    usage=Usage(prompt_tokens=lease.start.num_prompt_tokens,
                                completion_tokens=a.num_completion_tokens),
                    spec=self.engine.spec_stats(slot),
                    decode_ms=(time.perf_counter() - a.started_at) * 1000))
            a.span.set_attribute("expresslane.completion_tokens", a.num_completion_tokens)
            a.span.set_attribute("expresslane.outcome", outcome)
            self.engine.release(slot)
            self.book.end(slot, lease.lease_id, lease.generation)
            self.log.info("decode_finished", request_id=rid, slot=slot, outcome=outcome,
                          reason=reason, finish_reason=finish_reason,
                          completion_tokens=a.num_completion_tokens,
                          decode_ms=round((time.perf_counter() - a.started_at) * 1000, 2))
            self.counters[f"finished.{finish_reason if outcome == 'completed' else outcome}"] += 1
            await self._released(slot, lease.lease_id, lease.generation, rid, outcome, reason)

    # ------------------------------------------------------------ http and metrics

    def collect(self):
        yield GaugeMetricFamily("xl_decode_active_slots", "Slots decoding", value=len(self.active))
        yield GaugeMetricFamily("xl_decode_free_slots", "Slots free", value=len(self.book.free_slots()))
        yield CounterMetricFamily("xl_decode_stale_ignored", "Stale start/KV-ready ignored",
                                  value=self.book.num_stale)
        family = CounterMetricFamily("xl_decode_events", "Decode node events", labels=["event"])
        for key, value in sorted(self.counters.items()):
            family.add_metric([key], value)
        yield family

    def _health(self) -> tuple[int, str, bytes]:
        is_ok = self.bus.is_connected and not self.is_draining
        body = {"status": "ok" if is_ok else ("draining" if self.is_draining else "unavailable"),
                "node_id": self.node_id, "connected": self.bus.is_connected,
                "total_slots": self.args.slots, "free_slots": self.book.free_slots(),
                "active": sorted(self.active),
                "stale_ignored": self.book.num_stale}
        return (200 if is_ok else 503), "application/json", json.dumps(body).encode()

    def _metrics(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4", generate_latest(self.registry)


async def _quietly(coro) -> None:
    try:
        await coro
    except Exception:
        pass


def default_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"decode-{host}-{os.getpid()}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane decode", description="Run a decode node: the "
                                "express-lane engine with pre-registered KV receive buffers.")
    shared_config.add_common_args(p)
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--slots", type=int, default=1, help="concurrent requests (receive buffers)")
    p.add_argument("--node-id", default="", help="name on the bus (default decode-HOST-PID)")
    p.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    p.add_argument("--transport-host", default="127.0.0.1", help="address senders reach us on")
    p.add_argument("--transport-protocol", default="tcp", choices=["tcp", "rdma"], help="mooncake")
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens per slot (prompt + output)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per step, 0 to 3 (default: one per MTP layer of the "
                        "model, 0 for models without MTP layers)")
    p.add_argument("--mtp-draft-vocab", type=int, default=None, metavar="N",
                   help="on the fast path, MTP drafts propose only token ids < N: a draft head of N rows "
                        "instead of the whole vocabulary (BPE ids run from frequent to rare); output is "
                        "unchanged, acceptance may drop (default: the whole vocabulary)")
    p.add_argument("--fast-path", choices=["auto", "on", "off"], default="auto",
                   help="batch-1 CUDA-graph decode for a lone greedy request (auto: where the "
                        "model, dtype and device allow; on: refuse to start otherwise)")
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=9103, help="/health and /metrics (0: any free)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    return p


def default_num_speculative_tokens(model_dir: str) -> int:
    """One draft per MTP layer of the checkpoint (at most 3), 0 for models without them."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return min(int(config.get("num_nextn_predict_layers") or 0), 3)


def _load(args: argparse.Namespace):
    """The engine and its registered receive buffers."""
    from services.decode.engine import Engine
    from shared.transport import create_transport

    num_spec = args.num_speculative_tokens
    if num_spec is None:
        num_spec = default_num_speculative_tokens(args.model)
    engine = Engine.load(args.model, num_slots=args.slots, max_seq_len=args.max_seq_len,
                         device=args.device, dtype=args.dtype, num_speculative_tokens=num_spec,
                         fast_path=args.fast_path, mtp_draft_vocab=args.mtp_draft_vocab)
    transport = create_transport(args.transport, host=args.transport_host,
                                 protocol=args.transport_protocol, agent_name=args.node_id)
    buffers = [(engine.slot_buffer(s).data_ptr(), engine.slot_buffer(s).numel())
               for s in range(args.slots)]
    return engine, Receiver(transport, buffers)


async def _run(args: argparse.Namespace) -> int:
    bus = await Bus.connect(args.nats_url, name=f"decode-{args.node_id}")  # fail fast, before loading
    engine, receiver = await asyncio.to_thread(_load, args)
    try:
        node = DecodeNode(engine, receiver, bus, args)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await node.start()
        await stop.wait()
        await node.drain()
        await bus.close()
    finally:
        receiver.close()
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = shared_config.parse_args(parser, argv)
    if args.slots < 1 or args.max_seq_len < 1 or args.heartbeat_ms < 1:
        parser.error("--slots, --max-seq-len and --heartbeat-ms must be positive")
    args.node_id = args.node_id or default_node_id()
    try:
        subjects.node_avail(args.node_id)
    except ValueError as exc:
        parser.error(f"--node-id: {exc}")
    setup_logging("decode", args.log_level, json=args.log_format == "json")
    setup_tracing("decode")
    try:
        return asyncio.run(_run(args))
    except BusUnavailable as exc:
        print(f"expresslane decode: {exc}", file=sys.stderr)
        return 1
