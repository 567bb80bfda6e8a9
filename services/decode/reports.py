"""The decode node's reports to the coordinator (``DecodeStarted``, ``SlotReleased``), in order,
each until the coordinator's report stream has stored it.

Contract: ``send(effect)`` queues the report and returns at once: the decode loop never waits for
the stream's acknowledgement (a start would hold the first step, and every other slot's step, for
that round trip). ``run()`` publishes the queue one report at a time, each after the one before it
was stored, retrying while the stream has no leader (``Bus.publish_stored``: a NATS member died, a
new leader is being elected; after each of its windows, again), so no report is lost and none
overtakes another. Token streams never wait for it. ``flush(timeout_s)`` waits for the queue to
empty (at shutdown). Each queued report keeps its lease's trace context.
"""

from __future__ import annotations

import asyncio
import contextlib

from opentelemetry import context as otel_context

from services.decode.effects import Publish
from shared.bus import Bus, BusTimeout
from shared.log import get_logger


class Reports:
    def __init__(self, bus: Bus, log=None) -> None:
        self.bus = bus
        self.log = log or get_logger("decode")
        self._queue: asyncio.Queue = asyncio.Queue()

    def send(self, e: Publish) -> None:
        self._queue.put_nowait((e, otel_context.get_current()))

    async def run(self) -> None:
        while True:
            e, trace_context = await self._queue.get()
            token = otel_context.attach(trace_context)  # the lease's span, as when it was queued
            try:
                await self._store(e)
            finally:
                otel_context.detach(token)
                self._queue.task_done()

    async def _store(self, e: Publish) -> None:
        """Publish until stored: a stream without a leader for longer than one try's window (a
        cluster re-electing after losing members) delays this report and those behind it, it never
        drops one. Only a report that cannot be sent at all (not encodable) is logged and left."""
        which = dict(report=type(e.event).__name__, request_id=getattr(e.event, "request_id", ""))
        attempts = 0
        while True:
            try:
                await self.bus.publish_stored(e.subject, e.event)
                if attempts:
                    self.log.info("report_stored", **which, attempts=attempts + 1)
                return
            except BusTimeout as exc:
                attempts += 1
                self.log.warning("report_waiting", **which, error=str(exc),
                                 hint="the coordinator's report stream is not storing (no leader, or "
                                      "NATS unreachable); retrying, later reports wait behind this one")
            except Exception:
                self.log.exception("report_failed", **which)
                return

    async def flush(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout_s)
