"""The bus: typed publish/subscribe/request over NATS, with trace context in the headers.

Contract:
    bus = await Bus.connect(url, name="router", user=None, password=None, connect_timeout_s=2.0,
                            auth=BusAuth())
        # BusUnavailable when nats-server cannot be reached at first connect (BusAuthError when it
        # refuses the credentials, BusTlsError when the TLS handshake fails or a TLS client meets
        # a server without TLS); after that the client reconnects forever by itself and
        # publishes made while disconnected are buffered (nats-py pending buffer).
    await bus.publish(subject, event)              # JSON (shared.events.encode) + traceparent header
    await bus.publish(subject, event, replay=True)
        # for events their readers take twice without harm (tokens by index, reports, lease
        # ends): when the connection drops, what was published this way in the last
        # REPLAY_WINDOW_S is sent again on the next server first, ahead of anything newer, as
        # a server that dies (a cluster member killed) takes what it had not yet passed on.
    await bus.publish_stored(subject, event)  # returns once a JetStream stream acknowledged it
        # (retrying while the stream elects a leader); BusTimeout after retry_s.
    sub = await bus.subscribe(subject, handler, kind, queue="")
        # returns once nats-server has the subscription: a publish made after it is delivered.
        # handler: async def handler(event, msg) -> None, called in order, with the trace context
        # of the message's headers attached. Undecodable messages are logged and counted
        # (bus.num_undecodable); a handler's exception is logged and counted (bus.num_handler_errors)
        # and does not stop the subscription. sub.unsubscribe() ends it.
    reply = await bus.request(subject, event, reply_kind, timeout_s)
        # BusTimeout when no reply arrives in time (BusNoResponders, a BusTimeout, when nobody
        # listens); the reply is decoded as reply_kind.
    await bus.respond(msg, event)                  # reply to a request, with traceparent
    kv = await bus.kv(bucket)                      # nats-py KeyValue, bucket created if missing
    bus.add_reconnect_callback(async fn) ; bus.add_error_callback(async fn(exc))
        # error callbacks see asynchronous server errors, e.g. "Permissions Violation for Publish".
    await bus.close()

Credentials and TLS material come from files named by ``auth`` (shared.bus_auth: --nats-user with
--nats-password-file, --nats-creds-file, --nats-tls-ca/-cert/-key); with TLS configured, a password
is sent only over TLS. Credentials may also ride in the URL (nats://user:password@host:port, from
EXPRESSLANE_NATS_URL rather than a flag, which `ps` shows); they are never logged.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context

from shared import events
from shared.bus_auth import BusAuth
from shared.log import get_logger
from shared.tracing import extract_context, inject_headers

Handler = Callable[[Any, Msg], Awaitable[None]]
AsyncCallback = Callable[[], Awaitable[None]]
ErrorCallback = Callable[[Exception], Awaitable[None]]

RECONNECT_WAIT_S = 0.5
PING_INTERVAL_S = 5.0  # with MAX_OUTSTANDING_PINGS: a silent server is left within ~15-20 s
MAX_OUTSTANDING_PINGS = 3
REPLAY_WINDOW_S = 2.0  # publish(replay=True) this recent is sent again after a reconnect
DRAIN_TIMEOUT_S = 5  # close(): how long handlers may take to finish what was delivered
_log = get_logger("shared.bus")


class BusError(RuntimeError):
    """Base of the bus's errors."""


class BusUnavailable(BusError):
    """nats-server cannot be reached (at first connect)."""


class BusAuthError(BusUnavailable):
    """nats-server refused this client's credentials."""


class BusTlsError(BusUnavailable):
    """The TLS handshake with nats-server failed, or a TLS client met a server without TLS."""


class BusTimeout(BusError, TimeoutError):
    """No reply within the request's timeout."""


class BusNoResponders(BusTimeout):
    """Nobody subscribes to the request's subject."""


# How a server that refuses a TLS client's certificate shows at the client: under TLS 1.3 the
# client's handshake completes before the server checks its certificate, so the refusal arrives
# either as the server's alert (an ssl.SSLError) or, when the client writes first, as a dropped
# connection; which one depends on timing.
_DROPPED = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, ssl.SSLEOFError,
            nats.errors.UnexpectedEOF)


