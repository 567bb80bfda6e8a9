"""The client's side of an express stream when its token source fails mid-stream: the client gets
an OpenAI error event and the end of the stream, never a cut connection, and the stream is closed."""

from __future__ import annotations

import json

import httpx
import pytest
from opentelemetry import trace

from services.router import standard
from services.router.detok import Detokenizer
from services.router.errors import ApiError
from services.router.metrics import RouterMetrics
from services.router.respond import _closer, _stream_body
from services.router.standard import TokenBatch
from services.router.stream import ResponseBuilder


class FailingStream:
    """ExpressStream's surface as respond.py reads it: one token, then ``fail`` is raised."""

    request_id = first_leg_id = "r1"
    prompt_ids = [1, 2, 3]

    def __init__(self, fail: BaseException) -> None:
        self.fail = fail
        self.num_closed = 0

    async def tokens(self):
        yield TokenBatch([5])
        raise self.fail

    def close(self) -> None:
        self.num_closed += 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model("llama")))


async def _body(tokenizer, es) -> list:
    builder = ResponseBuilder("chat", "chatcmpl-r1", "tiny", return_token_ids=True)
    close = _closer(es, trace.INVALID_SPAN)
    chunks = [c async for c in _stream_body(es, Detokenizer(tokenizer, es.prompt_ids), builder, close, 0.0,
                                            RouterMetrics())]
    close()  # the response's background task: already done by the body
    return [json.loads(c[6:]) if c.startswith(b"data: {") else c for c in b"".join(chunks).split(b"\n\n") if c]


@pytest.mark.parametrize("fail, status", [
    (standard.unreachable("http://vllm", httpx.ReadTimeout("timed out")), 503),  # a continuation's stream broke
    (ApiError(503, "request failed after 2 migrations"), 503),
    (standard.UpstreamError(400, b'{"error": "bad"}'), 400),
    (RuntimeError("a bug"), 500),
])
async def test_a_failure_mid_stream_ends_it_with_an_error_event(tokenizer, fail, status):
    es = FailingStream(fail)
    events = await _body(tokenizer, es)
    sent = [t for e in events[:-2] for c in e["choices"] for t in c.get("token_ids") or []]
    assert sent == [5]  # the token before the failure went out
    error = events[-2]["error"]
    assert error["type"] == ApiError(status, "").body()["error"]["type"]  # the failure's own status
    assert (error["code"] == "internal_error") == (status == 500)
    assert events[-1] == b"data: [DONE]"
    assert es.num_closed == 1


async def test_a_broken_continuation_stream_is_unreachable_not_a_crash():
    async def handler(request: httpx.Request) -> httpx.Response:
        async def chunks():
            yield b'data: {"choices": [{"token_ids": [7], "finish_reason": null}]}\n\n'
            raise httpx.ReadTimeout("vLLM went away")
        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        got = []
        with pytest.raises(ApiError) as err:
            async for batch in standard.continue_tokens(client, "http://vllm", {"prompt": [1]}, {}, 5.0):
                got.append(batch.token_ids)
    assert got == [[7]] and err.value.status == 503
