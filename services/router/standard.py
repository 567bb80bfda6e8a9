"""The standard lane: vLLM generates; the router forwards bytes, or continues a migrated request.

Contract:
- ``forward(client, url, path, body, stream, headers)``: the client's request, unchanged, to the
  standard pool's (or the prefill vLLM's) OpenAI endpoint. A non-2xx answer passes through with its
  status and body (never hidden behind a 502); an unreachable server is a 503 with an OpenAI error
  body. A streamed answer is relayed chunk by chunk; a client that goes away closes the upstream
  request, so vLLM aborts it.
- ``forward_native_pool(...)``: vLLM's disaggregated-serving proxy protocol (NixlConnector): the
  prefill vLLM computes the prompt with ``kv_transfer_params={"do_remote_decode": true, ...}`` and
  ``max_tokens=1``; its answer's ``kv_transfer_params`` go with the client's request to a vLLM of
  the native decode pool, which pulls the KV and generates the answer that is relayed.
- ``continue_tokens(...)``: the migration path. vLLM continues a completion from token ids
  (``prompt + tokens already sent``) with ``max_tokens`` reduced; yields ``TokenBatch``es with the
  ids vLLM generated and, on the last one, the finish reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from services.router.errors import ApiError


@dataclass
class TokenBatch:
    """Completion token ids in order; ``finish_reason`` set on the last batch."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # parallel to token_ids when the request asked for logprobs (a None entry: not known)
    logprobs: list[Any] | None = None


class UpstreamError(Exception):
    """vLLM answered with an error: passed through to the client with its status and body."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(f"upstream status {status}: {body[:200]!r}")
        self.status = status
        self.body = body
        self.content_type = content_type

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.content_type)


def unreachable(url: str, exc: Exception) -> ApiError:
    return ApiError(503, f"the model server at {url} is not reachable: {exc}", code="upstream_unavailable")


async def forward(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict[str, Any],
    stream: bool,
    headers: dict[str, str],
    timeout_s: float,
) -> Response:
    """Send the request to vLLM and relay its answer (see the module contract)."""
    request = client.build_request("POST", f"{url}{path}", json=body, headers=headers,
                                   timeout=httpx.Timeout(timeout_s, connect=5.0))
    try:
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from None
    content_type = upstream.headers.get("content-type", "application/json")
    if upstream.status_code >= 400 or not stream:
        try:
            data = await upstream.aread()
        finally:
            await upstream.aclose()
        return Response(data, status_code=upstream.status_code, media_type=content_type.split(";")[0])

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream",
                             background=BackgroundTask(upstream.aclose))


NATIVE_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                         "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def forward_native_pool(
    client: httpx.AsyncClient,
    prefill_url: str,
    decode_url: str,
    path: str,
    body: dict[str, Any],
    stream: bool,
    headers: dict[str, str],
    timeout_s: float,
) -> Response:
    """Prefill on ``prefill_url``, decode on the native pool's ``decode_url`` (vLLM proxy protocol)."""
    prefill_body = {**body, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": dict(NATIVE_PREFILL_PARAMS)}
    for key in ("max_completion_tokens", "stream_options"):
        prefill_body.pop(key, None)
    try:
        resp = await client.post(f"{prefill_url}{path}", json=prefill_body, headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=5.0))
    except httpx.HTTPError as exc:
        raise unreachable(prefill_url, exc) from None
    if resp.status_code >= 400:
        raise UpstreamError(resp.status_code, resp.content,
                            resp.headers.get("content-type", "application/json").split(";")[0])
    params = resp.json().get("kv_transfer_params")
    if not params:
        raise ApiError(503, "the prefill vLLM returned no kv_transfer_params: is it started with "
                            "NixlConnector (expresslane prefill --native-pool)?", code="native_pool_unavailable")
    return await forward(client, decode_url, path, {**body, "kv_transfer_params": params}, stream,
                         headers, timeout_s)


def _completion_logprobs(lp: dict[str, Any], n: int) -> list[Any]:
    """Per-token logprobs of a completions chunk rendered with ``return_tokens_as_token_ids``."""
    from services.router.express import chunk_logprobs

    out = []
    for i in range(n):
        one = {"tokens": lp.get("tokens", [])[i:i + 1], "token_logprobs": lp.get("token_logprobs", [])[i:i + 1],
               "top_logprobs": lp.get("top_logprobs", [])[i:i + 1]}
        out.append(chunk_logprobs({"logprobs": one}) if one["tokens"] else None)
    return out


def continuation_body(
    model: str, token_ids: list[int], max_tokens: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A completions request that continues from ``token_ids`` (prompt + tokens already sent)."""
    return {
        "model": model,
        "prompt": list(token_ids),
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        **{k: v for k, v in sampling.items() if v is not None},
    }


async def _lines(upstream: httpx.Response, url: str) -> AsyncIterator[str]:
    """The response's lines; a connection that breaks or times out mid-stream is ApiError (503)."""
    try:
        async for line in upstream.aiter_lines():
            yield line
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from None


async def continue_tokens(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
) -> AsyncIterator[TokenBatch]:
    """Stream the continuation's token ids from vLLM; raises UpstreamError or ApiError (503)."""
    import json

    request = client.build_request("POST", f"{url}/v1/completions", json=body, headers=headers,
                                   timeout=httpx.Timeout(timeout_s, connect=5.0))
    try:
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from None
    try:
        if upstream.status_code >= 400:
            raise UpstreamError(upstream.status_code, await upstream.aread())
        async for line in _lines(upstream, url):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise UpstreamError(500, json.dumps(chunk).encode())
            for choice in chunk.get("choices", []):
                ids = list(choice.get("token_ids") or [])
                lps = None
                if body.get("logprobs") is not None and ids:
                    lps = _completion_logprobs(choice.get("logprobs") or {}, len(ids))
                yield TokenBatch(ids, choice.get("finish_reason"), lps)
    finally:
        await upstream.aclose()
