"""The bus client against a real nats-server (JetStream): typed pub/sub, request/reply with
timeouts, KV with revisions, trace context across the hop, reconnect after a server restart."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid

import nats.js.errors
import pytest

from shared import events as ev
from shared import subjects
from shared.bus import Bus, BusNoResponders, BusTimeout, BusUnavailable
from shared.tracing import build_tracer_provider, current_trace_id_hex

WAIT_S = 5.0


@pytest.fixture
async def bus(nats_url):
    client = await Bus.connect(nats_url, name="test-bus")
    yield client
    await client.close()
    assert client.nc.is_closed


@pytest.fixture
async def peer(nats_url):
    client = await Bus.connect(nats_url, name="test-peer")
    yield client
    await client.close()
    assert client.nc.is_closed


def rid() -> str:
    return uuid.uuid4().hex[:12]


async def collect(bus: Bus, subject: str, kind) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def handler(event, msg):
        await queue.put((event, msg, current_trace_id_hex()))

    await bus.subscribe(subject, handler, kind)
    await bus.flush()
    return queue


def test_session_server_has_jetstream(nats_server, nats_url):
    assert nats_url == nats_server.url and nats_url.startswith("nats://127.0.0.1:")
    with urllib.request.urlopen(f"{nats_server.monitor_url}/healthz?js-enabled-only=true") as resp:
        assert resp.status == 200


async def test_publish_subscribe_typed(bus, peer):
    request_id = rid()
    inbox = await collect(peer, subjects.req_tokens(request_id), ev.TokenMessage)
    await bus.publish(subjects.req_tokens(request_id),
                      ev.TokensGenerated(request_id=request_id, index=1, token_ids=[5, 6]))
    await bus.publish(subjects.req_tokens(request_id), ev.RequestFinished(
        request_id=request_id, finish_reason="length", usage=ev.Usage(prompt_tokens=3, completion_tokens=3)))
    first, msg, _ = await asyncio.wait_for(inbox.get(), WAIT_S)
    second, _, _ = await asyncio.wait_for(inbox.get(), WAIT_S)
    assert first == ev.TokensGenerated(request_id=request_id, index=1, token_ids=[5, 6])
    assert msg.subject == f"xl.req.{request_id}.tokens"
    assert isinstance(second, ev.RequestFinished) and second.usage.completion_tokens == 3


async def test_subscribe_returns_once_the_server_routes_the_subject(nats_url):
    """A publish right after subscribe() returns is delivered (nats-py's own flush is no barrier:
    its PING can overtake a queued SUB)."""
    for _ in range(20):
        subscriber = await Bus.connect(nats_url, name="barrier-sub")
        publisher = await Bus.connect(nats_url, name="barrier-pub")
        request_id = rid()
        inbox: asyncio.Queue = asyncio.Queue()

        async def handler(event, msg):
            await inbox.put(event)

        await subscriber.subscribe(subjects.req_cancel(request_id), handler, ev.CancelRequest)
        await publisher.publish(subjects.req_cancel(request_id), ev.CancelRequest(request_id=request_id))
        assert await asyncio.wait_for(inbox.get(), WAIT_S) == ev.CancelRequest(request_id=request_id)
        await subscriber.close()
        await publisher.close()


async def test_undecodable_message_is_counted_and_subscription_lives_on(bus, peer):
    request_id = rid()
    inbox = await collect(peer, subjects.req_cancel(request_id), ev.CancelRequest)
    await bus.nc.publish(subjects.req_cancel(request_id), b'{"type": "cancel"}')  # no request_id
    await bus.nc.publish(subjects.req_cancel(request_id), b"not json")
    await bus.publish(subjects.req_cancel(request_id), ev.CancelRequest(request_id=request_id))
    event, _, _ = await asyncio.wait_for(inbox.get(), WAIT_S)
    assert event == ev.CancelRequest(request_id=request_id)
    assert peer.num_undecodable == 2 and inbox.empty()


async def test_request_reply_and_timeouts(bus, peer):
    subject = f"{subjects.CLAIM}.{rid()}"

    async def coordinator(event: ev.ClaimRequest, msg):
        await peer.respond(msg, ev.ClaimRejected(request_id=event.request_id, reason="no_free_slot",
                                                  retry_after_ms=50))

    await peer.subscribe(subject, coordinator, ev.ClaimRequest)
    await peer.flush()
    claim = ev.ClaimRequest(request_id="r1", model="m", num_prompt_tokens=4, max_tokens=8)
    reply = await bus.request(subject, claim, ev.ClaimReply, timeout_s=WAIT_S)
    assert reply == ev.ClaimRejected(request_id="r1", reason="no_free_slot", retry_after_ms=50)

    silent = f"{subjects.CLAIM}.{rid()}"

    async def never_answers(event, msg):
        return None

    await peer.subscribe(silent, never_answers, ev.ClaimRequest)
    await peer.flush()
    with pytest.raises(BusTimeout, match=rf"no reply on {silent} within 0.2 s"):
        await bus.request(silent, claim, ev.ClaimReply, timeout_s=0.2)
    with pytest.raises(BusNoResponders, match="no service listens on xl.coord.claim.nobody"):
        await bus.request(f"{subjects.CLAIM}.nobody", claim, ev.ClaimReply, timeout_s=WAIT_S)


async def test_kv_put_get_update_with_revision(bus, peer):
    bucket = f"xl_test_{rid()}"
    kv = await bus.kv(bucket)
    rev1 = await kv.put("lease.a", b'{"generation": 1}')
    entry = await kv.get("lease.a")
    assert (entry.value, entry.revision) == (b'{"generation": 1}', rev1)
    rev2 = await kv.update("lease.a", b'{"generation": 2}', last=rev1)
    assert rev2 > rev1
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await kv.update("lease.a", b'{"generation": 3}', last=rev1)  # a stale writer loses
    same = await peer.kv(bucket)  # opens the existing bucket, sees the same state
    assert (await same.get("lease.a")).value == b'{"generation": 2}'
    await bus.nc.jetstream().delete_key_value(bucket)  # tidy up through the client the bus wraps


async def test_traceparent_crosses_the_hop(bus, peer):
    tracer = build_tracer_provider("test", env={}).get_tracer("test")
    request_id = rid()
    inbox = await collect(peer, subjects.req_cancel(request_id), ev.CancelRequest)
    with tracer.start_as_current_span("router.cancel") as span:
        sent_trace_id = format(span.get_span_context().trace_id, "032x")
        sent_span_id = format(span.get_span_context().span_id, "016x")
        await bus.publish(subjects.req_cancel(request_id), ev.CancelRequest(request_id=request_id))
    event, msg, seen_trace_id = await asyncio.wait_for(inbox.get(), WAIT_S)
    assert msg.headers["traceparent"].startswith(f"00-{sent_trace_id}-{sent_span_id}-")
    assert seen_trace_id == sent_trace_id  # the handler ran inside the sender's trace
    assert current_trace_id_hex() == ""  # and the context did not leak out of the handler


async def test_no_span_no_headers(bus, peer):
    request_id = rid()
    inbox = await collect(peer, subjects.req_cancel(request_id), ev.CancelRequest)
    await bus.publish(subjects.req_cancel(request_id), ev.CancelRequest(request_id=request_id))
    _, msg, seen_trace_id = await asyncio.wait_for(inbox.get(), WAIT_S)
    assert not msg.headers and seen_trace_id == ""


async def test_unreachable_server_says_what_to_do(make_nats_server):
    server = make_nats_server()
    url = server.url
    server.stop()
    with pytest.raises(BusUnavailable) as info:
        await Bus.connect(url, connect_timeout_s=0.5)
    assert str(info.value) == (
        f"nats-server at {url} is not reachable: start it with `expresslane nats` "
        "or set EXPRESSLANE_NATS_URL"
    )


async def test_password_is_not_shown_in_errors(make_nats_server):
    server = make_nats_server()
    url = server.url.replace("nats://", "nats://router:s3cret@")
    server.stop()
    with pytest.raises(BusUnavailable) as info:
        await Bus.connect(url, connect_timeout_s=0.5)
    assert "s3cret" not in str(info.value) and "router:***@" in str(info.value)


async def test_reconnects_after_server_restart(make_nats_server):
    server = make_nats_server()
    subscriber = await Bus.connect(server.url, name="sub")
    publisher = await Bus.connect(server.url, name="pub")
    try:
        reconnected = asyncio.Event()

        async def on_reconnect():
            reconnected.set()

        subscriber.add_reconnect_callback(on_reconnect)
        request_id = rid()
        inbox = await collect(subscriber, subjects.req_tokens(request_id), ev.TokenMessage)
        kv = await publisher.kv("xl_restart")
        revision = await kv.put("lease.a", b"granted")
        server.restart()  # same port; a new process knows nothing of earlier subscriptions
        await asyncio.wait_for(reconnected.wait(), WAIT_S)
        for _ in range(100):  # the publisher reconnects on its own schedule
            if publisher.is_connected:
                break
            await asyncio.sleep(0.05)
        await publisher.publish(subjects.req_tokens(request_id),
                                ev.TokensGenerated(request_id=request_id, index=0, token_ids=[7]))
        event, _, _ = await asyncio.wait_for(inbox.get(), WAIT_S)
        assert event == ev.TokensGenerated(request_id=request_id, index=0, token_ids=[7])
        entry = await kv.get("lease.a")  # JetStream state survived the restart
        assert (entry.value, entry.revision) == (b"granted", revision)
    finally:
        await subscriber.close()
        await publisher.close()
    assert subscriber.nc.is_closed and publisher.nc.is_closed


def test_private_server_restarts_on_same_port(make_nats_server):
    server = make_nats_server()
    url = server.url
    server.restart()
    assert server.url == url and server.is_running
    server.stop()
    assert not server.is_running


RESPONDER = """
import asyncio, sys
import structlog
from shared import events as ev
from shared.bus import Bus
from shared.log import get_logger, setup_logging
from shared.tracing import setup_tracing, shutdown_tracing

