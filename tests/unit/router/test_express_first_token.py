"""The express leg's first token reaches the caller before the decode node is told to start
(services.router.express): the node's start never delays the client's first token, and a request
that ends at its first token (a stop string, a client gone) never starts the node at all."""

from __future__ import annotations

import asyncio
import json

import httpx
from opentelemetry import trace

from services.router.backend import ModelInfo
from services.router.config import RouterConfig
from services.router.dispatch import Dispatcher
from services.router.express import ExpressDeps, ExpressStream
from services.router.metrics import RouterMetrics
from shared import subjects
from shared.events import (
    CancelRequest, ClaimGranted, DecodeStart, KvLayoutSpec, PrefillToken, SlotTarget, TransferTarget,
)
from shared.handoff import parse_request

LAYOUT = KvLayoutSpec(layout_version=1, kind="gqa", dtype="float32", num_layers=2, max_tokens=256,
                      slot_nbytes=1, segments=[])
GRANT = ClaimGranted(request_id="leg-1", lease_id="L1", generation=1, node_id="n0", expires_at_ms=2**50,
                     target=TransferTarget(node_id="n0", transport="mooncake", endpoint="e",
                                           slot=SlotTarget(slot=0, base_addr=0, nbytes=1), layout=LAYOUT))
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "allowed_token_ids": None,
            "bad_words_token_ids": [], "min_tokens": 0, "seed": None}


