"""shared.bus_direct on a real nats-server: messages written in order with the bus's trace headers,
the server's PINGs answered (the connection outlives missed-ping limits), a restart survived, and
the cases where it must not connect (nothing listening, TLS configured against a plaintext server)
leave the caller its other path. Against a stand-in server that dies right after a write: what
was written is written again, first, on the next connection."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from shared import subjects
from shared.bus import Bus
from shared.bus_auth import BusAuth
from shared.bus_direct import DirectPublisher, hpub, wait_connected
from shared.events import DecodeStart, PrefillToken, SamplingParams, TokenMessage
from shared.tracing import context_from_traceparent

WAIT_S = 10.0
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _messages(request_id: str) -> list:
    return [(subjects.req_tokens(request_id), PrefillToken(request_id=request_id, token_id=7, finish_reason="length",
                                                           prompt_token_ids=[1, 2, 3]), TRACEPARENT),
            (subjects.decode_start("n0"), DecodeStart(request_id=request_id, lease_id="L1", generation=1, slot=0,
                                                      first_token_id=7, num_prompt_tokens=3,
                                                      sampling=SamplingParams(max_tokens=4)), "")]


async def _wait_for(predicate, what: str) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(poll(), WAIT_S)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("headers,want", [
    (None, b"PUB a.b 2\r\nhi\r\n"),
    ({"traceparent": "x"}, b"HPUB a.b 28 30\r\nNATS/1.0\r\ntraceparent: x\r\n\r\nhi\r\n"),
])
def test_protocol_commands(headers, want):
    assert hpub("a.b", b"hi", headers) == want


async def test_messages_arrive_in_order_with_the_trace(nats_url):
    bus = await Bus.connect(nats_url, name="reader")
    got: list = []
    await bus.subscribe(subjects.req_tokens("r-direct"), lambda e, m: _record(got, e, m), TokenMessage)
    await bus.subscribe(subjects.decode_start("n0"), lambda e, m: _record(got, e, m), DecodeStart)
    await bus.flush()
    direct = DirectPublisher(nats_url, name="test-direct")
    try:
        assert await asyncio.to_thread(wait_connected, direct, WAIT_S)
        assert direct.publish(_messages("r-direct"))
        await _wait_for(lambda: len(got) == 2, "both messages")
        (first, first_headers), (second, second_headers) = got
        assert isinstance(first, PrefillToken) and first.token_id == 7 and first.prompt_token_ids == [1, 2, 3]
        assert isinstance(second, DecodeStart) and second.lease_id == "L1"
        assert TRACEPARENT.split("-")[1] in first_headers.get("traceparent", "")
        assert not second_headers or "traceparent" not in second_headers
    finally:
        direct.close()
        await bus.close()
    assert not direct.is_connected and not direct.publish(_messages("r-after-close"))


async def _record(got: list, event, msg) -> None:
    got.append((event, msg.headers or {}))


def test_nothing_listening_leaves_the_caller_its_other_path():
    direct = DirectPublisher("nats://127.0.0.1:9", name="test-direct")  # port 9: discard, nothing listens
    try:
        assert not wait_connected(direct, 0.0)
        assert direct.publish(_messages("r-none")) is False
    finally:
        direct.close()


def test_tls_configured_never_talks_to_a_plaintext_server(nats_url, tmp_path):
    direct = DirectPublisher(nats_url, name="test-direct", auth=BusAuth(tls_ca=str(tmp_path / "ca.pem")))
    try:
        asyncio.run(_wait_for(lambda: "does not use TLS" in direct.last_error, "the TLS refusal"))
        assert not direct.is_connected and direct.num_connects == 0
    finally:
        direct.close()


def test_credentials_files_keep_the_loop_threads_path(nats_url, tmp_path):
    creds = tmp_path / "user.creds"
    creds.write_text("SUAxxx\n")
    direct = DirectPublisher(nats_url, name="test-direct", auth=BusAuth(creds_file=str(creds)))
    try:
        assert not direct.is_connected and direct.publish(_messages("r-creds")) is False
        assert "not spoken here" in direct.last_error
    finally:
        direct.close()


async def test_pings_are_answered_and_a_restart_is_survived(make_nats_server, tmp_path):
    conf = tmp_path / "fast-pings.conf"
    conf.write_text('ping_interval: "50ms"\nping_max: 2\n')
    server = make_nats_server(config_file=conf)
    direct = DirectPublisher(server.url, name="test-direct")
    try:
        assert await asyncio.to_thread(wait_connected, direct, WAIT_S)
        # without PONGs the server closes the connection after ping_max missed PINGs
        await _wait_for(lambda: direct.num_pongs >= 5, "five PINGs answered")
        assert direct.num_connects == 1 and direct.is_connected
        await asyncio.to_thread(server.restart)
        await _wait_for(lambda: direct.num_connects == 2 and direct.is_connected, "a reconnect")
        bus = await Bus.connect(server.url, name="reader")
        got: list = []
        await bus.subscribe(subjects.req_tokens("r-restart"), lambda e, m: _record(got, e, m), TokenMessage)
        await bus.flush()
        try:
            assert direct.publish(_messages("r-restart"))
            await _wait_for(lambda: len(got) == 1, "the message after the restart")
            assert got[0][0].request_id == "r-restart"
        finally:
            await bus.close()
    finally:
        direct.close()


def test_the_trace_header_is_the_traceparent_given():
    from shared.bus_direct import _headers
    headers = _headers(TRACEPARENT)
    assert headers is not None and headers["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]
    assert context_from_traceparent(headers["traceparent"]) is not None
    assert _headers("") is None


class DroppingServer:
    """A NATS server stand-in whose first connection takes the client's messages and dies without
    routing them (as a server that crashes right after a write); later connections record what the
    client writes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[bytes] = []  # per connection after the handshake
        self.first_got_data = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        index = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b'INFO {"server_id":"fake","max_payload":1048576,"headers":true}\r\n')
                buf = b""
                while b"PING\r\n" not in buf:
                    buf += conn.recv(65536)
                conn.sendall(b"PONG\r\n")
                buf = buf.split(b"PING\r\n", 1)[1]
                if index == 0:
                    while not buf:
                        buf += conn.recv(65536)
                    self.received.append(buf)
                    self.first_got_data.set()
                else:
                    conn.settimeout(0.5)
                    try:
                        while len(buf) < 64 or b"decode" not in buf:
                            data = conn.recv(65536)
                            if not data:
                                break
                            buf += data
                    except OSError:
                        pass
                    self.received.append(buf)
                    return
            index += 1

    def close(self) -> None:
        self.sock.close()


