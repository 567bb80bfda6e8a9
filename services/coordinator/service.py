"""``expresslane coordinator``: the NATS shell around the coordinator core.

Contract:
- Claims: request/reply on ``subjects.CLAIM`` (ClaimRequest -> ClaimGranted | ClaimRejected);
  a queued claim is answered later on its reply subject.
- Heartbeats: ``NodeAvailable`` / ``NodeDraining`` on ``subjects.NODE_AVAIL_ALL`` (live only).
- KV-ready/failed (``xl.kv.ready.*``), decode reports (``xl.coord.report``) and cancels
  (``xl.req.*.cancel``) are read through a JetStream work-queue stream with a durable consumer, so
  what arrives while the coordinator is down is applied when it comes back; each message is
  acknowledged after its effects are persisted (handling is idempotent, redelivery is harmless).
- Every transition is published as a ``HandoffEvent`` on ``xl.handoff.<request_id>.<state>``.
- State (leases, waiting claims, next generation) lives in the JetStream KV bucket
  ``subjects.COORD_KV_BUCKET`` (services.coordinator.store): written before a grant is answered,
  reloaded at start.
- HTTP: ``/health`` (200 when connected, 503 otherwise) and ``/metrics`` (Prometheus).
- Configuration: one ``CoordinatorServiceConfig`` (services.coordinator.config), built and checked
  once in ``main`` from flags and ``EXPRESSLANE_*`` variables, passed to the service and the core.
- SIGTERM/SIGINT: stop taking claims, turn waiting claims away with ``retry_after_ms``, flush,
  exit 0; leases stay in the bucket for the next coordinator. NATS restarts: nats-py reconnects,
  subscriptions and the durable consumer resume; while disconnected no deadline is applied, and
  after reconnecting every node counts as just seen (missed heartbeats prove nothing then).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.coordinator.config import CoordinatorServiceConfig, build_parser, from_args
from services.coordinator.core import CoordinatorCore
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.model import Effect, Observe, Publish, Reply
from services.coordinator.store import StateStore
from shared import config as shared_config
from shared import subjects
from shared.bus import Bus, BusUnavailable
from shared.events import (
    CancelRequest, ClaimRequest, DecodeStarted, HandoffEvent, KvFailed, KvReady, NodeAvailable,
    NodeDraining, NodeMessage, SlotReleased, decoder, encode,
)
from shared.http_status import serve_status
from shared.log import get_logger, setup_logging
from shared.tracing import extract_context, inject_headers, setup_tracing

INBOX_SUBJECTS = [subjects.KV_READY_ALL, subjects.COORD_REPORT, subjects.REQ_CANCEL_ALL]
InboxMessage = KvReady | KvFailed | DecodeStarted | SlotReleased | CancelRequest
MAX_DELIVERIES = 5  # a report that fails this often is dropped (logged), not retried forever


class CoordinatorBusy(RuntimeError):
    """The coordinator cannot run here: another one holds the report stream, or no JetStream."""


def now_ms() -> int:
    return int(time.time() * 1000)


class CoordinatorService:
    """Feeds bus messages and time to the core; performs its effects in order."""

    def __init__(self, bus: Bus, core: CoordinatorCore, config: CoordinatorServiceConfig) -> None:
        self.bus, self.core, self.config = bus, core, config
        self.metrics = CoordinatorMetrics(core)
        self.log = get_logger("coordinator")
        self.tracer = trace.get_tracer("expresslane.coordinator")
        self._lock = asyncio.Lock()
        self._subs: list = []
        self._inbox_sub = None
        self._tasks: list[asyncio.Task] = []
        self._inbox_decoder = decoder(InboxMessage)
        self.http: asyncio.Server | None = None
        self.is_ready = False
        self._restored = asyncio.Event()  # reports wait until the persisted state is loaded

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            self.store = StateStore(await self.bus.kv(self.config.kv_bucket))
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
            raise CoordinatorBusy(  # not busy, but the same kind of fatal start-up condition
                "nats-server has no JetStream: the coordinator keeps its state there; start "
                "nats-server with -js (`expresslane nats` does)") from exc
        await self._start_inbox()  # first: it fails while another coordinator is running
        await self._restore()
        self._restored.set()
        self.bus.add_reconnect_callback(self._on_reconnected)
        self._subs.append(await self.bus.subscribe(subjects.NODE_AVAIL_ALL, self._on_node, NodeMessage))
        self._subs.append(await self.bus.subscribe(subjects.CLAIM, self._on_claim, ClaimRequest))
        self.http = await serve_status(self.config.http_host, self.config.http_port, {
            "/health": self._health, "/metrics": self._metrics})
        self._tasks += [asyncio.create_task(self._tick_loop()),
                        asyncio.create_task(self._compact_loop())]
        self.is_ready = True
        self.log.info("coordinator_ready", http_port=self.http.sockets[0].getsockname()[1],
                      leases=len(self.core.leases), queued=len(self.core.queue))

    async def stop(self) -> None:
        """Drain: no new claims, waiting claims turned away, state flushed."""
        self.is_ready = False
        for sub in self._subs:
            await _quietly(sub.unsubscribe())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._apply(self.core.reject_queued, "coordinator_stopping")
        if self._inbox_sub is not None:
            await _quietly(self._inbox_sub.unsubscribe())
        if self.http is not None:
            self.http.close()
        self.log.info("coordinator_stopped", leases=len(self.core.leases))

    async def _restore(self) -> None:
        leases, queued, next_generation = await self.store.load()
        self.core.restore(leases, queued, next_generation, now_ms())
        if leases or queued:
            self.log.info("coordinator_restored", leases=len(leases), queued=len(queued),
                          next_generation=self.core.next_generation)

    async def _start_inbox(self) -> None:
        js = self.bus.nc.jetstream()
        stream = StreamConfig(name=self.config.inbox_stream, subjects=INBOX_SUBJECTS,
                              retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                              max_age=3600.0)
        try:
            await js.add_stream(stream)
        except nats.js.errors.BadRequestError:
            await js.update_stream(stream)
        consumer = ConsumerConfig(durable_name="coordinator", ack_policy=AckPolicy.EXPLICIT,
                                  filter_subjects=INBOX_SUBJECTS, ack_wait=30.0,
                                  max_ack_pending=10_000)
        self._js = js
        deadline = time.monotonic() + self.config.takeover_wait_s
        while True:
            try:
                self._inbox_sub = await js.subscribe(
                    subjects.COORD_REPORT, durable="coordinator", stream=self.config.inbox_stream,
                    config=consumer, cb=self._on_inbox, manual_ack=True)
                return
            except nats.js.errors.Error as exc:
                # One coordinator at a time: the durable consumer is bound to the live one.
                if "already bound" not in str(exc) or time.monotonic() > deadline:
                    raise CoordinatorBusy(
                        "another coordinator is running on this NATS (its report consumer is "
                        f"bound): stop it first ({exc})") from exc
                await asyncio.sleep(1.0)

    async def _tick_loop(self) -> None:
        # Apply what arrived while we were down before any deadline fires.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                info = await self._js.consumer_info(self.config.inbox_stream, "coordinator")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.05)
        while True:
            await asyncio.sleep(self.config.tick_ms / 1000)
            if not self.bus.is_connected:
                continue  # cut off ourselves: no node is judged dead meanwhile
            try:
                await self._apply(self.core.tick)
            except Exception:
                self.log.exception("tick_failed")

    async def _on_reconnected(self) -> None:
        await self._apply(self.core.on_reconnected)

    async def _compact_loop(self) -> None:
        """Every lease leaves a delete marker in the bucket: drop the old ones now and then."""
        interval_s = self.config.compact_interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.store.compact(int(interval_s))
            except Exception as exc:
                self.log.warning("kv_compact_failed", error=str(exc))

    # ------------------------------------------------------------ handlers

    async def _on_claim(self, claim: ClaimRequest, msg) -> None:
        if not msg.reply:
            self.log.warning("claim_without_reply", request_id=claim.request_id)
            return
        with self.tracer.start_as_current_span(
                "coordinator.claim", attributes={"expresslane.request_id": claim.request_id}):
            await self._apply(self.core.on_claim, claim, msg.reply)

    async def _on_node(self, event: NodeAvailable | NodeDraining, msg) -> None:
        if isinstance(event, NodeAvailable):
            await self._apply(self.core.on_heartbeat, event)
        else:
            await self._apply(self.core.on_draining, event)

    async def _on_inbox(self, msg) -> None:
        await self._restored.wait()
        try:
            event = self._inbox_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.log.warning("inbox_undecodable", subject=msg.subject, error=str(exc))
            await _quietly(msg.term())
            return
        if msg.metadata.num_delivered > MAX_DELIVERIES:
            self.log.error("inbox_poison_message", subject=msg.subject, type=type(event).__name__)
            await _quietly(msg.term())
            return
        token = otel_context.attach(extract_context(msg.headers))
        try:
            handler = {
                KvReady: self.core.on_kv_ready, KvFailed: self.core.on_kv_failed,
                DecodeStarted: self.core.on_decode_started, SlotReleased: self.core.on_slot_released,
                CancelRequest: self.core.on_cancel,
            }[type(event)]
            with self.tracer.start_as_current_span(
                f"coordinator.{type(event).__name__}",
                attributes={"expresslane.request_id": event.request_id}):
                await self._apply(handler, event)
            await _quietly(msg.ack())
        except Exception:
            self.log.exception("inbox_handler_failed", subject=msg.subject)
        finally:
            otel_context.detach(token)

    # ------------------------------------------------------------ effects

    async def _apply(self, fn, *args) -> None:
        async with self._lock:
            effects = fn(*args, now_ms())
            await self._perform(effects)

    async def _perform(self, effects: list[Effect]) -> None:
        """State first (see StateStore.write), then replies and events in order."""
        await self.store.write(effects)
        for e in effects:
            if isinstance(e, Reply):
                await self.bus.nc.publish(e.reply_to, encode(e.event), headers=inject_headers({}) or None)
            elif isinstance(e, Publish):
                await self.bus.publish(e.subject, e.event)
                # a terminal event goes out twice (xl.handoff.* and the node's .ended): log it once
                ev = e.event
                if isinstance(ev, HandoffEvent) and e.subject == subjects.handoff(ev.request_id, ev.state):
                    self.log.info("handoff", request_id=ev.request_id, state=ev.state,
                                  lease_id=ev.lease_id, generation=ev.generation,
                                  node_id=ev.node_id, slot=ev.slot, reason=ev.reason)
            elif isinstance(e, Observe):
                self.metrics.observe(e.metric, e.value_s)

    # ------------------------------------------------------------ http

    def _health(self) -> tuple[int, str, bytes]:
        is_ok = self.is_ready and self.bus.is_connected
        body = {"status": "ok" if is_ok else "unavailable", "connected": self.bus.is_connected,
                "leases": len(self.core.leases), "queued": len(self.core.queue),
                "nodes": sorted(self.core.nodes), "free_slots": self.core.num_free_slots()}
        return (200 if is_ok else 503), "application/json", json.dumps(body).encode()

    def _metrics(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4", self.metrics.render()


async def _quietly(coro) -> None:
    try:
        await coro
    except Exception:
        pass


async def _run(config: CoordinatorServiceConfig) -> int:
    bus = await Bus.connect(config.nats_url, name="coordinator", auth=config.bus_auth)
    service = CoordinatorService(bus, CoordinatorCore(config.core), config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except BaseException:
        await bus.close()
        raise
    await stop.wait()
    await service.stop()
    await bus.close()
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        config = from_args(shared_config.parse_args(parser, argv))
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("coordinator", config.log_level, json=config.log_format == "json")
    setup_tracing("coordinator")
    try:
        return asyncio.run(_run(config))
    except (BusUnavailable, CoordinatorBusy) as exc:
        print(f"expresslane coordinator: {exc}", file=sys.stderr)
        return 1
