"""The router's upstream HTTP transport: httpx's client API over aiohttp's connection pool and parser.

Every request the router sends to vLLM (the express lane's prefill leg, the standard lane, continuations, model
discovery) goes through one ``httpx.AsyncClient``. httpx's own transport (httpcore + h11, pure Python) costs
~0.18 ms of the router's CPU a request more than aiohttp's C parser on the same loop (a local SSE answer: 0.53 ms
a request through httpx alone, 0.35 through httpx over this transport, measured on a 2-vCPU host), and that time
is on every first token's path. The client keeps its API (requests, streaming, timeouts and httpx's exception
types, which the router's handlers catch); tests still hand the client a mock transport of their own.

Semantics kept from httpx's transport:
- timeouts from the request's ``timeout`` extension: ``connect`` bounds the connection, ``read`` the wait for each
  chunk of the answer (httpx.ConnectTimeout / httpx.ReadTimeout);
- a refused or broken connection is httpx.ConnectError, a connection that breaks mid-answer httpx.ReadError or
  httpx.RemoteProtocolError;
- the body is streamed as it arrives, never decompressed or buffered here;
- closing a response before its end closes its connection, so vLLM sees the client go and aborts the request
  (a fully read one goes back to the pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx

# headers aiohttp sets itself from the URL and the body
_OWN_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection"}


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    t = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))


def _mapped(exc: BaseException, request: httpx.Request) -> httpx.HTTPError:
    """The httpx exception a failure of aiohttp's stands for."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg, request=request)
    if isinstance(exc, asyncio.TimeoutError):  # the answer's head or a chunk of its body did not come in time
        return httpx.ReadTimeout(msg, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg, request=request)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return httpx.RemoteProtocolError(msg, request=request)
    return httpx.ReadError(msg, request=request)


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request):
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _mapped(exc, self._request) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection is reused
        else:
            self._response.close()  # an answer left unread: the connection goes, and vLLM aborts the request


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport over one aiohttp session (made on the first request, in the running loop)."""

    def __init__(self, max_connections: int = 1000, keepalive_s: float = 4.0):
        # keepalive_s: an idle connection is dropped before vLLM's server drops it (uvicorn's 5 s), so a request
        # never goes out on a connection the server is closing (httpx's pool keeps 5 s for the same reason)
        self._limit, self._keepalive_s = max_connections, keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  cookie_jar=aiohttp.DummyCookieJar(),
                                                  skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in _OWN_HEADERS]
        body = await request.aread()  # the router's bodies are JSON built in memory: already read
        try:
            response = await self._sess().request(request.method, str(request.url), headers=headers, data=body,
                                                  allow_redirects=False, timeout=_timeout(request))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _mapped(exc, request) from exc
        return httpx.Response(response.status, headers=[(k.decode("latin-1"), v.decode("latin-1"))
                                                         for k, v in response.raw_headers],
                              stream=_Body(response, request), extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