async def main(url, subject):
    setup_logging("coordinator")
    tracer = setup_tracing("coordinator")
    log = get_logger("responder")
    bus = await Bus.connect(url, name="responder")
    done = asyncio.Event()

    async def handle(event, msg):
        structlog.contextvars.bind_contextvars(request_id=event.request_id)
        with tracer.start_as_current_span("coordinator.claim", attributes={"xl.request_id": event.request_id}):
            log.info("claim_rejected", reason="test")
            await bus.respond(msg, ev.ClaimRejected(request_id=event.request_id, reason="test"))
        done.set()

    await bus.subscribe(subject, handle, ev.ClaimRequest)
    await bus.flush()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 30)
    await bus.close()
    shutdown_tracing()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_spans_and_logs_follow_the_request_across_processes(nats_url, otlp_receiver, bus):
    """Router span -> NATS request -> coordinator span in another process: both reach the OTLP
    receiver in one trace with the right parent, and the coordinator's log line carries them."""
    import json
    import os
    import sys

    subject = f"{subjects.CLAIM}.{rid()}"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.url,
           "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": ""}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RESPONDER, nats_url, subject, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    provider = build_tracer_provider("router", env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.url})
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
        with provider.get_tracer("test").start_as_current_span("router.claim") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            claim = ev.ClaimRequest(request_id="req-7", model="m", num_prompt_tokens=1, max_tokens=1)
            reply = await bus.request(subject, claim, ev.ClaimReply, timeout_s=WAIT_S)
        assert reply == ev.ClaimRejected(request_id="req-7", reason="test")
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        provider.shutdown()  # flushes the router span

    spans = otlp_receiver.wait_for(
        lambda got: sum(s.trace_id == trace_id for s in got) == 2, timeout_s=10)
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    router, coordinator = by_name["router.claim"], by_name["coordinator.claim"]
    assert (router.service_name, coordinator.service_name) == ("router", "coordinator")
    assert router.parent_span_id == "" and coordinator.parent_span_id == router.span_id
    assert coordinator.attributes == {"xl.request_id": "req-7"}

    lines = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    [logged] = [line for line in lines if line["event"] == "claim_rejected"]
    assert logged["service"] == "coordinator" and logged["request_id"] == "req-7"
    assert (logged["trace_id"], logged["span_id"]) == (trace_id, coordinator.span_id)
    assert logged["level"] == "info" and logged["reason"] == "test" and "timestamp" in logged


