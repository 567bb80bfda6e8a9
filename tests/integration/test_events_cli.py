"""`expresslane events` as an operator runs it: a subprocess against the real nats-server."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid

import pytest

from shared import events as ev
from shared import subjects
from shared.bus import Bus
from infra.events import format_line
from shared.tracing import build_tracer_provider

WAIT_S = 20.0


async def start_cli(*args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra.cli", "events", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    return proc


async def wait_watching(proc: asyncio.subprocess.Process) -> str:
    line = await asyncio.wait_for(proc.stderr.readline(), WAIT_S)
    assert line.startswith(b"watching "), line
    return line.decode()


@pytest.fixture
async def bus(nats_url):
    client = await Bus.connect(nats_url, name="test-events-cli")
    yield client
    await client.close()


@pytest.fixture
async def procs():
    started: list[asyncio.subprocess.Process] = []
    yield started
    for proc in started:  # also on failure: nothing keeps running
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_prints_published_event_and_stops_on_ctrl_c(nats_url, bus, procs):
    request_id = uuid.uuid4().hex[:8]
    proc = await start_cli("--nats-url", nats_url, "--subject", subjects.req_tokens(request_id))
    procs.append(proc)
    assert f"watching xl.req.{request_id}.tokens on {nats_url}" in await wait_watching(proc)

    tracer = build_tracer_provider("test", env={}).get_tracer("test")
    with tracer.start_as_current_span("decode.step") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        await bus.publish(subjects.req_tokens(request_id),
                          ev.TokensGenerated(request_id=request_id, index=3, token_ids=[11, 12]))
    line = (await asyncio.wait_for(proc.stdout.readline(), WAIT_S)).decode()
    assert f"  xl.req.{request_id}.tokens  tokens  request_id={request_id} index=3 " \
           f"token_ids=[11,12]  trace_id={trace_id}\n" in line

    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
    assert b"Traceback" not in await proc.stderr.read()


async def test_json_output_and_count(nats_url, bus, procs):
    request_id = uuid.uuid4().hex[:8]
    proc = await start_cli("--nats-url", nats_url, "--json", "--count", "2",
                           "--subject", f"xl.req.{request_id}.>")
    procs.append(proc)
    await wait_watching(proc)
    cancel = ev.CancelRequest(request_id=request_id)
    await bus.publish(subjects.req_cancel(request_id), cancel)
    await bus.nc.publish(subjects.req_tokens(request_id), b"not json")
    out, _ = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 0  # exited by itself after --count messages
    first, second = [json.loads(line) for line in out.decode().splitlines()]
    assert first["subject"] == f"xl.req.{request_id}.cancel" and first["traceparent"] == ""
    assert first["event"] == {"type": "cancel", "request_id": request_id,
                              "reason": "client_disconnected", "is_before_prefill": False}
    assert second["event"] == "not json"


async def test_count_not_reached_within_timeout_exits_1(nats_url, procs):
    proc = await start_cli("--nats-url", nats_url, "--subject", "xl.node.nobody.avail",
                           "--count", "1", "--timeout-s", "0.3")
    procs.append(proc)
    _, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 1
    assert "saw 0 of 1 messages on xl.node.nobody.avail within 0.3 s" in err.decode()


async def test_unreachable_server(make_nats_server, procs):
    server = make_nats_server()
    url = server.url
    server.stop()
    proc = await start_cli("--nats-url", url)
    procs.append(proc)
    _, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 1
    assert f"nats-server at {url} is not reachable: start it with `expresslane nats`" in err.decode()


@pytest.mark.parametrize(
    "data, expected",
    [
        (ev.encode(ev.HandoffEvent(request_id="r1", state="decoding", at_ms=1, reason="a b")),
         "00:00:01.500  xl.handoff.r1.decoding  handoff  request_id=r1 state=decoding at_ms=1 "
         "lease_id='' generation=0 node_id='' slot=-1 reason='a b'"),
        (b'{"type":"cancel"}',
         "00:00:01.500  xl.handoff.r1.decoding  ?  {\"type\":\"cancel\"}  (not an expresslane "
         "event: Object missing required field `request_id`)"),
    ],
)
def test_format_line(data, expected):
    assert format_line("xl.handoff.r1.decoding", data, None, 1.5) == expected
