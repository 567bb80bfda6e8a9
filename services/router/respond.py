"""The client's side of an express response: token ids -> detokenized text -> OpenAI body.

Contract: ``express_response(es, req, info, ...)`` returns a streaming SSE response (chunks as
token batches arrive, usage at the end, an error after the stream began as an SSE error event) or,
for ``stream=false``, one JSON body once the completion ends. Stop strings are applied here; when
one matches, the token source is closed, which cancels the decode on the node.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.background import BackgroundTask

from services.router import standard
from services.router.backend import ModelInfo
from services.router.detok import Detokenizer
from services.router.errors import ApiError
from services.router.express import ExpressStream
from services.router.metrics import RouterMetrics
from services.router.stream import ResponseBuilder, sse_error, usage_dict
from services.router.validate import ParsedRequest
from shared.log import get_logger

_log = get_logger("services.router.respond")


async def express_response(es: ExpressStream, req: ParsedRequest, info: ModelInfo, request_id: str,
                           span: trace.Span, t_arrival: float, metrics: RouterMetrics,
                           surface: Any = None, prepared: Any = None) -> Response:
    """The HTTP response of an opened express stream (rendered by vLLM's serving code when the
    request was ``prepared`` by services.router.vllm_surface)."""
    prefix = "chatcmpl-" if req.endpoint == "chat" else "cmpl-"
    if prepared is not None:
        return await _vllm_response(es, req, info, prefix + request_id, span, t_arrival, metrics,
                                    surface, prepared)
    builder = ResponseBuilder(req.endpoint, prefix + request_id, req.model,  # type: ignore[arg-type]
                              include_usage=req.include_usage, return_token_ids=req.return_token_ids)
    detok = Detokenizer(info.tokenizer, es.prompt_ids, skip_special_tokens=req.skip_special_tokens,
                        stop=req.stop, include_stop_str_in_output=req.include_stop_str_in_output,
                        stop_token_ids=es.stop_ids)
    if req.stream:
        close = _closer(es, span)
        return StreamingResponse(_stream_body(es, detok, builder, close, t_arrival, metrics),
                                 media_type="text/event-stream", background=BackgroundTask(_after, close))
    text, finish, stop_reason = "", None, None
    async for delta, _, _, finish, stop_reason in _run(es, detok, metrics):
        text += delta
    usage = usage_dict(len(es.prompt_ids), detok.num_tokens)
    return JSONResponse(builder.full(text, finish or "length", stop_reason, usage,
                                     detok.token_ids, es.prompt_ids))


async def _run(es: ExpressStream, detok: Detokenizer, metrics: RouterMetrics
               ) -> AsyncIterator[tuple[str, list[int], list[Any] | None, str | None, str | None]]:
    """(text, token ids, their logprobs, finish_reason, stop_reason) per batch; the source closes
    on a stop."""
    gen = es.tokens()
    metrics.active.labels("express").inc()
    try:
        async for batch in gen:
            delta = detok.add(batch.token_ids)
            metrics.completion_tokens.labels("express").inc(len(delta.token_ids))
            finish = delta.finish_reason or batch.finish_reason
            lps = batch.logprobs[:len(delta.token_ids)] if batch.logprobs is not None else None
            if finish:
                yield delta.text + detok.flush(), delta.token_ids, lps, finish, delta.stop_reason
                return
            yield delta.text, delta.token_ids, lps, None, None
        yield detok.flush(), [], None, "length", None
    finally:
        metrics.active.labels("express").dec()
        await gen.aclose()


def _closer(es: ExpressStream, span: trace.Span) -> Callable[[], None]:
    """Once, however the streamed response ends: the stream's legs closed and the request's span
    ended. The body's ``finally`` calls it, and the response's background task after the response:
    Starlette cancels a body that has not started when the client is gone already (it left while
    the first token was awaited), and a generator that never started runs no ``finally``."""
    done = False

    def close() -> None:
        nonlocal done
        if not done:
            done = True
            try:
                es.close()
            finally:
                span.end()

    return close


def _internal_error(es: ExpressStream, exc: Exception) -> bytes:
    _log.exception("express_stream_failed", request_id=es.request_id, leg_id=es.first_leg_id)
    return sse_error(ApiError(500, f"internal error in the router: {type(exc).__name__}",
                              code="internal_error").body())


async def _after(close: Callable[[], None]) -> None:
    close()  # on the event loop (a plain function would run in a worker thread)


async def _stream_body(es: ExpressStream, detok: Detokenizer, builder: ResponseBuilder, close: Callable[[], None],
                       t_arrival: float, metrics: RouterMetrics) -> AsyncIterator[bytes]:
    first = True
    try:
        async for text, token_ids, _, finish, stop_reason in _run(es, detok, metrics):
            chunk = builder.delta(text, token_ids, es.prompt_ids)
            if chunk:
                if first:
                    metrics.ttft_ms.labels("express").observe((time.perf_counter() - t_arrival) * 1000)
                    first = False
                yield chunk
            if finish:
                yield builder.finish(finish, stop_reason, usage_dict(len(es.prompt_ids), detok.num_tokens))
                return
    except ApiError as exc:
        yield sse_error(exc.body())
    except standard.UpstreamError as exc:
        yield sse_error(ApiError(exc.status, exc.body.decode(errors="replace")[:500]).body())
    except Exception as exc:  # a bug: the client still gets an error event, not a cut stream
        yield _internal_error(es, exc)
    finally:
        close()


async def _vllm_response(es: ExpressStream, req: ParsedRequest, info: ModelInfo, response_id: str,
                         span: trace.Span, t_arrival: float, metrics: RouterMetrics, surface: Any,
                         prepared: Any) -> Response:
    """vLLM's own response (logprobs, tool calls, reasoning) for the express lane's tokens."""
    from services.router.vllm_surface import OutputBuilder

    vreq = prepared.request
    detok = Detokenizer(info.tokenizer, es.prompt_ids, skip_special_tokens=vreq.skip_special_tokens,
                        stop=req.stop, include_stop_str_in_output=req.include_stop_str_in_output,
                        stop_token_ids=es.stop_ids)
    builder = OutputBuilder(info.tokenizer, response_id, es.prompt_ids, prepared.logprobs, req.stream)

    async def outputs() -> AsyncIterator[Any]:
        first = True
        async for text, token_ids, lps, finish, stop_reason in _run(es, detok, metrics):
            if prepared.logprobs is not None:
                builder.add_logprobs(token_ids, lps)
            if first and req.stream:
                metrics.ttft_ms.labels("express").observe((time.perf_counter() - t_arrival) * 1000)
                first = False
            yield builder.output(text, token_ids, finish, stop_reason)
            if finish:
                return

    rendered = surface.render(prepared, info, response_id, es.prompt_ids, outputs())
    if req.stream:
        close = _closer(es, span)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for line in rendered:
                    yield line.encode()
            except Exception as exc:  # as _stream_body
                yield _internal_error(es, exc)
            finally:
                close()
        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(_after, close))
    result = await rendered
    data = result.model_dump()
    if "error" in data and "choices" not in data:
        status = int((data.get("error") or {}).get("code") or 500)
        return JSONResponse(data, status_code=status)
    return JSONResponse(data)