# ---------------------------------------------------------------------- the launcher


def monitor_is_up(monitor_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{monitor_url}/healthz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


async def wait_down(monitor_url: str) -> bool:
    for _ in range(100):
        if not monitor_is_up(monitor_url):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_expresslane_nats_serves_until_ctrl_c(tmp_path):
    import re
    import signal
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra.cli", "nats", "--nats-port", "0", "--nats-monitor-port", "0",
        "--nats-store-dir", str(tmp_path / "store"), "--log-format", "console",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        found = re.match(r"nats-server ready at (nats://127\.0\.0\.1:\d+) "
                         r"\(monitoring (http://127\.0\.0\.1:\d+)\); Ctrl-C stops it", line)
        assert found, line
        url, monitor_url = found.groups()
        client = await Bus.connect(url, name="cli-check")
        kv = await client.kv("xl_cli_check")  # JetStream is on, under the store dir
        await kv.put("k", b"v")
        await client.close()
        assert (tmp_path / "store" / "jetstream").is_dir()
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert await wait_down(monitor_url)  # the server went with it
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


STARTER = """
import sys, time
from infra.nats import NatsServer
server = NatsServer(sys.argv[1], stop_with_parent=True).start()
print(server.monitor_url, flush=True)
time.sleep(60)
"""


async def test_server_dies_with_a_killed_parent(tmp_path):
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STARTER, str(tmp_path), stdout=asyncio.subprocess.PIPE)
    try:
        monitor_url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        assert monitor_is_up(monitor_url)
    finally:
        proc.kill()  # SIGKILL: no atexit, no cleanup in the parent
        await proc.wait()
    assert await wait_down(monitor_url)
