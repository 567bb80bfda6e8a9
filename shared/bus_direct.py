"""A NATS connection a thread writes to directly: events out the moment the caller has them.

The bus client (shared.bus) runs on an asyncio loop; a thread without one hands its publishes over
to a loop thread (services.prefill.publisher). Inside vLLM's engine process that handover is slow
where it matters most: the loop thread must win the GIL from the scheduler and the KV sender
twice (to take the publish, then to flush it), and the express lane's first token waited ~2 ms on
a 2-core host between vLLM's scheduler finishing the prefill and the router seeing it
(bench/NOTES-e2e.md). Here the calling thread encodes the messages and writes them to its own
socket in one ``sendall``: ~0.5 ms scheduler -> router on the same host.

Contract:
    direct = DirectPublisher(url, name="prefill-first-token", auth=BusAuth(...))
    direct.publish([(subject, event, traceparent), ...])  # True: written, in order, in one send
                                                           # False: not connected or the write failed;
                                                           # the caller sends them another way
    direct.is_connected
    direct.num_connects, direct.num_pongs, direct.last_error   # what the connection thread saw
    direct.close()

- Connecting, reconnecting (every ``RETRY_S``, through the servers of a comma-separated URL),
  answering the server's PINGs and sending its own (a server that stops answering is dropped within
  ~``PING_INTERVAL_S * MAX_PINGS_OUT``) happen on a daemon thread; ``publish`` never connects and never
  waits longer than ``send_timeout_s`` (a full socket buffer: the server is not reading).
- Authentication as the bus's: user + password file (sent only over TLS when TLS is configured),
  TLS with the configured CA and client certificate, credentials in the URL. An nkey / JWT
  credentials file is not spoken here: ``is_connected`` stays False and callers keep their other
  path (logged once).
- Delivery as shared.bus's ``replay=True``: what was written in the last ``REPLAY_WINDOW_S`` is
  written again first on the next connection after one is lost (a message written just before
  the server died may have died with it), so readers see it at least once and must drop
  duplicates, as they do for the bus's replays (``num_replayed`` counts them).
"""

from __future__ import annotations

import collections
import json
import logging
import select
import socket
import ssl
import threading
import time
import urllib.parse

from opentelemetry import context as otel_context

from shared import events
from shared.bus import REPLAY_WINDOW_S, redact_url
from shared.bus_auth import BusAuth, read_secret
from shared.tracing import context_from_traceparent, inject_headers

log = logging.getLogger("expresslane.bus_direct")

RETRY_S = 1.0
HANDSHAKE_TIMEOUT_S = 2.0
# The client's own PINGs: a server gone without closing the socket (its host died, a partition) is noticed
# within ~PING_INTERVAL_S * MAX_PINGS_OUT, inside the replay window, instead of when TCP gives up (minutes)
PING_INTERVAL_S = 0.5
MAX_PINGS_OUT = 3
_CRLF = b"\r\n"


class HandshakeError(Exception):
    """The server refused the connection (authorization, TLS) or did not answer as NATS."""


def hpub(subject: str, payload: bytes, headers: dict[str, str] | None) -> bytes:
    """One NATS protocol ``HPUB`` (headers) or ``PUB`` command."""
    if not headers:
        return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload)
    hdr = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + _CRLF
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (subject.encode(), len(hdr), len(hdr) + len(payload), hdr, payload)


def connect_options(name: str, auth: BusAuth, url: urllib.parse.SplitResult) -> dict:
    """The CONNECT command's options: the bus's user and password, else credentials in ``url``."""
    options = {"verbose": False, "pedantic": False, "lang": "python3", "version": "expresslane",
               "protocol": 1, "name": name, "headers": True, "no_responders": True}
    if auth.user:
        options["user"], options["pass"] = auth.user, read_secret(auth.password_file)
    elif url.username is not None:
        if url.password is None:
            options["auth_token"] = urllib.parse.unquote(url.username)
        else:
            options["user"] = urllib.parse.unquote(url.username)
            options["pass"] = urllib.parse.unquote(url.password)
    return options