def test_messages_written_before_the_connection_died_are_written_again_after_the_reconnect():
    server = DroppingServer()
    direct = DirectPublisher(server.url, name="test-replay")
    try:
        assert wait_connected(direct, WAIT_S)
        assert direct.publish(_messages("r-lost"))
        assert server.first_got_data.wait(WAIT_S)  # the server had the bytes, then died
        deadline = time.monotonic() + WAIT_S
        while len(server.received) < 2:
            assert time.monotonic() < deadline, "no reconnect"
            time.sleep(0.01)
        replayed = server.received[1]
        assert replayed.index(subjects.req_tokens("r-lost").encode()) < replayed.index(subjects.decode_start("n0").encode())
        # the connection thread counts the replay and the connect after its write returned: the server can
        # hold the bytes first
        while not (direct.num_replayed == 1 and direct.num_connects == 2):
            assert time.monotonic() < deadline, (direct.num_replayed, direct.num_connects)
            time.sleep(0.01)
    finally:
        direct.close()
        server.close()


class SilentServer:
    """A NATS server stand-in that completes the handshake and then never answers again, with the socket left
    open (as a server whose host died or was cut off): what a dead connection looks like to the client."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.sendall(b'INFO {"server_id":"silent","max_payload":1048576,"headers":true}\r\n')
            buf = b""
            while b"PING\r\n" not in buf:
                buf += conn.recv(65536)
            conn.sendall(b"PONG\r\n")  # the handshake's answer, then nothing

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_server_that_stops_answering_is_dropped_and_the_client_reconnects():
    server = SilentServer()
    direct = DirectPublisher(server.url, name="test-silent")
    try:
        assert wait_connected(direct, WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while direct.num_connects < 2:  # its PINGs went unanswered: dropped, then a new connection
            assert time.monotonic() < deadline, (direct.num_connects, direct.last_error)
            time.sleep(0.01)
        assert direct.last_error == "no PONG to 3 PINGs in 1.5 s"
    finally:
        direct.close()
        server.close()