class Bus:
    """Records what the leg publishes (the neighbour under test is the leg, not the bus)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, subject, event, **_):
        self.published.append((subject, event))


class Warm:
    def take(self, *_):
        return GRANT


def prefill_stream(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["max_tokens"] == 1 and body["kv_transfer_params"]
    chunk = {"choices": [{"index": 0, "token_ids": [42], "finish_reason": "length", "delta": {"content": "x"}}],
             "prompt_token_ids": [1, 2, 3]}
    return httpx.Response(200, content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
                          headers={"content-type": "text/event-stream"})


async def open_stream(bus: Bus) -> ExpressStream:
    tasks: list[asyncio.Task] = []
    http = httpx.AsyncClient(transport=httpx.MockTransport(prefill_stream))
    deps = ExpressDeps(bus=bus, http=http, dispatcher=Dispatcher(), nodes=None, metrics=RouterMetrics(),
                       tracer=trace.get_tracer("test"), spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
                       cfg=RouterConfig(), warm=Warm())
    info = ModelInfo(name="m", root="m", url="http://prefill", max_model_len=256)
    es = ExpressStream(deps, info, request_id="r1", path="/v1/completions", body={"model": "m", "prompt": "p"},
                       sampling=SAMPLING, stop_token_ids=[], ignore_eos=True, max_tokens=8, num_prompt_tokens=3,
                       tenant="", parent=trace.INVALID_SPAN)
    assert await es.open() == [1, 2, 3]
    return es


def starts(bus: Bus) -> list[DecodeStart]:
    return [e for s, e in bus.published if isinstance(e, DecodeStart) and s == subjects.decode_start("n0")]


async def test_the_first_token_is_yielded_before_the_node_is_started():
    bus = Bus()
    es = await open_stream(bus)
    tokens = es.tokens()
    first = await tokens.__anext__()
    assert first.token_ids == [42] and first.finish_reason is None
    assert starts(bus) == []  # the caller has the token; nothing was published yet
    # Asking for the next batch starts the node (then waits for its tokens).
    waiting = asyncio.ensure_future(tokens.__anext__())
    for _ in range(100):
        if starts(bus):
            break
        await asyncio.sleep(0)
    (start,) = starts(bus)
    assert (start.request_id, start.lease_id, start.first_token_id, start.num_prompt_tokens) == ("leg-1", "L1", 42, 3)
    assert start.sampling.max_tokens == 7
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await tokens.aclose()


async def test_a_request_that_ends_at_its_first_token_never_starts_the_node():
    bus = Bus()
    es = await open_stream(bus)
    tokens = es.tokens()
    await tokens.__anext__()
    await tokens.aclose()  # a stop string in the first token, or the client gone
    await asyncio.sleep(0)
    assert starts(bus) == []
    cancels = [e for _, e in bus.published if isinstance(e, CancelRequest)]
    assert [c.request_id for c in cancels] == ["leg-1"]


# ---------------------------------------------------------------- the first token over the bus

async def open_with_bus_token(bus: Bus, token: PrefillToken):
    """A leg whose prefill publishes ``token`` on the bus before vLLM's stream answers."""
    gate, bodies, tasks = asyncio.Event(), [], []

    async def slow_stream(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        await gate.wait()
        return prefill_stream(request)

    dispatcher = Dispatcher()
    http = httpx.AsyncClient(transport=httpx.MockTransport(slow_stream))
    metrics = RouterMetrics()
    deps = ExpressDeps(bus=bus, http=http, dispatcher=dispatcher, nodes=None, metrics=metrics,
                       tracer=trace.get_tracer("test"), spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
                       cfg=RouterConfig(), warm=Warm())
    info = ModelInfo(name="m", root="m", url="http://prefill", max_model_len=256)
    es = ExpressStream(deps, info, request_id="r1", path="/v1/completions", body={"model": "m", "prompt": "p"},
                       sampling={**SAMPLING, "min_tokens": 3}, stop_token_ids=[], ignore_eos=True, max_tokens=8,
                       num_prompt_tokens=3, tenant="", parent=trace.INVALID_SPAN)
    opening = asyncio.ensure_future(es.open())
    while not bodies:  # the prefill request is out; its leg listens on the bus
        await asyncio.sleep(0)
    await dispatcher._on_event(token, None)
    prompt_ids = await asyncio.wait_for(opening, 5)
    return es, prompt_ids, bodies[0], gate, metrics, tasks


async def test_the_prefill_token_on_the_bus_is_the_first_token_and_the_router_starts_nothing():
    bus = Bus()
    token = PrefillToken(request_id="leg-1", token_id=43, finish_reason="length", prompt_token_ids=[1, 2, 3, 4])
    es, prompt_ids, body, gate, metrics, tasks = await open_with_bus_token(bus, token)
    assert prompt_ids == [1, 2, 3, 4]  # the bus's, not the (later) stream's [1, 2, 3]
    # The hand-off asked the prefill to start the decode with the node's share of the sampling.
    start = parse_request(body["kv_transfer_params"]).start
    assert (start.max_tokens, start.min_tokens, start.output_token_ids, start.prompt_token_ids) == (7, 2, [], None)
    tokens = es.tokens()
    first = await tokens.__anext__()
    assert first.token_ids == [43] and first.finish_reason is None
    waiting = asyncio.ensure_future(tokens.__anext__())
    for _ in range(100):
        await asyncio.sleep(0)
    assert starts(bus) == []  # the prefill started the node; the router does not start it again
    assert metrics.first_token_source.labels("bus")._value.get() == 1
    waiting.cancel()
    gate.set()
    await asyncio.gather(waiting, *tasks, return_exceptions=True)
    await tokens.aclose()


async def test_a_stop_on_the_bus_token_ends_the_request_and_cancels_the_lease():
    bus = Bus()
    token = PrefillToken(request_id="leg-1", token_id=2, finish_reason="stop", prompt_token_ids=[1, 2, 3])
    es, _, _, gate, _, tasks = await open_with_bus_token(bus, token)
    batches = [b async for b in es.tokens()]
    assert [(b.token_ids, b.finish_reason) for b in batches] == [([2], "stop")]
    gate.set()
    await asyncio.gather(*tasks, return_exceptions=True)  # the cancel is published in the background
    assert starts(bus) == []
    assert [e.reason for _, e in bus.published if isinstance(e, CancelRequest)] == ["finished_at_prefill"]


async def test_without_the_bus_the_stream_gives_the_token_and_the_router_starts_the_node():
    """A prefill whose bus publish never arrives (NATS down in vLLM): vLLM's stream still carries
    the token, and the router's own DecodeStart (a duplicate for the node when both came) starts it."""
    bus = Bus()
    es = await open_stream(bus)
    tokens = es.tokens()
    await tokens.__anext__()
    waiting = asyncio.ensure_future(tokens.__anext__())
    for _ in range(100):
        if starts(bus):
            break
        await asyncio.sleep(0)
    assert len(starts(bus)) == 1
    assert es.deps.metrics.first_token_source.labels("stream")._value.get() == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await tokens.aclose()


def test_an_error_vllm_streams_after_its_200_keeps_its_client_status():
    """vLLM refuses some requests only once streaming (its grammar compiler on a schema pydantic let through): the
    express leg answers with that chunk's 4xx, as vLLM alone answers, and 502 for anything else."""

    from services.router.express import stream_error_status

    cases = [({"error": {"message": "Grammar error", "type": "BadRequestError", "code": 400}}, 400),
             ({"error": {"message": "too long", "code": 413}}, 413),
             ({"error": {"message": "boom", "code": 500}}, 502),
             ({"error": {"message": "no code"}}, 502), ({"error": "text"}, 502), ({"error": {"code": "400"}}, 502)]
    assert [stream_error_status(chunk) for chunk, _ in cases] == [want for _, want in cases]