class DirectPublisher:
    """One socket to nats-server, written by the publishing thread (see the module docstring)."""

    def __init__(self, url: str, name: str = "expresslane-direct", auth: BusAuth | None = None,
                 send_timeout_s: float = 0.25) -> None:
        self._name = name
        self._auth = auth or BusAuth()
        self._send_timeout_s = send_timeout_s
        self._servers = [urllib.parse.urlsplit(s.strip() if "://" in s else f"nats://{s.strip()}")
                         for s in url.split(",") if s.strip()]
        self._lock = threading.Lock()  # one writer at a time: publishes and PONGs
        self._sock: socket.socket | None = None
        self._max_payload = 1 << 20
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_connects = 0  # handshakes completed
        self.num_replayed = 0  # messages written again after a reconnect
        self._recent: collections.deque[tuple[float, bytes]] = collections.deque()  # (sent at, bytes)
        self.num_pongs = 0  # server PINGs answered
        self._pings_out = 0  # our PINGs the server has not answered yet
        self.last_error = ""  # why the last connect failed or the last connection ended
        if self._auth.creds_file:
            self.last_error = "nkey/JWT credentials are not spoken here"
            log.info("expresslane: the bus logs in with an nkey/JWT credentials file; %s keeps "
                     "the loop thread's path", name)
            return
        self._thread = threading.Thread(target=self._run, name=f"{name}-conn", daemon=True)
        self._thread.start()

    @property
    def is_connected(self) -> bool:
        return self._sock is not None

    def publish(self, messages: list[tuple[str, events.Event, str]]) -> bool:
        """Write ``(subject, event, traceparent)`` messages in order in one send; False (nothing
        or, on a broken connection, maybe part of it written) when the caller must send them
        another way."""
        sock = self._sock
        if sock is None:
            return False
        out = []
        for subject, event, traceparent in messages:
            data = events.encode(event)
            if len(data) > self._max_payload:
                return False  # the loop client reports the server's limit
            out.append(hpub(subject, data, _headers(traceparent)))
        data = b"".join(out)
        with self._lock:
            if sock is not self._sock:
                return False
            try:
                sock.sendall(data)
            except OSError as exc:
                self._drop(sock, f"write failed: {exc}")
                return False
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - REPLAY_WINDOW_S:
                self._recent.popleft()
            self._recent.append((now, data))
            return True

    def close(self) -> None:
        self._stopping.set()
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            _close_quietly(sock)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------ connection thread

    def _run(self) -> None:
        num_failures = 0
        while not self._stopping.is_set():
            server = self._servers[num_failures % len(self._servers)]
            try:
                sock, after = self._connect(server)
            except (OSError, HandshakeError, ValueError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                if num_failures % 30 == 0:  # once, then about every 30 s
                    log.warning("expresslane: %s: no connection to NATS at %s yet (%s); retrying",
                                self._name, redact_url(server.geturl()), exc)
                num_failures += 1
                self._stopping.wait(RETRY_S)
                continue
            num_failures = 0
            with self._lock:
                try:  # what may have died with the last connection, ahead of anything newer
                    recent = [data for at, data in self._recent if at >= time.monotonic() - REPLAY_WINDOW_S]
                    if recent:
                        sock.sendall(b"".join(recent))
                        self.num_replayed += len(recent)
                except OSError as exc:
                    _close_quietly(sock)
                    self.last_error = f"write failed: {exc}"
                    continue
                self._sock = sock
                self.num_connects += 1
            self._serve(sock, after)
            if not self._stopping.is_set():
                self._stopping.wait(RETRY_S / 10)

    def _connect(self, server: urllib.parse.SplitResult) -> tuple[socket.socket, bytes]:
        """A socket past the handshake, and what the server sent after its PONG."""
        raw = socket.create_connection((server.hostname or "127.0.0.1", server.port or 4222),
                                       timeout=HANDSHAKE_TIMEOUT_S)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = _Lines(raw)
            op, arg = reader.command()
            if op != b"INFO":
                raise HandshakeError(f"the server greeted with {op!r}, not INFO")
            info = json.loads(arg)
            sock: socket.socket = raw
            if info.get("tls_required") or self._auth.is_tls:
                if not self._auth.is_tls:
                    raise HandshakeError("the server requires TLS: configure the bus's TLS files")
                if not info.get("tls_required"):
                    raise HandshakeError("the server does not use TLS; the credentials were not sent")
                sock = self._auth.ssl_context().wrap_socket(raw, server_hostname=server.hostname)
                reader = _Lines(sock)
            self._max_payload = int(info.get("max_payload", self._max_payload))
            options = connect_options(self._name, self._auth, server)
            sock.sendall(b"CONNECT " + json.dumps(options).encode() + _CRLF + b"PING\r\n")
            while True:  # PONG: the server took CONNECT (a refusal is -ERR, then a close)
                op, arg = reader.command()
                if op == b"PONG":
                    break
                if op == b"-ERR":
                    raise HandshakeError(arg.decode(errors="replace"))
            sock.settimeout(self._send_timeout_s)
            return sock, reader.buffered
        except BaseException:
            _close_quietly(raw)
            raise

    def _serve(self, sock: socket.socket, buf: bytes) -> None:
        """Answer PINGs until the connection ends (the server closed it, or a write failed); ``buf``:
        what the server sent after the handshake's PONG. Sends a PING every PING_INTERVAL_S and drops the
        connection when MAX_PINGS_OUT of them go unanswered."""
        self._pings_out, last_ping = 0, time.monotonic()
        while not self._stopping.is_set() and sock is self._sock:
            try:
                if time.monotonic() - last_ping >= PING_INTERVAL_S:
                    with self._lock:
                        if sock is not self._sock:
                            return
                        if self._pings_out >= MAX_PINGS_OUT:
                            self._drop(sock, f"no PONG to {self._pings_out} PINGs in "
                                             f"{self._pings_out * PING_INTERVAL_S:g} s")
                            return
                        sock.sendall(b"PING\r\n")
                        self._pings_out += 1
                    last_ping = time.monotonic()
                if _CRLF in buf:  # lines that came with the handshake's PONG
                    with self._lock:
                        buf = self._answer(sock, buf)
                    continue
                ready = select.select([sock], [], [], 0.25)[0] or (isinstance(sock, ssl.SSLSocket) and sock.pending())
                if not ready:
                    continue
                with self._lock:
                    if sock is not self._sock:
                        return
                    try:
                        data = sock.recv(65536)
                    except (TimeoutError, ssl.SSLWantReadError):
                        continue
                    if not data:
                        self._drop(sock, "the server closed the connection")
                        return
                    buf = self._answer(sock, buf + data)
            except (OSError, ValueError) as exc:
                with self._lock:
                    self._drop(sock, str(exc))
                return

    def _answer(self, sock: socket.socket, buf: bytes) -> bytes:
        """Handle the whole protocol lines in ``buf`` (PING: PONG; -ERR: logged); the rest. With the lock."""
        while _CRLF in buf:
            line, buf = buf.split(_CRLF, 1)
            if line == b"PING":
                sock.sendall(b"PONG\r\n")
                self.num_pongs += 1
            elif line == b"PONG":  # an answer to our own PINGs: the server is alive
                self._pings_out = 0
            elif line.startswith(b"-ERR"):
                log.warning("expresslane: %s: NATS says %s", self._name, line.decode(errors="replace"))
        return buf

    def _drop(self, sock: socket.socket, why: str) -> None:
        """Forget a broken connection (the connection thread makes a new one); called with the lock."""
        if self._sock is sock:
            self._sock = None
            self.last_error = why
            if not self._stopping.is_set():
                log.warning("expresslane: %s: connection to NATS lost (%s); reconnecting", self._name, why)
        _close_quietly(sock)


class _Lines:
    """Protocol lines read from a blocking socket during the handshake."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.buffered = sock, b""

    def command(self) -> tuple[bytes, bytes]:
        while _CRLF not in self.buffered:
            data = self._sock.recv(65536)
            if not data:
                raise HandshakeError("the server closed the connection")
            self.buffered += data
            if len(self.buffered) > 1 << 20:
                raise HandshakeError("no protocol line in the first MiB")
        line, self.buffered = self.buffered.split(_CRLF, 1)
        op, _, arg = line.partition(b" ")
        return op.upper(), arg


def _headers(traceparent: str) -> dict[str, str] | None:
    """The trace headers the bus sends, for ``traceparent`` as the current context."""
    if not traceparent:
        return None
    token = otel_context.attach(context_from_traceparent(traceparent))
    try:
        return inject_headers({}) or None
    finally:
        otel_context.detach(token)


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def wait_connected(direct: DirectPublisher, timeout_s: float) -> bool:
    """Poll ``is_connected`` until True or ``timeout_s`` (for callers and tests that need it up)."""
    deadline = time.monotonic() + timeout_s
    while not direct.is_connected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
