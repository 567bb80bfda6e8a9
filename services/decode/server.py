"""A decode node: the I/O shell around its slot core (slots.py); ``expresslane decode`` starts one
(main.py).

Contract:
- At start: load the engine, register every slot's buffer with the transport once (receiver.py),
  then publish availability (availability.py).
- ``DecodeStart`` (``xl.decode.<node>.start``), ``KvReady``/``KvFailed`` (``xl.kv.ready.<node>``),
  ``CancelRequest`` (``xl.req.*.cancel``) and lease ends (``xl.decode.<node>.ended``) go to the
  core; its effects are performed here, in order (slots.py says which, when).
- A ``KvReady`` is checked against the slot's receive buffer (receiver.check_kv: segment
  checksums) before the core sees it, so before injection; a mismatch (or no checksums where
  ``--require-kv-checksum`` asks for them) goes to the core as a rejected KV instead.
- One decode loop performs the core's engine work (inject + start, cancel) between steps and runs
  ``engine.step()``: on a CUDA engine in a worker thread (the event loop publishes and serves the
  bus while the host waits on the device); on a CPU engine on the event loop itself while steps
  take under INLINE_STEP_MAX_S (a thread hand-off costs two wake-ups per token, more than a small
  model's step), yielding to the loop after each step's tokens; tokens go out as
  ``TokensGenerated`` on ``xl.req.<id>.tokens`` (``index`` counts the completion, the prefill's
  first token is 0; ``logprobs`` per token when the request asked), then ``RequestFinished`` (usage,
  speculation stats). A start the engine refuses fails the request (``RequestFailed``), retryable
  unless the engine's error says no node can serve it (a grammar that does not compile:
  ``invalid_grammar: <why>``, retryable False). Grammars compile ahead (compile_ahead.py).
- HTTP ``/health`` and ``/metrics`` (metrics.py). SIGTERM: publish ``NodeDraining``, finish running
  requests (up to ``--drain-timeout-s``, then fail them as retryable), unregister, exit 0. NATS
  restarts: nats-py reconnects and resubscribes; availability is republished then, what the node
  published just before the drop (tokens, ends) is sent again (shared.bus replay), and reports to
  the coordinator are stored in order (reports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from services.decode.availability import Availability
from services.decode.compile_ahead import CompileAhead
from services.decode.config import DecodeConfig
from services.decode.effects import (
    Effect, Finished, Forget, Heartbeat, Publish, ReleaseEngine, StartEngine, StopEngine,
)
from services.decode.metrics import DecodePaths, LeaseTraces, NodeStatus
from services.decode.receiver import Receiver
from services.decode.reports import Reports
from services.decode.slots import SlotCore
from shared import subjects
from shared.bus import Bus
from shared.events import CancelRequest, DecodeStart, HandoffEvent, KvMessage, KvReady, SpecStats
from shared.http_status import serve_status
from shared.log import get_logger

# The longest CPU step the decode loop runs on the event loop; after a longer one the next runs in a
# worker thread, so starts, cancels and heartbeats wait no longer than this for a step.
INLINE_STEP_MAX_S = 0.005


class DecodeNode:
    def __init__(self, engine, receiver: Receiver, bus: Bus, config: DecodeConfig, ranks: list | None = None) -> None:
        """``ranks``: a tensor-parallel node's ranks 1..N-1 (their receive buffers), advertised with rank 0's."""
        self.engine, self.receiver, self.bus, self.config = engine, receiver, bus, config
        self.node_id = config.node_id
        self.core = SlotCore(config.node_id, config.num_slots, engine.layout.layout_version)
        self.log = get_logger("decode", node_id=self.node_id)
        self.avail = Availability(bus, config, self.core, receiver, engine, self.log, ranks or [])
        self.status = NodeStatus(self.core, lambda: self.bus.is_connected, lambda: self.avail.is_draining,
                                 spec_counters=((lambda: self.engine.spec_counters)
                                                if getattr(engine, "num_spec", 0) else None),
                                 model=getattr(engine, "model_name", ""))
        self.traces = LeaseTraces(config.node_id)
        self.paths = DecodePaths()
        self.compile_ahead = CompileAhead(engine, self.log)
        self.wake = asyncio.Event()
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self.reports = Reports(bus, self.log)
        self._inline_ok = getattr(engine.device, "type", "") == "cpu"
        self._step_inline = False  # set by the last step's duration

    async def start(self) -> None:
        sub, core, feed = self.bus.subscribe, self.core, self._feed
        self._subs += [
            await sub(subjects.kv_ready(self.node_id), self._on_kv, KvMessage),
            await sub(subjects.decode_start(self.node_id), self._on_start, DecodeStart),
            await sub(subjects.REQ_CANCEL_ALL, feed(core.on_cancel), CancelRequest),
            await sub(subjects.decode_lease_ended(self.node_id), feed(core.on_lease_ended), HandoffEvent),
        ]
        self.bus.add_reconnect_callback(self.avail.publish)
        await self.avail.publish()
        self.http = await serve_status(self.config.http_host, self.config.http_port, self.status.routes)
        self.compile_ahead.warm()
        self._tasks += [asyncio.create_task(self.avail.loop()),
                        asyncio.create_task(self.reports.run()),
                        asyncio.create_task(self._decode_loop())]
        self.log.info("decode_ready", http_port=self.http.sockets[0].getsockname()[1],
                      model=self.engine.model_name, slots=self.config.num_slots,
                      transport=self.receiver.name, endpoint=self.receiver.endpoint)

    async def drain(self) -> None:
        """Stop taking leases, let running requests finish (bounded), then stop."""
        self.avail.is_draining = True
        await self.avail.publish()
        t0 = time.monotonic()
        deadline = t0 + self.config.drain_timeout_s
        # Leases granted just before NodeDraining may still be on their way (prefill running):
        # give them a moment, then wait for every pending and active request (bounded).
        settle_s = min(self.config.drain_timeout_s, 2 * self.config.heartbeat_ms / 1000)
        while time.monotonic() < deadline and (not self.core.is_idle or time.monotonic() - t0 < settle_s):
            await asyncio.sleep(0.05)
        await self._apply(self.core.stop_all("failed", "node_stopping"))
        while self.core.engine_slots() and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.reports.flush(15)  # the last SlotReleased reports
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.avail.publish()
        self.http.close()
        self.log.info("decode_stopped", stale_ignored=self.core.num_stale)

    async def abort(self, reason: str) -> None:
        """The node cannot go on (a tensor-parallel rank died): fail every request it holds as
        retryable (the router migrates them), tell the coordinator (SlotReleased, NodeDraining),
        without waiting on the engine."""
        self.log.error("node_abort", reason=reason, hint="every request here fails over to another node; "
                       "restart this node (all of its ranks)")
        self.avail.is_draining = True
        await self._apply(self.core.fail_all(f"node_failed: {reason}", time.perf_counter()))
        with contextlib.suppress(Exception):
            await self.avail.publish()
        await self.reports.flush(5)

    async def _on_start(self, msg: DecodeStart, _) -> None:
        effects = self.core.on_start(msg)
        if self.core.lease(msg.lease_id) is not None:  # kept (not stale, not failed at once)
            self.traces.remember(msg.lease_id)
            self.compile_ahead.prepare(msg)
        await self._apply(effects)

    async def _on_kv(self, msg, _) -> None:
        reason = await self._check_kv(msg) if isinstance(msg, KvReady) else ""
        await self._apply(self.core.on_kv_rejected(msg, reason) if reason else self.core.on_kv(msg))

    async def _check_kv(self, msg: KvReady) -> str:
        """Why the KV this KvReady announces must not be injected ("" when it may)."""
        if msg.node_id != self.node_id or msg.layout_version != self.engine.layout.layout_version:
            return ""  # the core refuses it anyway
        t0 = time.perf_counter()
        if msg.kv_checksums:  # reads the slot's bytes: in a worker thread
            reason, detail = await asyncio.to_thread(self.receiver.check_kv, msg, self.engine.layout,
                                                     self.config.require_kv_checksum)
        else:  # nothing to read: no thread hand-off on the way to the first step
            reason, detail = self.receiver.check_kv(msg, self.engine.layout, self.config.require_kv_checksum)
        if msg.kv_checksums:
            self.status.kv_verify_seconds.observe(time.perf_counter() - t0)
        if reason:
            self.log.warning("kv_rejected", request_id=msg.request_id, slot=msg.slot,
                             lease_id=msg.lease_id, reason=reason, detail=detail)
        return reason

    def _feed(self, core_input):
        """A bus handler that gives each message to the core and performs its effects."""
        async def handler(msg, _) -> None:
            await self._apply(core_input(msg))
        return handler

    async def _apply(self, effects: list[Effect]) -> bool:
        """Perform the core's effects in order; False if one failed (logged, the rest still run)."""
        is_ok = True
        for e in effects:
            try:
                await self._perform(e)
            except Exception:
                self.log.exception("effect_failed", effect=type(e).__name__)
                is_ok = False
        if self.core.has_engine_work:
            self.wake.set()
        return is_ok

    async def _perform(self, e: Effect) -> None:
        match e:
            case Publish() if e.subject == subjects.COORD_REPORT:
                with self.traces.use(e.lease_id):  # stored by the coordinator's stream, in order
                    self.reports.send(e)  # queued: no step waits for the stream's acknowledgement
            case Publish():
                with self.traces.use(e.lease_id):  # tokens (by index), ends: replayable
                    await self.bus.publish(e.subject, e.event, replay=True)
            case Heartbeat():  # a release's beat goes out in its lease's trace, as its report
                with self.traces.use(e.released.lease_id) if e.released else contextlib.nullcontext():
                    await self.avail.publish(e.released)
            case ReleaseEngine():
                self.engine.release(e.slot)
            case Finished():
                path, fast_path_reason = self.paths.end(e.lease_id)
                self.status.requests.labels(path).inc()
                self.traces.finished(e, path, fast_path_reason)
                self.log.info("decode_finished", request_id=e.request_id, slot=e.slot,
                              outcome=e.outcome, reason=e.reason, finish_reason=e.finish_reason,
                              completion_tokens=e.num_completion_tokens, decode_ms=round(e.decode_ms, 2),
                              path=path, fast_path_reason=fast_path_reason)
            case Forget():
                self.traces.forget(e.lease_id)

    async def _decode_loop(self) -> None:
        while True:
            if not (self.core.is_decoding or self.core.has_engine_work):
                await self.wake.wait()
            self.wake.clear()
            try:
                while self.core.has_engine_work:
                    for work in self.core.take_engine_work():
                        await self._apply(await self._engine_work(work))
                if not self.core.is_decoding:
                    continue
                if self.core.fault_stall_due(self.config.fault_stall_after_tokens):
                    self.log.warning("fault_stall", after_tokens=self.config.fault_stall_after_tokens)
                    await asyncio.Event().wait()  # FAULT INJECTION: hung for good; the node stays up
                t0 = time.perf_counter()
                if self._step_inline:
                    outputs = self.engine.step()
                else:
                    outputs = await asyncio.to_thread(self.engine.step)
                step_s = time.perf_counter() - t0
                self.status.step_seconds.observe(step_s)
                self._step_inline = self._inline_ok and step_s < INLINE_STEP_MAX_S
                path = self.engine.last_step_path or "reference"
                self.status.steps.labels(path).inc()
                for slot in outputs:
                    if (lease := self.core.slots[slot].current) is not None:
                        self.paths.step(lease.lease_id, path)
                for slot, out in outputs.items():
                    await self._emit(slot, out)
                if self._step_inline:
                    await asyncio.sleep(0)  # the bus writes these tokens and handlers run before the next step
            except Exception:
                self.log.exception("decode_loop_failed")
                await self._apply(self.core.stop_all("failed", "engine_error"))
                await asyncio.sleep(0.1)

    async def _emit(self, slot: int, out) -> None:
        current = self.core.slots[slot].current
        spec = self.engine.spec_stats(slot) if out.finish_reason is not None else None
        effects = self.core.on_output(slot, out.token_ids, out.finish_reason, spec, time.perf_counter(),
                                      getattr(out, "logprobs", None))
        if not await self._apply(effects) and current is not None:  # that request stops, no other
            await self._apply(self.core.on_emit_failed(slot, current.lease_id))

    async def _engine_work(self, work: StartEngine | StopEngine) -> list[Effect]:
        """One start or stop; whatever it raises ends that lease's phase in the core (failed, or stopped), so a
        batch of work taken from the core never leaves a slot 'starting' or 'stopping' for good."""
        try:
            return await self._start(work) if isinstance(work, StartEngine) else self._stop(work)
        except Exception as exc:
            self.log.exception("engine_work_failed", lease_id=work.lease_id, slot=work.slot,
                               work=type(work).__name__)
            if isinstance(work, StartEngine):
                return self.core.on_engine_failed(work.slot, work.lease_id, f"engine_error: {exc}",
                                                  time.perf_counter())
            return self.core.on_engine_stopped(work.slot, work.lease_id, SpecStats(), time.perf_counter())

    def _stop(self, work: StopEngine) -> list[Effect]:
        self.engine.cancel(work.slot)
        spec = self.engine.spec_stats(work.slot)
        return self.core.on_engine_stopped(work.slot, work.lease_id, spec, time.perf_counter())

    def _engine_start(self, work: StartEngine) -> None:
        self.engine.inject(work.slot, work.num_kv_tokens)
        self.engine.start(work.slot, work.first_token_id, work.sampling)

    async def _start(self, work: StartEngine) -> list[Effect]:
        """Inject the slot's KV and arm the engine (in a worker thread where a grammar may still be
        compiling or the engine's steps run there; on the event loop otherwise: both are quick);
        the core hears how it went."""
        self.traces.start(work)
        started_at_s = time.perf_counter()
        try:
            if self._inline_ok and work.sampling.structured is None:
                self._engine_start(work)
            else:
                await asyncio.to_thread(self._engine_start, work)
        except Exception as exc:  # bad sizes or params: the request fails, the node lives on
            # An engine error that no node gets past (a grammar that does not compile: GrammarError)
            # says so (``retryable`` False, its ``code``): the router must not migrate the request.
            retryable, code = getattr(exc, "retryable", True), getattr(exc, "code", "start_failed")
            if not retryable:
                self.log.warning("start_refused", request_id=work.request_id, slot=work.slot, code=code,
                                 reason=str(exc))
            return self.core.on_engine_failed(work.slot, work.lease_id, f"{code}: {exc}",
                                              time.perf_counter(), retryable=retryable)
        fast_path_reason = self.engine.slot_fast_path_reason(work.slot)
        self.paths.start(work.lease_id, fast_path_reason)
        self.log.info("decode_started", request_id=work.request_id, slot=work.slot,
                      lease_id=work.lease_id, num_tokens=work.num_kv_tokens,
                      max_tokens=work.sampling.max_tokens, migration=work.migration,
                      fast_path_reason=fast_path_reason)
        return self.core.on_engine_started(work.slot, work.lease_id, started_at_s)
