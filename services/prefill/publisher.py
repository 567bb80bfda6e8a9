"""Publishing from inside vLLM (KV-ready / KV-failed from the worker's sender thread; the first token
and the decode start from the scheduler): a bus client on its own asyncio loop thread, so neither
needs an event loop of its own.

``publish_nowait`` hands the event over and returns; ``publish(subject, event, traceparent)`` never blocks the caller for long: it waits at most
``timeout_s`` for the publish to be handed to the NATS client (which buffers while reconnecting);
when nats-server has never been reachable, the event is dropped and logged (the coordinator's
lease timeout then covers the request).

Both first try the calling thread's own way out (shared.bus_direct, ``direct=True``, the default):
the encoded event written to a second connection at once, instead of waiting for the loop thread
to win the GIL from vLLM's threads (a KvReady's publish took 1-3 ms that way on a 2-core host,
the first token ~2 ms). While that connection is down, the loop thread's client sends, with its
replay of recent events after a reconnect. ``publish_many(messages)`` writes several events in
one send; it returns which way they went.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from opentelemetry import context as otel_context

from shared.bus import Bus, BusError, redact_url
from shared.bus_auth import BusAuth
from shared.bus_direct import DirectPublisher
from shared.events import Event
from shared.tracing import context_from_traceparent

# A child of vLLM's logger, so lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.expresslane.prefill")
CONNECT_RETRY_S = 1.0


class Publisher:
    """Owns a daemon thread running an asyncio loop and one Bus connection."""

    def __init__(self, nats_url: str, name: str = "prefill", auth: BusAuth | None = None,
                 direct: bool = True) -> None:
        self.nats_url = nats_url
        self._direct = DirectPublisher(nats_url, name=f"{name}-direct", auth=auth) if direct else None
        self._name = name
        self._auth = auth or BusAuth()
        self._loop = asyncio.new_event_loop()
        self._bus: Bus | None = None
        self._connected = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="expresslane-publisher", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), self._loop)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _connect(self) -> None:
        num_tries = 0
        while not self._stopping:
            try:
                self._bus = await Bus.connect(self.nats_url, name=self._name, auth=self._auth)
                self._connected.set()
                return
            except BusError as exc:
                if num_tries % 30 == 0:  # once, then every ~30 s
                    log.warning("expresslane: NATS not reachable yet (%s); retrying", exc)
                num_tries += 1
                await asyncio.sleep(CONNECT_RETRY_S)

    async def _publish(self, subject: str, event: Event, traceparent: str) -> None:
        await self._publish_now(subject, event, traceparent)
        await self._bus.flush(timeout_s=2.0)

    def publish(self, subject: str, event: Event, traceparent: str = "", timeout_s: float = 5.0) -> bool:
        """Publish with ``traceparent`` as the parent context; False when it could not be sent."""
        if self._written_directly([(subject, event, traceparent)]):
            return True
        if not self._connected.wait(timeout_s):
            log.error("expresslane: dropped %s for %s: NATS at %s not reachable",
                      type(event).__name__, subject, redact_url(self.nats_url))
            return False
        future = asyncio.run_coroutine_threadsafe(self._publish(subject, event, traceparent), self._loop)
        try:
            future.result(timeout_s)
            return True
        except Exception as exc:  # a publish error must never reach vLLM
            log.error("expresslane: publish of %s to %s failed: %s", type(event).__name__, subject, exc)
            return False

    def publish_nowait(self, subject: str, event: Event, traceparent: str = "") -> bool:
        """Hand the publish to the bus thread and return at once (the scheduler's loop must not
        wait on the network); events handed on in order leave in that order. False (logged) when
        NATS has not been reachable yet: the caller's slower path covers the event."""
        return self._written_directly([(subject, event, traceparent)]) or self._hand_over(subject, event, traceparent)

    def publish_many(self, messages: list[tuple[str, Event, str]]) -> str:
        """``(subject, event, traceparent)`` messages, in order, without waiting: "direct" (written
        in one send on this thread), "loop" (handed to the loop thread) or "" (dropped, logged)."""
        if self._written_directly(messages):
            return "direct"
        return "loop" if all([self._hand_over(*m) for m in messages]) else ""

    def _written_directly(self, messages: list[tuple[str, Event, str]]) -> bool:
        return self._direct is not None and self._direct.publish(messages)

    def _hand_over(self, subject: str, event: Event, traceparent: str) -> bool:
        """Queue the publish on the loop thread; False (logged) while NATS has never been reached."""
        if not self._connected.is_set():
            log.warning("expresslane: dropped %s for %s: NATS at %s not connected yet",
                        type(event).__name__, subject, redact_url(self.nats_url))
            return False
        future = asyncio.run_coroutine_threadsafe(self._publish_now(subject, event, traceparent), self._loop)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.error(
            "expresslane: publish of %s to %s failed: %s", type(event).__name__, subject, f.exception()))
        return True

    async def _publish_now(self, subject: str, event: Event, traceparent: str) -> None:
        token = otel_context.attach(context_from_traceparent(traceparent)) if traceparent else None
        try:
            await self._bus.publish(subject, event, replay=True)  # readers drop duplicates
        finally:
            if token is not None:
                otel_context.detach(token)

    def close(self) -> None:
        self._stopping = True
        if self._direct is not None:
            self._direct.close()

        async def _close() -> None:
            if self._bus is not None:
                await self._bus.close()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