def client_verification_refused(errors: list[BaseException], server_info: dict, is_tls: bool
                                ) -> BaseException | None:
    """The error that shows a first connect refused for the client's certificate, or None: a TLS
    client, a server whose INFO says it verifies clients (``tls_verify``), and a connection it
    dropped (the TLS 1.3 race above)."""
    if not (is_tls and server_info.get("tls_verify")):
        return None
    return next((e for e in errors if isinstance(e, _DROPPED)), None)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and errors)."""
    out = []
    for one in url.split(","):
        parts = urllib.parse.urlsplit(one.strip())
        if parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
            one = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        out.append(one.strip())
    return ",".join(out)


class Bus:
    """A connected bus client (build it with :meth:`Bus.connect`)."""

    def __init__(self, nc: nats.NATS, url: str, name: str) -> None:
        self.nc = nc
        self.url = url
        self.name = name
        self.num_undecodable = 0
        self.num_handler_errors = 0
        self._reconnect_cbs: list[AsyncCallback] = []
        self._error_cbs: list[ErrorCallback] = []
        self._js = nc.jetstream()
        self._closing = False
        self._recent: collections.deque[tuple[float, str, bytes, dict | None]] = collections.deque()

    # ------------------------------------------------------------------ connection

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str = "expresslane",
        user: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 2.0,
        auth: BusAuth | None = None,
    ) -> Bus:
        """Connect to nats-server at ``url`` (see the module docstring)."""
        bus: Bus | None = None
        first_errors: list[Exception] = []
        nc = nats.NATS()
        auth = auth or BusAuth()
        try:
            creds = {"user": user, "password": password, **auth.connect_kwargs()}
        except (OSError, ssl.SSLError) as exc:
            raise BusAuthError(f"cannot read the NATS credentials or TLS files: {exc}") from exc
        if auth.is_tls and creds["password"] is not None:
            creds["password"] = _only_over_tls(nc, creds["password"])

        servers = [s.strip() for s in url.split(",") if s.strip()]
        # A certificate the client cannot verify, or a server without TLS, will not change on a
        # retry: a first connect to one server gives up at once instead of at its timeout (with
        # several, the next member may still be fine: they are all tried, as before).
        hopeless = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            if bus is None:
                first_errors.append(exc)
                if len(servers) == 1 and isinstance(exc, (ssl.SSLCertVerificationError, BusTlsError)):
                    hopeless.set()
            else:
                await bus._on_error(exc)

        async def on_disconnected() -> None:
            if bus is not None and not bus._closing:
                _log.warning("bus_disconnected", url=redact_url(url), client=name)
                await bus._requeue_recent()

        async def on_reconnected() -> None:
            if bus is not None:
                await bus._on_reconnected()

        try:
            # Two attempts per server at first (one server: none after a hopeless TLS error);
            # once connected, reconnect forever.
            await _unless_set(hopeless, asyncio.wait_for(
                nc.connect(
                    servers=servers, name=name, **creds,
                    connect_timeout=connect_timeout_s, allow_reconnect=True,
                    max_reconnect_attempts=1, reconnect_time_wait=RECONNECT_WAIT_S,
                    ping_interval=PING_INTERVAL_S, max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                    error_cb=on_error, disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected, drain_timeout=DRAIN_TIMEOUT_S,
                ),
                timeout=2 * len(servers) * (connect_timeout_s + RECONNECT_WAIT_S) + 1.0,
            ))
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
            await _close_quietly(nc)
            seen = [exc, *first_errors]
            if any(isinstance(e, nats.errors.AuthorizationError)
                   or "authorization" in str(e).lower() for e in seen):
                who = (auth.who or user or urllib.parse.urlsplit(servers[0]).username
                       or "an anonymous client")
                hint = ("check --nats-user and --nats-password-file" if auth.user else
                        "check --nats-creds-file" if auth.creds_file else
                        "check the user and password in EXPRESSLANE_NATS_URL")
                raise BusAuthError(
                    f"nats-server at {redact_url(url)} refused the credentials of {who}: {hint}"
                ) from exc
            tls_failure = next((e for e in seen if isinstance(e, (ssl.SSLError, BusTlsError))), None)
            if tls_failure is not None:
                raise BusTlsError(
                    f"TLS with nats-server at {redact_url(url)} failed ({tls_failure}): check "
                    "--nats-tls-ca (the CA that signed the server's certificate) and the server's "
                    "TLS settings"
                ) from tls_failure
            dropped = client_verification_refused(seen, getattr(nc, "_server_info", None) or {}, auth.is_tls)
            if dropped is not None:
                what = ("check that --nats-tls-cert is signed by the CA the server trusts and matches "
                        "--nats-tls-key" if auth.tls_cert else
                        "give this service a client certificate signed by the CA the server trusts "
                        "(--nats-tls-cert, --nats-tls-key)")
                raise BusTlsError(
                    f"nats-server at {redact_url(url)} verifies client certificates and closed the "
                    f"connection after the TLS handshake ({dropped!r}): {what}"
                ) from dropped
            raise BusUnavailable(
                f"nats-server at {redact_url(url)} is not reachable: start it with "
                "`expresslane nats` or set EXPRESSLANE_NATS_URL"
            ) from (first_errors[-1] if first_errors else exc)
        nc.options["max_reconnect_attempts"] = -1
        bus = cls(nc, url, name)
        _log.info("bus_connected", url=redact_url(url), client=name)
        return bus

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    def add_reconnect_callback(self, fn: AsyncCallback) -> None:
        """Call ``await fn()`` after every reconnect (e.g. to republish state)."""
        self._reconnect_cbs.append(fn)

    def add_error_callback(self, fn: ErrorCallback) -> None:
        """Call ``await fn(exc)`` for every asynchronous error the server reports."""
        self._error_cbs.append(fn)

    async def _on_reconnected(self) -> None:
        _log.info("bus_reconnected", url=redact_url(self.url), client=self.name)
        for fn in list(self._reconnect_cbs):
            try:
                await fn()
            except Exception:
                _log.exception("bus_reconnect_callback_failed", client=self.name)

    async def _on_error(self, exc: Exception) -> None:
        _log.warning("bus_error", error=str(exc), client=self.name)
        for fn in list(self._error_cbs):
            try:
                await fn(exc)
            except Exception:
                _log.exception("bus_error_callback_failed", client=self.name)

    async def close(self) -> None:
        """Flush what is buffered and close the connection."""
        if self.nc.is_closed:
            return
        self._closing = True
        try:
            await self.nc.drain()
        except Exception:
            await _close_quietly(self.nc)

    # ------------------------------------------------------------------ messages

    async def publish(self, subject: str, event: events.Event, *, replay: bool = False) -> None:
        """Publish ``event`` as JSON on ``subject`` with the current trace context; ``replay``:
        the event is idempotent for its readers, send it again if the server may have lost it."""
        data, headers = events.encode(event), _trace_headers()
        if replay and self.nc.is_connected:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - REPLAY_WINDOW_S:
                self._recent.popleft()
            self._recent.append((now, subject, data, headers))
        try:
            await self.nc.publish(subject, data, headers=headers)
        except nats.errors.Error as exc:  # closed, or the reconnect buffer is full: callers handle BusError
            raise BusError(f"could not publish on {subject}: {exc!r}") from exc

    async def publish_stored(self, subject: str, event: events.Event, retry_s: float = 10.0) -> None:
        """Publish ``event`` to the JetStream stream that captures ``subject`` and return once the
        stream acknowledged it, retrying while the stream has no leader (a cluster member died,
        a new one is being elected); BusTimeout after ``retry_s``."""
        data, headers = events.encode(event), _trace_headers()
        deadline = time.monotonic() + retry_s
        while True:
            try:
                await self._js.publish(subject, data, timeout=2.0, headers=headers)
                return
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise BusTimeout(f"no stream stored {subject} within {retry_s:g} s") from exc
                await asyncio.sleep(0.1)

    async def _requeue_recent(self) -> None:
        """The connection dropped (nats-py calls this before it reconnects): what was published
        with ``replay=True`` in the last REPLAY_WINDOW_S may have died with the server (written to
        its socket, or not yet routed on). Queue it again at the head of nats-py's pending buffer,
        in its order, so it goes out first on the next server, ahead of what was published since
        (readers see old messages again, never a newer one before an older one)."""
        recent, self._recent = list(self._recent), collections.deque()
        cutoff = time.monotonic() - REPLAY_WINDOW_S
        nc = self.nc
        later, later_size = nc._pending, nc._pending_data_size  # nats-py has no API for this
        nc._pending, nc._pending_data_size = [], 0
        num_queued = 0
        try:
            for sent_at, subject, data, headers in recent:
                if sent_at >= cutoff:
                    await nc.publish(subject, data, headers=headers)
                    num_queued += 1
        except nats.errors.Error as exc:
            _log.warning("bus_replay_failed", error=repr(exc), client=self.name)
        finally:
            nc._pending += later
            nc._pending_data_size += later_size
        if num_queued:
            _log.info("bus_replay_queued", messages=num_queued, client=self.name)

    async def subscribe(
        self, subject: str, handler: Handler, kind: Any, queue: str = ""
    ) -> Subscription:
        """Call ``handler(event, msg)`` for every message on ``subject`` decoded as ``kind``."""
        decoder = events.decoder(kind)

        async def on_message(msg: Msg) -> None:
            try:
                event = decoder.decode(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.num_undecodable += 1
                _log.warning("bus_undecodable", subject=msg.subject, error=str(exc),
                             data=msg.data[:200].decode(errors="replace"))
                return
            token = otel_context.attach(extract_context(msg.headers))
            try:
                await handler(event, msg)
            except Exception:
                self.num_handler_errors += 1
                _log.exception("bus_handler_failed", subject=msg.subject,
                               event_type=type(event).__name__)
            finally:
                otel_context.detach(token)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_message)
        if self.nc.is_connected:  # return only once the server routes this subject to us
            try:
                await self.flush()
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                _log.warning("bus_subscribe_unconfirmed", subject=subject, error=repr(exc))
        return sub

    async def request(
        self, subject: str, event: events.Event, reply_kind: Any, timeout_s: float
    ) -> Any:
        """Send ``event`` and return the reply decoded as ``reply_kind``; BusTimeout if none."""
        try:
            msg = await self.nc.request(
                subject, events.encode(event), timeout=timeout_s, headers=_trace_headers()
            )
        except nats.errors.NoRespondersError as exc:
            raise BusNoResponders(f"no service listens on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise BusTimeout(f"no reply on {subject} within {timeout_s:g} s") from exc
        except nats.errors.Error as exc:  # the connection closed or its buffer is full: not sent
            raise BusError(f"could not request on {subject}: {exc!r}") from exc
        return events.decoder(reply_kind).decode(msg.data)

    async def respond(self, msg: Msg, event: events.Event) -> None:
        """Reply to the request ``msg`` with ``event``."""
        if not msg.reply:
            raise BusError(f"message on {msg.subject} expects no reply")
        await self.nc.publish(msg.reply, events.encode(event), headers=_trace_headers())

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has processed everything sent so far (subscriptions included)."""
        # nats-py writes its PING straight to the socket, ahead of commands still queued for its
        # flusher task, so its flush() alone can return before a queued SUB reached the server.
        await asyncio.wait_for(self.nc._flush_pending(force_flush=True), timeout_s)
        await self.nc.flush(timeout=timeout_s)

    # ------------------------------------------------------------------ JetStream

    async def kv(self, bucket: str, history: int = 1, replicas: int = 1, timeout_s: float = 60.0) -> KeyValue:
        """The JetStream key-value bucket ``bucket``, created (file storage, ``replicas`` copies
        on a cluster) if missing; an existing bucket keeps its own settings. A JetStream that does
        not answer yet (a cluster still electing the leaders a replicated bucket needs: its API
        request times out) is asked again until ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                return await self._kv_once(bucket, history, replicas)
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                _log.warning("bus_kv_retry", bucket=bucket, replicas=replicas, error=repr(exc), client=self.name)

    async def _kv_once(self, bucket: str, history: int, replicas: int) -> KeyValue:
        try:
            return await self._js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await self._js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=history, replicas=replicas)
                )
            except nats.js.errors.BadRequestError:
                return await self._js.key_value(bucket)  # created meanwhile (by another client, or our timed-out try)


def _only_over_tls(nc: nats.NATS, password: str) -> Callable[[], str]:
    """The password as nats-py's lazy value: refused when the server did not ask for TLS (a
    client configured for TLS never sends its password in the clear)."""

    def value() -> str:
        if not nc._server_info.get("tls_required"):
            raise BusTlsError("the server does not use TLS; the password was not sent")
        return password

    return value


async def _unless_set(event: asyncio.Event, awaitable) -> None:
    """Await ``awaitable``; cancel it and raise ``asyncio.TimeoutError`` once ``event`` is set.
    Cancelling the caller cancels ``awaitable`` too."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let it end; its CancelledError stays in the task
    if task.cancelled():
        raise asyncio.TimeoutError("the first connect cannot succeed")
    task.result()


def _trace_headers() -> dict[str, str] | None:
    return inject_headers({}) or None


async def _close_quietly(nc: nats.NATS) -> None:
    try:
        await nc.close()
    except Exception:
        pass
