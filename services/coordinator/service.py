"""``expresslane coordinator``: the NATS shell around the coordinator core.

Contract:
- Claims: request/reply on ``subjects.CLAIM`` (ClaimRequest -> ClaimGranted | ClaimRejected);
  a queued claim is answered later on its reply subject.
- Heartbeats: ``NodeAvailable`` / ``NodeDraining`` on ``subjects.NODE_AVAIL_ALL`` (live only).
  Each counts as proof of life the moment it arrives (``core.on_heard``); its handling (restart
  check, dispatch to freed slots) follows in order, behind any state write in progress. A state
  write waits while the bucket's stream has no leader (a NATS member died: JetStream elects a new
  one within seconds); a node is not taken for dead meanwhile, and the ticks themselves allow for
  the time the coordinator was not listening (core.tick).
- KV-ready/failed (``xl.kv.ready.*``), decode reports (``xl.coord.report``) and cancels
  (``xl.req.*.cancel``) are read through a JetStream work-queue stream with a durable consumer that
  each new leader creates anew for itself (what the last one had not acknowledged comes again at
  once, and a paused old leader receives nothing more), so what arrives while no coordinator leads
  is applied when one does; each message is acknowledged after its effects are persisted (handling
  is idempotent, redelivery is harmless), or left for the next leader when leadership ended first.
- Every transition is published as a ``HandoffEvent`` on ``xl.handoff.<request_id>.<state>``.
- State (leases, waiting claims, next generation) lives in the JetStream KV bucket
  ``subjects.COORD_KV_BUCKET`` (services.coordinator.store): written before a grant is answered,
  reloaded at start.
- Leader and standby (services.coordinator.leadership): any number of coordinators may run on one
  NATS; the one holding the leader key in the bucket leads: it restores the state, then fetches
  reports and answers claims; the others only learn the nodes from heartbeats and watch the key,
  and one of them takes over when the leader stops renewing it. A leader that cannot renew in time
  stops answering, drops its state and becomes a standby; every state write of a leader is
  conditional on the key's revision, so one that lost it writes nothing. A start that outlasted
  the lease (JetStream still electing leaders after losing a member) renews the key before it
  serves; a first start that meets a cluster still forming stands by and tries again.
- HTTP: ``/health`` (200 when connected, 503 otherwise; ``role``: leader or standby) and
  ``/metrics`` (Prometheus, ``xl_coord_is_leader``).
- Configuration: one ``CoordinatorServiceConfig`` (services.coordinator.config), built and checked
  once in ``main`` from flags and ``EXPRESSLANE_*`` variables, passed to the service and the core.
- SIGTERM/SIGINT: stop taking claims, turn waiting claims away with ``retry_after_ms``, flush,
  delete the leader key (a standby takes over at once), exit 0; leases stay in the bucket for the
  next coordinator. NATS restarts: nats-py reconnects,
  subscriptions and the durable consumer resume; while disconnected no deadline is applied, and
  after reconnecting every node counts as just seen (missed heartbeats prove nothing then).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
import uuid

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.coordinator.config import CoordinatorServiceConfig, build_parser, from_args
from services.coordinator.core import CoordinatorCore
from services.coordinator.leadership import Leadership, NotLeading
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.model import Effect, Observe, Publish, Reply
from services.coordinator.store import LeaderKeyTaken, StateStore
from shared import config as shared_config
from shared import subjects
from shared.bus import Bus, BusError, BusUnavailable
from shared.events import (
    CancelRequest, ClaimRejected, ClaimRequest, DecodeStarted, HandoffEvent, KvFailed, KvReady, NodeAvailable,
    NodeDraining, NodeMessage, SlotReleased, decoder, encode,
)
from shared.gcheap import GcPauses, freeze_heap
from shared.http_status import serve_status
from shared.log import get_logger, setup_logging
from shared.tracing import extract_context, setup_tracing

INBOX_SUBJECTS = [subjects.KV_READY_ALL, subjects.COORD_REPORT, subjects.REQ_CANCEL_ALL]
InboxMessage = KvReady | KvFailed | DecodeStarted | SlotReleased | CancelRequest
INBOX_CONSUMER = "coordinator"  # the report stream's durable consumer, the leader's alone
MAX_DELIVERIES = 5  # a report that fails this often is dropped (logged), not retried forever
INBOX_BATCH = 256  # reports applied as one batch of core inputs: one state write, then the acks
# A new leader's report consumer is answered once the consumer has its own raft leader: with a
# cluster member down that election takes ~5 s, just past nats-py's 5 s, and every attempt after a
# timeout deleted and created the consumer again, to wait once more. The calls before it (stream,
# delete) keep the 5 s: one sent while the cluster has no metadata leader is never answered.
CONSUMER_CREATE_TIMEOUT_S = 20.0
STREAM_NAME_IN_USE = 10058  # add_stream of a stream that exists with other settings: update it
# JetStream answers that mean "not now" (a cluster still forming or electing): no suitable peers
# for placement (one still counts as offline), cluster temporarily unavailable
TRANSIENT_JS_ERRORS = (10005, 10008)


class StateWriteFailed(NotLeading):
    """A state write failed after the store's retries: the core's memory is ahead of the store."""


class CoordinatorBusy(RuntimeError):
    """The coordinator cannot run here: nats-server has no JetStream."""


def now_ms() -> int:
    """Wall clock: lease times are persisted and compared across coordinators."""
    return int(time.time() * 1000)


def mono_ms() -> int:
    """Local monotonic clock: the leader lease is timed on it (never persisted)."""
    return int(time.monotonic() * 1000)


def default_coordinator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class CoordinatorService:
    """Feeds bus messages and time to the core; performs its effects in order."""

    def __init__(self, bus: Bus, core: CoordinatorCore, config: CoordinatorServiceConfig) -> None:
        self.bus, self.core, self.config = bus, core, config
        self.coordinator_id = config.coordinator_id or default_coordinator_id()
        self.leadership = Leadership(config.leader)
        self.metrics = CoordinatorMetrics(core, self.leadership)
        self.log = get_logger("coordinator")
        self.tracer = trace.get_tracer("expresslane.coordinator")
        self._lock = asyncio.Lock()  # one batch of effects at a time; leader key writes too
        self._subs: list = []  # heartbeats: leader and standby
        self._leader_subs: list = []  # claims: the leader only
        self._inbox_sub = None
        # reports received, waiting for the inbox task: (event, message, trace context)
        self._inbox_q: asyncio.Queue = asyncio.Queue()
        self._inbox_handlers = {
            KvReady: core.on_kv_ready, KvFailed: core.on_kv_failed,
            DecodeStarted: core.on_decode_started, SlotReleased: core.on_slot_released,
            CancelRequest: core.on_cancel,
        }
        self._tasks: list[asyncio.Task] = []  # the leader's loops
        self._leadership_task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # leadership loop: look now (a write was fenced)
        self._inbox_decoder = decoder(InboxMessage)
        self._node_q: asyncio.Queue = asyncio.Queue()  # heartbeats heard, waiting for handling
        self._node_task: asyncio.Task | None = None
        self.http: asyncio.Server | None = None
        self.is_ready = False
        self.is_serving = False  # leading: state restored, claims and reports handled

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._js = self.bus.nc.jetstream()
        self._js_consumer_create = self.bus.nc.jetstream(timeout=CONSUMER_CREATE_TIMEOUT_S)
        try:
            kv = await self.bus.kv(self.config.kv_bucket, replicas=self.config.js_replicas)
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
            raise CoordinatorBusy(
                "nats-server has no JetStream: the coordinator keeps its state there; start "
                "nats-server with -js (`expresslane nats` does)") from exc
        self.store = StateStore(kv, self._js, self.config.kv_bucket, nc=self.bus.nc)
        await self.store.enable_atomic()
        self.bus.add_reconnect_callback(self._on_reconnected)
        self._node_task = asyncio.create_task(self._node_loop())
        self._subs.append(await self.bus.subscribe(subjects.NODE_AVAIL_ALL, self._on_node, NodeMessage))
        self.http = await serve_status(self.config.http_host, self.config.http_port, {
            "/health": self._health, "/metrics": self._metrics})
        try:
            await self._leadership_step()  # lead at once when no coordinator does
        except Exception as exc:
            if not _is_transient(exc):
                raise
            # A NATS cluster started with us may not place replicated streams yet: stand by,
            # the leadership loop tries again.
            self.log.warning("leadership_deferred", error=str(exc) or type(exc).__name__)
        self._leadership_task = asyncio.create_task(self._leadership_loop())
        self.is_ready = True
        self.log.info("coordinator_ready", http_port=self.http.sockets[0].getsockname()[1],
                      coordinator_id=self.coordinator_id, role=self._role(),
                      leases=len(self.core.leases), queued=len(self.core.queue))

    async def stop(self) -> None:
        """Drain: no new claims, waiting claims turned away, state flushed, leader key let go."""
        self.is_ready = False
        if self._leadership_task is not None:
            self._leadership_task.cancel()
            await asyncio.gather(self._leadership_task, return_exceptions=True)
        for sub in self._subs:
            await _quietly(sub.unsubscribe())
        if self._node_task is not None:
            self._node_task.cancel()
            await asyncio.gather(self._node_task, return_exceptions=True)
        if self.is_serving:
            await self._stop_leader_work()
            await self._apply(self.core.reject_queued, "coordinator_stopping")
            await _quietly(self.store.release_leader())
            self.is_serving = False
        if self.http is not None:
            self.http.close()
        self.log.info("coordinator_stopped", leases=len(self.core.leases))

    # ------------------------------------------------------------ leadership

    def _role(self) -> str:
        return "leader" if self.is_serving else "standby"

    async def _leadership_loop(self) -> None:
        while True:
            is_leader = self.leadership.role == "leader"
            period_ms = self.config.leader.renew_ms if is_leader else self.config.leader.poll_ms
            try:
                await asyncio.wait_for(self._wake.wait(), period_ms / 1000)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._leadership_step()
            except Exception:
                self.log.exception("leadership_step_failed", role=self._role())

    async def _leadership_step(self) -> None:
        """Leader: renew, or step down when the lease ran out. Standby: watch the key, take it."""
        if self.is_serving:
            await self._renew()
            if not self.leadership.is_leading(mono_ms()):
                await self._step_down()
            return
        try:
            revision, is_held = await asyncio.wait_for(self.store.read_leader(),
                                                       self.config.leader.ttl_ms / 1000)
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
            self.log.debug("leader_key_unreadable", error=str(exc))
            return
        if self.leadership.observe(revision, is_held, mono_ms()):
            await self._take_over(revision)

    async def _renew(self) -> None:
        # Also when late (this process or NATS stalled past the lease): a renewal that still
        # finds our revision proves nobody took over (a takeover changes it), so we lead on with
        # our state instead of dropping it and taking over from ourselves a second later.
        async with self._lock:
            if self.leadership.role != "leader":
                return
            sent_ms = mono_ms()
            try:
                revision = await asyncio.wait_for(self.store.renew_leader(self.coordinator_id),
                                                  self.config.leader.ttl_ms / 1000)
                self.leadership.renewed(revision, sent_ms)
            except NotLeading:
                self.leadership.step_down("key_taken")
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
                self.log.warning("leader_renew_failed", error=str(exc) or type(exc).__name__)

    async def _take_over(self, revision: int) -> None:
        """Take the key by compare-and-set, restore the state, then serve claims and reports."""
        async with self._lock:
            sent_ms = mono_ms()
            try:
                won = await asyncio.wait_for(self.store.take_leader(self.coordinator_id, revision),
                                             self.config.leader.ttl_ms / 1000)
            except NotLeading:
                self.leadership.lost_race()
                return
            self.leadership.won(won, sent_ms)
            try:
                await self._start_inbox()
                await self._restore()
                self._leader_subs.append(
                    await self.bus.subscribe(subjects.CLAIM, self._on_claim, ClaimRequest))
                if not self.leadership.is_leading(mono_ms()):
                    # The start outlasted the lease (JetStream was electing leaders after losing a
                    # member). Renew before serving: our revision still there proves nobody took
                    # over meanwhile, so the state just restored is the bucket's.
                    renew_ms = mono_ms()
                    revision = await asyncio.wait_for(
                        self.store.renew_leader(self.coordinator_id), self.config.leader.ttl_ms / 1000)
                    self.leadership.renewed(revision, renew_ms)
            except BaseException:
                self.leadership.step_down("start_failed")
                await self._stop_leader_work()
                self.store.forget_leader()
                self.core.drop_state()
                raise
            self._tasks += [asyncio.create_task(self._tick_loop()),
                            asyncio.create_task(self._compact_loop()),
                            asyncio.create_task(self._inbox_loop())]
            self.is_serving = True
        self.log.info("leader_elected", coordinator_id=self.coordinator_id, revision=won,
                      leases=len(self.core.leases), queued=len(self.core.queue),
                      took_ms=mono_ms() - sent_ms)

    async def _step_down(self) -> None:
        """The lease is gone: stop serving, nak what was fetched, forget the state."""
        async with self._lock:
            self.leadership.step_down("lease_expired")  # counted once, whatever ended it
            self.is_serving = False
            await self._stop_leader_work()
            self.store.forget_leader()
            self.core.drop_state()
        self.log.warning("leader_stepped_down", coordinator_id=self.coordinator_id,
                         lost=dict(self.leadership.counters))

    async def _stop_leader_work(self) -> None:
        for sub in self._leader_subs:
            await _quietly(sub.unsubscribe())
        self._leader_subs = []
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._inbox_sub is not None:
            await _quietly(self._inbox_sub.unsubscribe())
            self._inbox_sub = None
        # Reports received but not applied stay unacknowledged: the next leader gets them.
        self._inbox_q = asyncio.Queue()

    async def _restore(self) -> None:
        leases, queued, next_generation = await self.store.load()
        self.core.restore(leases, queued, next_generation, now_ms())
        if leases or queued:
            self.log.info("coordinator_restored", leases=len(leases), queued=len(queued),
                          next_generation=self.core.next_generation)

    async def _start_inbox(self) -> None:
        js = self._js
        stream = StreamConfig(name=self.config.inbox_stream, subjects=INBOX_SUBJECTS,
                              retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                              max_age=3600.0, num_replicas=self.config.js_replicas)
        try:
            await js.add_stream(stream)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != STREAM_NAME_IN_USE:
                raise
            await js.update_stream(stream)
        # Ours alone from now on: a consumer still bound to an old leader (dead, or paused with
        # its connection open) is deleted; its unacknowledged reports stay in the stream and come
        # to the new consumer at once.
        try:
            await js.delete_consumer(self.config.inbox_stream, INBOX_CONSUMER)
        except nats.js.errors.NotFoundError:
            pass
        consumer = ConsumerConfig(durable_name=INBOX_CONSUMER, ack_policy=AckPolicy.EXPLICIT,
                                  filter_subjects=INBOX_SUBJECTS, ack_wait=30.0,
                                  max_ack_pending=10_000)
        self._inbox_sub = await self._js_consumer_create.subscribe(
            subjects.COORD_REPORT, durable=INBOX_CONSUMER, stream=self.config.inbox_stream,
            config=consumer, cb=self._on_inbox, manual_ack=True)

    async def _tick_loop(self) -> None:
        # Apply what arrived while we were down before any deadline fires.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                info = await self._js.consumer_info(self.config.inbox_stream, INBOX_CONSUMER)
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
            stall_ms = self.core.last_stall_ms
            if stall_ms:  # a busy event loop: debug; blocked on NATS or cut off: warning
                log = self.log.warning if stall_ms >= self.config.core.max_tick_gap_ms else self.log.debug
                log("coordinator_stalled", stall_ms=stall_ms,
                    hint="node deadlines moved back by the time not listening")

    async def _on_reconnected(self) -> None:
        # Beats missed while cut off prove nothing: every node counts as seen now, at once, not
        # behind a state write (this runs in nats-py's reconnect task); it has no effects to make.
        self.core.on_reconnected(now_ms())

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
            if not await self._apply(self.core.on_claim, claim, msg.reply):
                # Leadership ended under this claim: the caller retries (the next leader answers).
                await self.bus.nc.publish(msg.reply, encode(ClaimRejected(
                    request_id=claim.request_id, reason="coordinator_stopping",
                    retry_after_ms=self.config.core.retry_after_ms)))

    async def _on_node(self, event: NodeAvailable | NodeDraining, msg) -> None:
        """Never waits: the node is alive now, whatever a state write in progress waits for
        (nats-py hands this subscription its next message only once this returns)."""
        self.core.on_heard(event.node_id, now_ms())
        # a beat carrying a slot release is applied in that lease's trace (the node sent it there)
        ctx = extract_context(msg.headers) if getattr(event, "released", None) else None
        self._node_q.put_nowait((event, ctx))

    async def _node_loop(self) -> None:
        """Heartbeats and drain notices in arrival order, each applied as it comes (a restart
        fails the node's old leases, freed slots go to waiting claims)."""
        while True:
            event, ctx = await self._node_q.get()
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                if not self.is_serving:
                    self.core.observe_node(event, now_ms())
                elif isinstance(event, NodeAvailable):
                    await self._apply(self.core.on_heartbeat, event)
                else:
                    await self._apply(self.core.on_draining, event)
            except Exception:
                self.log.exception("node_message_failed", node_id=event.node_id)
            finally:
                if token is not None:
                    otel_context.detach(token)

    async def _on_inbox(self, msg) -> None:
        """Decode and queue a report; the inbox task applies what is waiting in one batch."""
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
        self._inbox_q.put_nowait((event, msg, extract_context(msg.headers)))

    async def _inbox_loop(self) -> None:
        """Apply reports in batches: all that arrived while the last batch was written go through
        the core one by one (each in its own span, under its sender's trace), then one state write
        and the replies, then the acks. A burst of 500 cancels costs a few writes, not 500."""
        while True:
            batch = [await self._inbox_q.get()]
            while len(batch) < INBOX_BATCH and not self._inbox_q.empty():
                batch.append(self._inbox_q.get_nowait())
            calls = [(self._inbox_handlers[type(event)], (event,), ctx,
                      f"coordinator.{type(event).__name__}", event.request_id)
                     for event, _, ctx in batch]
            try:
                applied = await self._apply_many(calls)
            except Exception:
                self.log.exception("inbox_batch_failed", reports=len(batch))
                continue  # unacknowledged: delivered again after ack_wait
            # Not leading: nothing acknowledged, the next leader's consumer gets them. A report
            # whose handler failed is not acknowledged either: it comes again (MAX_DELIVERIES).
            for (_, msg, _), ok in zip(batch, applied or []):
                if ok:
                    await _quietly(msg.ack())

    # ------------------------------------------------------------ effects

    async def _apply(self, fn, *args) -> bool:
        """Feed the core and perform its effects; False when this coordinator no longer leads
        (nothing was written or sent; the state is dropped when it steps down)."""
        async with self._lock:
            effects = fn(*args, now_ms())
            return await self._perform_leading(effects)

    async def _apply_many(self, calls: list) -> list[bool] | None:
        """Feed the core several inputs ``(fn, args, trace context, span name, request id)`` in
        order, then perform all their effects at once (the store keeps the last write per key).
        Per input: applied, or its handler raised (logged; its effects, if any, are not made).
        None when this coordinator no longer leads (as for :meth:`_apply`)."""
        async with self._lock:
            effects: list[Effect] = []
            contexts: list = []  # per effect: the trace context its events are sent under
            applied = []
            for fn, args, ctx, span, request_id in calls:
                token = otel_context.attach(ctx)
                try:
                    with self.tracer.start_as_current_span(
                            span, attributes={"expresslane.request_id": request_id}):
                        made = fn(*args, now_ms())
                        effects += made
                        contexts += [otel_context.get_current()] * len(made)
                    applied.append(True)
                except Exception:
                    self.log.exception("inbox_handler_failed", request_id=request_id, span=span)
                    applied.append(False)
                finally:
                    otel_context.detach(token)
            return applied if await self._perform_leading(effects, contexts) else None

    async def _perform_leading(self, effects: list[Effect], contexts: list | None = None) -> bool:
        """Perform the effects; False when they were not made: this coordinator no longer leads,
        or its state write failed. Either way it steps down: the core has already moved past what
        the store holds, so nothing more may be granted, acknowledged or sent from that memory
        until the state is restored from the store (the leadership loop drops it and takes over
        again when the key is still free to take)."""
        try:
            await self._perform(effects, contexts)
        except NotLeading as exc:
            reason = ("key_taken" if isinstance(exc, LeaderKeyTaken)
                      else "state_write_failed" if isinstance(exc, StateWriteFailed) else "lease_expired")
            self.leadership.step_down(reason)
            self._wake.set()
            self.log.warning("not_leading", error=str(exc), reason=reason)
            return False
        return True

    async def _perform(self, effects: list[Effect], contexts: list | None = None) -> None:
        """State first (see StateStore.write), then replies and events in order; only while
        leading (checked here, and by the store's conditional writes). ``contexts``: per effect,
        the trace context to send it under (a batch's effects come from different traces).

        An input with no effects passes while the lease is only late (a renewal still on its way can
        prove nobody took over: _renew), but not once an earlier input's effects were refused and
        this coordinator stepped down: that input had already changed the core's memory (a
        heartbeat's slot release applied in memory whose write never happened makes the release's
        report a no-op), so nothing more is taken from it and the report stays unacknowledged for
        the next leader, which reads the store."""
        if not self.leadership.is_leading(mono_ms()) and (effects or self.leadership.role != "leader"):
            raise NotLeading("the leader lease ran out")
        try:
            await self.store.write(effects)
        except NotLeading:
            raise
        except Exception as exc:  # the store's retries ran out (logged there)
            raise StateWriteFailed(f"the state write failed: {exc!r}") from exc
        for i, e in enumerate(effects):
            token = otel_context.attach(contexts[i]) if contexts else None
            try:
                await self._send(e)
            except BusError as exc:  # one message not sent (the connection is down, its buffer full): the
                # others still go; the state is written, so deadlines and a retrying sender recover this one
                self.log.warning("send_failed", effect=type(e).__name__, error=str(exc),
                                 request_id=getattr(getattr(e, "event", None), "request_id", ""))
            finally:
                if token is not None:
                    otel_context.detach(token)

    async def _send(self, e: Effect) -> None:
        if isinstance(e, Reply):
            await self.bus.publish(e.reply_to, e.event, replay=True)
        elif isinstance(e, Publish):
            # a terminal event goes out twice (xl.handoff.* and the node's .ended): log it once;
            # only the node's copy is replayed after a reconnect (watchers of the fan-out
            # see each event once)
            ev = e.event
            is_fanout = isinstance(ev, HandoffEvent) and e.subject == subjects.handoff(
                ev.request_id, ev.state)
            await self.bus.publish(e.subject, e.event, replay=not is_fanout)
            if is_fanout:
                self.log.info("handoff", request_id=ev.request_id, state=ev.state,
                              lease_id=ev.lease_id, generation=ev.generation,
                              node_id=ev.node_id, slot=ev.slot, reason=ev.reason)
        elif isinstance(e, Observe):
            self.metrics.observe(e.metric, e.value_s)

    # ------------------------------------------------------------ http

    def _health(self) -> tuple[int, str, bytes]:
        is_ok = self.is_ready and self.bus.is_connected
        body = {"status": "ok" if is_ok else "unavailable", "connected": self.bus.is_connected,
                "role": self._role(), "coordinator_id": self.coordinator_id,
                "leases": len(self.core.leases), "queued": len(self.core.queue),
                "nodes": sorted(self.core.nodes), "free_slots": self.core.num_free_slots()}
        return (200 if is_ok else 503), "application/json", json.dumps(body).encode()

    def _metrics(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4", self.metrics.render()


def _is_transient(exc: BaseException) -> bool:
    """A JetStream failure worth trying again in a moment (no reply yet, a cluster forming)."""
    if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
                        nats.js.errors.NoStreamResponseError)):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (
        exc.code == 503 or exc.err_code in TRANSIENT_JS_ERRORS)


async def _quietly(coro) -> None:
    try:
        await coro
    except Exception:
        pass


async def _run(config: CoordinatorServiceConfig) -> int:
    bus = await Bus.connect(config.nats_url, name="coordinator", auth=config.bus_auth)
    service = CoordinatorService(bus, CoordinatorCore(config.core), config)
    service.log.info("gc_heap_frozen", **freeze_heap())  # the imports out of the collector's walks (shared.gcheap)
    GcPauses(service.metrics.registry, "xl_coord")
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
