"""A tiny asyncio HTTP responder for /health and /metrics (no framework, no signal handling).

    server = await serve_status(host, port, {"/health": fn, "/metrics": fn})
    # fn() -> (status, content_type, body bytes); server.sockets[0].getsockname()[1] is the port
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Route = Callable[[], tuple[int, str, bytes]]
_REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable", 500: "Internal Server Error"}


async def serve_status(host: str, port: int, routes: dict[str, Route]) -> asyncio.Server:
    """Serve GET requests for ``routes`` on ``host:port`` (0: a free port)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            parts = (await asyncio.wait_for(reader.readline(), 5.0)).split()
            path = parts[1].decode(errors="replace").split("?")[0] if len(parts) > 1 else "/"
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            route = routes.get(path)
            status, ctype, body = route() if route else (404, "text/plain", b"not found\n")
            head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
