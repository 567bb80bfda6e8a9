"""The router's upstream transport (httpx's API over aiohttp) against a real local HTTP server: bodies, headers,
streams, status codes, timeouts and refusals as httpx's own transport gives them, and an answer closed early
closing its connection (how vLLM learns that a client went)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from aiohttp import web

from services.router.transport import AiohttpTransport


class Upstream:
    """A local server: /echo answers the request's body and headers, /sse streams ``n`` events one per
    ``release``, /slow answers after ``delay``, /err answers 400."""

    def __init__(self):
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.sent = 0

    async def echo(self, request: web.Request) -> web.Response:
        return web.json_response({"body": await request.json(), "header": request.headers.get("x-request-id"),
                                  "length": request.headers.get("content-length")}, headers={"x-up": "1"})

    async def sse(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query["n"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                self.sent = i + 1
                if i + 1 < n:
                    await self.release.wait()
                    self.release.clear()
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query["delay"]))
        return web.json_response({})

    async def err(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "too long"}}, status=400)


@pytest.fixture
async def upstream():
    up = Upstream()
    app = web.Application()
    app.router.add_post("/echo", up.echo)
    app.router.add_post("/sse", up.sse)
    app.router.add_get("/slow", up.slow)
    app.router.add_post("/err", up.err)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = httpx.AsyncClient(transport=AiohttpTransport())
    yield up, client, f"http://127.0.0.1:{port}"
    await client.aclose()
    await runner.cleanup()


async def test_a_json_request_and_its_answer_arrive_whole(upstream):
    _, client, url = upstream
    r = await client.post(f"{url}/echo", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "r1"})
    assert r.status_code == 200 and r.headers["x-up"] == "1"
    body = r.json()
    assert body["body"] == {"prompt": "hi", "max_tokens": 1} and body["header"] == "r1"
    assert int(body["length"]) == len(json.dumps({"prompt": "hi", "max_tokens": 1}, separators=(",", ":")))


async def test_an_error_status_passes_through_with_its_body(upstream):
    _, client, url = upstream
    r = await client.post(f"{url}/err", json={})
    assert r.status_code == 400 and r.json() == {"error": {"message": "too long"}}


async def test_a_stream_yields_each_event_as_it_is_sent(upstream):
    up, client, url = upstream
    async with client.stream("POST", f"{url}/sse?n=3", json={}) as r:
        lines = r.aiter_lines()
        got = []
        async for line in lines:
            if line.startswith("data: "):
                got.append(line)
                if len(got) < 3:
                    assert up.sent == len(got)  # the event arrived before the server sent the next one
                    up.release.set()
                if line == "data: [DONE]" or len(got) == 4:
                    break
    assert got == ['data: {"i": 0}', 'data: {"i": 1}', 'data: {"i": 2}', "data: [DONE]"]


async def test_closing_an_unfinished_stream_closes_its_connection(upstream):
    up, client, url = upstream
    async with client.stream("POST", f"{url}/sse?n=5", json={}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # the client goes after the first event
    up.release.set()  # the server writes the next event into a closed connection
    await asyncio.wait_for(up.disconnected.wait(), 30)
    assert up.sent < 5
    r = await client.post(f"{url}/echo", json={"again": True})  # the pool still serves
    assert r.json()["body"] == {"again": True}


async def test_a_read_timeout_is_httpx_read_timeout(upstream):
    _, client, url = upstream
    with pytest.raises(httpx.ReadTimeout):
        await client.get(f"{url}/slow?delay=5", timeout=httpx.Timeout(0.2, connect=5.0))


async def test_a_refused_connection_is_httpx_connect_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/echo", json={})
