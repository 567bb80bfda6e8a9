"""The router app against fake neighbours: a fake vLLM (httpx mock transport) and a fake
coordinator and decode node on a real nats-server. Checks the express leg's protocol (claim,
prefill body, DecodeStart, relay), back-pressure, stop strings, migration and cancellation."""

from __future__ import annotations

import asyncio
import gc
import re
import contextlib
import json
import time

import httpx
import msgspec
import pytest
import structlog.testing

from services.router.app import Router, create_app
from services.router.config import RouterConfig
from services.router.policy import PolicyConfig
from shared import subjects
from shared.bus import Bus
from shared.handoff import parse_request
from shared.events import (
    CancelRequest, ClaimGranted, ClaimRejected, ClaimRequest, DecodeStart, HandoffEvent, KvLayoutSpec,
    NodeAvailable,
    RequestFailed, RequestFinished, SlotTarget, TokensGenerated, TransferTarget, Usage,
)

MODEL = "tiny"
PROMPT_IDS = [0, 3, 100, 200, 4]


class World:
    """Scripted neighbours; ``answer`` is the full greedy completion every lane produces."""

    def __init__(self, tokenizer, model_dir: str) -> None:
        self.answer = tokenizer.encode(" The quick brown fox jumps over the lazy dog again and again",
                                       add_special_tokens=False)
        self.model_dir = model_dir
        self.claims: list[ClaimRequest] = []
        self.starts: list[DecodeStart] = []
        self.cancels: list[CancelRequest] = []
        self.prefill_bodies: list[dict] = []
        self.reject = ""  # a ClaimRejected reason
        self.fail_after: int | None = None  # node goes silent after this many decode tokens
        self.fail_with_event = False
        self.node_delay_s = 0.0
        self.hold_claims = False  # leave claims unanswered (waiting for a slot)
        self.kv_failed = ""  # the first leg's prefill keeps its KV: the lease fails with this reason

    # ------------------------------------------------------------------ fake vLLM
    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "root": self.model_dir,
                                                        "max_model_len": 256}]})
        body = json.loads(request.content)
        if body.get("model") != MODEL:
            return httpx.Response(404, json={"error": {"message": "no such model", "type": "NotFoundError",
                                                       "param": None, "code": 404}})
        prompt = body.get("prompt") if isinstance(body.get("prompt"), list) else PROMPT_IDS
        done = len(prompt) - len(PROMPT_IDS)  # continuation: tokens already generated
        n = min(body.get("max_tokens") or 10**6, len(self.answer) - done)
        ids = self.answer[done : done + n]
        finish = "length" if done + n < len(self.answer) else "stop"
        if "kv_transfer_params" in body:
            self.prefill_bodies.append(body)
        if body.get("stream"):  # as vLLM streams: prompt ids first, the finish with the last token
            chunks = [{"choices": [{"index": 0, "text": "", "token_ids": [t],
                                    "finish_reason": finish if i == len(ids) - 1 else None}]}
                      for i, t in enumerate(ids)]
            if body.get("return_token_ids"):
                chunks.insert(0, {"prompt_token_ids": prompt, "choices": [{"index": 0, "text": "",
                                                                            "finish_reason": None}]})
            lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
            return httpx.Response(200, content="".join(lines).encode(),
                                  headers={"content-type": "text/event-stream"})
        choice = {"index": 0, "token_ids": ids, "finish_reason": finish, "text": "",
                  "message": {"role": "assistant", "content": "x"}}
        return httpx.Response(200, json={"choices": [choice], "prompt_token_ids": prompt,
                                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}})

    # ------------------------------------------------------------------ fake coordinator + node
    async def attach(self, bus: Bus) -> None:
        layout = KvLayoutSpec(layout_version=1, kind="gqa", dtype="float32", num_layers=2, max_tokens=256,
                              slot_nbytes=1, segments=[])
        self.heartbeat = NodeAvailable(node_id="n0", model=self.model_dir, protocol_version=1, total_slots=1,
                                       free_slots=[0], transports=["mooncake"],
                                       endpoints={"mooncake": "127.0.0.1:1"},  # where grants point
                                       slots=[SlotTarget(slot=i, base_addr=0, nbytes=1) for i in (0, 1)],
                                       layout=layout, heartbeat_interval_ms=60_000, seq=1, sent_at_ms=0)
        self.layout = layout

        async def on_claim(req: ClaimRequest, msg) -> None:
            self.claims.append(req)
            if self.hold_claims:
                return
            if self.reject:
                await bus.respond(msg, ClaimRejected(request_id=req.request_id, reason=self.reject,
                                                     retry_after_ms=1500))
                return
            target = TransferTarget(node_id="n0", transport="mooncake", endpoint="127.0.0.1:1",
                                    slot=SlotTarget(slot=0, base_addr=0, nbytes=1), layout=self.layout)
            await bus.respond(msg, ClaimGranted(request_id=req.request_id, lease_id="L" + req.request_id,
                                                generation=1, node_id="n0", target=target,
                                                expires_at_ms=int(time.time() * 1000) + 30_000))

        async def on_start(start: DecodeStart, msg) -> None:
            self.starts.append(start)
            asyncio.get_running_loop().create_task(self._decode(bus, start))

        async def on_cancel(c: CancelRequest, msg) -> None:
            self.cancels.append(c)

        self.bus, self.on_claim = bus, on_claim
        self.claim_sub = await bus.subscribe(subjects.CLAIM, on_claim, ClaimRequest)
        await bus.subscribe(subjects.DECODE_START_ALL, on_start, DecodeStart)
        await bus.subscribe(subjects.REQ_CANCEL_ALL, on_cancel, CancelRequest)
        await bus.publish(subjects.node_avail("n0"), self.heartbeat)

    async def _decode(self, bus: Bus, start: DecodeStart) -> None:
        if self.kv_failed and "-m" not in start.request_id:  # as the coordinator tells a KvFailed
            await bus.publish(subjects.handoff(start.request_id, "failed"), HandoffEvent(
                request_id=start.request_id, state="failed", at_ms=0, lease_id=start.lease_id,
                generation=start.generation, node_id="n0", slot=start.slot, reason=self.kv_failed))
            return
        done = start.num_prompt_tokens - len(PROMPT_IDS) + 1  # answer tokens before this leg's decode
        rest = self.answer[done : done + start.sampling.max_tokens]
        for i, t in enumerate(rest):
            if self.fail_after is not None and i >= self.fail_after and not start.request_id.count("-m"):
                if self.fail_with_event:
                    await bus.publish(subjects.req_tokens(start.request_id),
                                      RequestFailed(request_id=start.request_id, reason="node lost"))
                return
            if any(c.request_id == start.request_id for c in self.cancels):
                await bus.publish(subjects.req_tokens(start.request_id), RequestFinished(
                    request_id=start.request_id, finish_reason="cancelled",
                    usage=Usage(prompt_tokens=start.num_prompt_tokens, completion_tokens=i + 1)))
                return
            await asyncio.sleep(self.node_delay_s)
            await bus.publish(subjects.req_tokens(start.request_id),
                              TokensGenerated(request_id=start.request_id, index=i + 1, token_ids=[t]))
        reason = "stop" if done + len(rest) >= len(self.answer) else "length"
        await bus.publish(subjects.req_tokens(start.request_id), RequestFinished(
            request_id=start.request_id, finish_reason=reason,
            usage=Usage(prompt_tokens=start.num_prompt_tokens, completion_tokens=len(rest) + 1)))


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture
async def harness(nats_url, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    world = World(tok, model_dir)
    cfg = RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off",
                       policy=PolicyConfig(capability_gate="reject"))
    app = create_app(cfg)
    router: Router = app.state.router
    await router.http.aclose()
    router.http = httpx.AsyncClient(transport=httpx.MockTransport(world.handler))
    bus = await Bus.connect(nats_url, name="fakes")
    await world.attach(bus)
    await router.start()
    deadline = time.monotonic() + 60
    while not (router.is_ready and router.bus and router.express_capacity().get(MODEL)):
        assert time.monotonic() < deadline, "the router never saw the node's heartbeat"
        await asyncio.sleep(0.05)
        await bus.publish(subjects.node_avail("n0"), world.heartbeat)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    try:
        yield world, client, router, tok
    finally:
        await client.aclose()
        await router.stop()
        await bus.close()
    assert router.dispatcher.num_open == 0  # no leg left registered


def with_silence_timeout(router: Router, **overrides) -> None:
    """A node that goes silent is noticed after 1 s (the default is long enough that a busy
    machine never takes a slow healthy stream for a lost node)."""
    router.cfg = RouterConfig(**{**router.cfg.__dict__, "token_timeout_s": 1.0,
                                 "first_decode_timeout_s": 1.0, **overrides})


def _sse(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            out.append(block[6:] if block[6:] == "[DONE]" else json.loads(block[6:]))
    return out


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **kw}


async def test_express_stream_relays_every_token(harness):
    world, client, router, tok = harness
    r = await client.post("/v1/chat/completions", json=_chat(
        stream=True, max_tokens=8, stream_options={"include_usage": True}, return_token_ids=True))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == world.answer[:8]
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text == tok.decode(world.answer[:8])
    assert events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    # the protocol with the neighbours
    (claim,) = world.claims
    assert (claim.model, claim.max_tokens) == (MODEL, 8) and world.model_dir in claim.model_aliases
    body = world.prefill_bodies[0]
    assert body["max_tokens"] == 1 and body["stream"] is True and body["return_token_ids"] is True
    handoff = parse_request(body["kv_transfer_params"])
    assert (handoff.request_id, handoff.lease_id, handoff.generation) == (claim.request_id,
                                                                          "L" + claim.request_id, 1)
    assert handoff.target.node_id == "n0" and handoff.traceparent.startswith("00-")
    (start,) = world.starts
    assert (start.first_token_id, start.sampling.max_tokens, start.num_prompt_tokens) == (world.answer[0], 7, 5)
    assert start.sampling.temperature == 0.0
    assert 1 in start.sampling.stop_token_ids  # the model's EOS ids ride along


async def test_non_stream_completions(harness):
    world, client, _, tok = harness
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 6,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == tok.decode(world.answer[:6])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6


async def test_stop_string_cancels_decode(harness):
    world, client, _, tok = harness
    world.node_delay_s = 0.02
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=12, stop=[" fox"]))
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == " The quick brown"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " fox"
    await asyncio.sleep(0.2)
    assert [c.reason for c in world.cancels] == ["client_disconnected"]


async def test_saturation_is_429_with_retry_after(harness):
    world, client, _, _ = harness
    world.reject = "queue_full"
    r = await client.post("/v1/chat/completions", json=_chat(stream=True, max_tokens=8))
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


async def test_rejection_no_node_could_take_goes_standard(harness):
    world, client, _, _ = harness
    world.reject = "no_compatible_node"
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=4))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "standard"


@pytest.mark.parametrize("with_event", [False, True])
async def test_node_failure_migrates_without_loss(harness, with_event):
    world, client, router, _ = harness
    world.fail_after, world.fail_with_event = 3, with_event
    with_silence_timeout(router)
    with structlog.testing.capture_logs() as logs:
        r = await client.post("/v1/chat/completions", json=_chat(stream=True, max_tokens=10, return_token_ids=True))
    events = _sse(r.text)
    ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == world.answer[:10]
    assert [c.request_id.endswith("-m1") for c in world.claims] == [False, True]
    (failed,) = [line for line in logs if line["event"] == "express_leg_failed"]  # the client's id, and the leg's
    assert (failed["request_id"], failed["leg_id"]) == (r.headers["x-request-id"], world.claims[0].request_id)
    assert [c.exclude_nodes for c in world.claims] == [[], ["n0"]]  # never back to the failed node
    assert world.starts[1].num_prompt_tokens == len(PROMPT_IDS) + 4


async def test_kv_the_prefill_kept_migrates_the_request_at_once(harness):
    """A streamed prefill does not say whether it handed the KV off; its KvFailed fails the lease,
    and the request continues on another leg, long before any silence timeout."""
    world, client, router, _ = harness
    world.kv_failed = "no free staging slot"
    router.cfg = RouterConfig(**{**router.cfg.__dict__, "first_decode_timeout_s": 60.0})
    r = await client.post("/v1/chat/completions", json=_chat(stream=True, max_tokens=10, return_token_ids=True))
    ids = [t for e in _sse(r.text)[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == world.answer[:10]
    assert [c.request_id.endswith("-m1") for c in world.claims] == [False, True]


async def test_a_warm_lease_serves_a_request_without_a_claim_round_trip(harness):
    world, client, router, _ = harness
    assert router.warm.held_ids() == []  # one free slot: never held
    await world.bus.publish(subjects.node_avail("n0"), msgspec.structs.replace(
        world.heartbeat, total_slots=2, free_slots=[0, 1], seq=2))
    deadline = time.monotonic() + 30
    while not router.warm.held_ids():
        assert time.monotonic() < deadline, "no warm lease was claimed"
        await asyncio.sleep(0.01)
    (warm,) = world.claims
    assert warm.wait_ms == 0 and router.warm.held_ids() == [warm.request_id]
    with structlog.testing.capture_logs() as logs:
        r = await client.post("/v1/chat/completions", json=_chat(max_tokens=4, return_token_ids=True))
    assert r.headers["x-expresslane-lane"] == "express" and r.headers["x-expresslane-leg"] == warm.request_id
    # said once, after the first token, under the request's own id
    (said,) = [line for line in logs if line["event"] == "express_warm_lease"]
    assert (said["request_id"], said["leg_id"]) == (r.headers["x-request-id"], warm.request_id)
    assert r.json()["choices"][0]["token_ids"] == world.answer[:4]
    assert world.starts[0].request_id == warm.request_id  # the request's leg is the warm lease
    handoff = world.prefill_bodies[0]["kv_transfer_params"]["expresslane"]
    assert (handoff["request_id"], handoff["lease_id"]) == (warm.request_id, "L" + warm.request_id)
    assert all(c.request_id != r.headers["x-request-id"] for c in world.claims)  # never claimed itself


async def test_a_client_gone_before_its_first_chunk_leaves_no_leg_behind(harness):
    """The client hangs up while its first token is awaited: Starlette cancels the streamed body
    before it starts where the server yields on the response's first write (a generator never
    started runs no ``finally``); the leg is cancelled as the client's all the same, and its queue
    and slot are given up."""
    world, client, router, _ = harness
    body = json.dumps(_chat(max_tokens=8, stream=True, return_token_ids=True)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"x-expresslane", b"on")],
             "client": ("127.0.0.1", 1), "server": ("router", 80)}
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}  # gone by the time the response starts

    sent: list[dict] = []

    async def send(message: dict) -> None:  # a server that yields on writes (backpressure)
        sent.append(message)
        await asyncio.sleep(0)

    await client._transport.app(scope, receive, send)
    (claim,) = world.claims  # the leg's id
    deadline = time.monotonic() + 30
    while not any(c.request_id == claim.request_id for c in world.cancels):
        assert time.monotonic() < deadline, "the leg was never cancelled"
        await asyncio.sleep(0.01)
    cancel = next(c for c in world.cancels if c.request_id == claim.request_id)
    assert cancel.reason == "client_disconnected"
    assert router.dispatcher.num_open == 0 and router.dispatcher.slots_in_use() == set()


async def test_client_leaving_while_its_claim_waits_cancels_the_claim_before_prefill(harness):
    world, client, router, _ = harness
    world.hold_claims = True
    request = asyncio.create_task(client.post("/v1/chat/completions", json=_chat(stream=True, max_tokens=4)))
    deadline = time.monotonic() + 30
    while not world.claims:
        assert time.monotonic() < deadline, "no claim reached the coordinator"
        await asyncio.sleep(0.01)
    request.cancel()  # the client goes away
    with contextlib.suppress(asyncio.CancelledError):
        await request
    while not world.cancels:
        assert time.monotonic() < deadline, "the waiting claim was never cancelled"
        await asyncio.sleep(0.01)
    (cancel,) = world.cancels
    assert (cancel.request_id, cancel.reason, cancel.is_before_prefill) == (
        world.claims[0].request_id, "client_disconnected", True)
    assert world.prefill_bodies == [] and router.dispatcher.num_open == 0


async def test_unanswered_claim_goes_standard_and_is_cancelled_before_prefill(harness):
    world, client, router, _ = harness
    router.cfg = RouterConfig(**{**router.cfg.__dict__, "claim_wait_ms": 100, "claim_margin_s": 0.1})
    world.hold_claims = True  # a coordinator that never answers in time
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=4, return_token_ids=True))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "standard"
    deadline = time.monotonic() + 30
    while not world.cancels:
        assert time.monotonic() < deadline, "the abandoned claim was never cancelled"
        await asyncio.sleep(0.01)
    (cancel,) = world.cancels
    assert (cancel.request_id, cancel.reason, cancel.is_before_prefill) == (
        world.claims[0].request_id, "claim_abandoned", True)


async def test_a_claim_the_bus_refuses_goes_standard_not_a_500(harness, monkeypatch):
    from shared.bus import BusUnavailable

    world, client, router, _ = harness
    real = router.bus.request

    async def request(subject, *args, **kw):
        if subject == subjects.CLAIM:
            raise BusUnavailable("not connected to NATS")
        return await real(subject, *args, **kw)

    monkeypatch.setattr(router.bus, "request", request)
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=4, return_token_ids=True))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "standard"
    assert "not connected to NATS" in r.headers["x-expresslane-reason"]
    assert r.json()["choices"][0]["token_ids"] == world.answer[:4]


async def test_claim_outlasts_a_coordinator_failover_and_stays_express(harness):
    world, client, router, _ = harness
    router.cfg = RouterConfig(**{**router.cfg.__dict__, "claim_wait_ms": 60_000})
    await world.claim_sub.unsubscribe()  # the leader died, no standby leads yet
    await world.bus.flush()  # the server has dropped the interest: a claim now meets no responders
    request = asyncio.create_task(client.post("/v1/chat/completions",
                                              json=_chat(max_tokens=4, return_token_ids=True)))
    await asyncio.sleep(0.3)  # the router asks while nobody answers
    assert not request.done() and world.claims == []
    world.claim_sub = await world.bus.subscribe(subjects.CLAIM, world.on_claim, ClaimRequest)
    r = await request
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    assert r.json()["choices"][0]["token_ids"] == world.answer[:4]
    assert len(world.claims) == 1


async def test_migration_to_standard_lane(harness):
    world, client, router, _ = harness
    world.fail_after = 2
    with_silence_timeout(router, migrate_to="standard")
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 9,
                                                  "temperature": 0, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == world.answer[:9]
    assert len(world.claims) == 1


async def test_the_lane_says_why(harness):
    world, client, _, _ = harness
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=3), headers={"x-expresslane": "off"})
    assert (r.headers["x-expresslane-lane"], r.headers["x-expresslane-reason"]) == ("standard", "header")
    # this router runs without vLLM's serving code (and refuses what the express lane cannot honour)
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=3, logprobs=True))
    assert r.status_code == 400 and "logprobs (vLLM's serving code in the router: off)" in r.json()["error"]["message"]
    assert world.claims == []


async def test_standard_lane_passthrough(harness):
    world, client, _, _ = harness
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=3),
                          headers={"x-expresslane": "off"})
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "standard"
    assert world.claims == []


@pytest.mark.parametrize("body,status", [
    (b"{", 400), (json.dumps(_chat(model="nope")).encode(), 404),
    (json.dumps(_chat(n=2)).encode(), 400), (json.dumps(_chat(max_tokens=0)).encode(), 400),
    (json.dumps(_chat(max_tokens=300)).encode(), 400),
])
async def test_errors(harness, body, status):
    _, client, _, _ = harness
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_api_keys(nats_url):
    cfg = RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off", api_keys={"k1": "tenant-a"})
    app = create_app(cfg)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}):
            r = await client.post("/v1/chat/completions", json=_chat(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        r = await client.post("/v1/chat/completions", json=_chat(), headers={"authorization": "Bearer k1"})
        assert r.status_code == 404  # authenticated; no model discovered in this app
        assert (await client.get("/v1/models", headers={"authorization": "Bearer k1"})).status_code == 200
    await app.state.router.http.aclose()


ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("method,path,status,allow", [
    ("GET", "/v1/nope", 404, None), ("POST", "/", 404, None), ("GET", "/v1/chat/completions", 405, "POST"),
    ("PUT", "/v1/completions", 405, "POST"), ("DELETE", "/metrics", 405, "GET"),
    ("POST", "/v1/models", 405, "GET"),
])
async def test_unknown_routes_and_wrong_methods_answer_openai_errors(nats_url, method, path, status, allow):
    app = create_app(RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        r = await client.request(method, path, json={})
    await app.state.router.http.aclose()
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error"
    assert error["code"] == {404: "unknown_url", 405: "method_not_allowed"}[status]
    assert path in error["message"] and "detail" not in r.json()
    assert r.headers.get("allow") == allow


async def test_metrics_can_require_an_api_key(nats_url):
    cfg = RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off", api_keys={"k1": "tenant-a"},
                       metrics_require_api_key=True)
    app = create_app(cfg)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        for headers in ({}, {"authorization": "Bearer nope"}):
            r = await client.get("/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "expresslane_" not in r.text
        r = await client.get("/metrics", headers={"authorization": "Bearer k1"})
        assert r.status_code == 200 and "expresslane_" in r.text
        assert (await client.get("/health")).status_code == 503  # health stays open to probes
    await app.state.router.http.aclose()
    # without the flag, /metrics stays open even when the API needs keys
    app = create_app(RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off", api_keys={"k1": "a"}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        assert (await client.get("/metrics")).status_code == 200
    await app.state.router.http.aclose()


def _malformed(i: int) -> tuple[str, str, bytes, int, str | None]:
    """The i-th of several kinds of bad request: method, path, body, status, error code."""
    chat = "/v1/chat/completions"
    kinds = [
        ("POST", chat, b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        ("POST", chat, json.dumps(_chat(max_tokens="ten")).encode(), 400, None),
        ("POST", chat, json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, None),
        ("POST", "/v1/completions", json.dumps({"model": 5, "prompt": "x"}).encode(), 400, None),
        ("POST", chat, json.dumps(_chat(model=f"nope-{i}")).encode(), 404, "model_not_found"),
        ("POST", chat, json.dumps(_chat(max_tokens=10**9)).encode(), 400, "context_length_exceeded"),
        ("POST", f"/v1/nope/{i}", b"{}", 404, "unknown_url"),
        ("GET", chat, b"", 405, "method_not_allowed"),
        ("POST", chat, b"\xff\xfe\x00", 400, "invalid_json"),
        ("POST", chat, b"[]", 400, None),
    ]
    return kinds[i % len(kinds)]


async def test_burst_of_malformed_requests_gets_clean_4xx_and_leaks_nothing(harness):
    world, client, router, _ = harness
    cases = [_malformed(i) for i in range(200)]

    async def send(method, path, body, status, code):
        r = await client.request(method, path, content=body, headers={"content-type": "application/json"})
        return r, status, code

    results = await asyncio.gather(*(send(*case) for case in cases))
    for (r, status, code), case in zip(results, cases):
        assert r.status_code == status, (case, r.text)
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, case
        assert body["error"]["code"] == code, case
    # nothing leaked: no claim reached the coordinator, no leg is registered, and it still serves
    assert world.claims == [] and world.starts == []
    assert router.dispatcher.num_open == 0
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=3))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    assert len(world.claims) == 1


def test_metrics_key_flag_needs_api_keys():
    from services.router.config import build_parser, from_args

    args = build_parser().parse_args(["--metrics-require-api-key"])
    with pytest.raises(ValueError, match="--metrics-require-api-key needs --api-keys"):
        from_args(args)
    cfg = from_args(build_parser().parse_args(["--metrics-require-api-key", "--api-keys", "k=t"]))
    assert cfg.metrics_require_api_key and cfg.api_keys == {"k": "t"}


async def test_the_router_process_freezes_its_heap_before_it_says_ready(nats_url, model_dir):
    from transformers import AutoTokenizer

    world = World(AutoTokenizer.from_pretrained(model_dir), model_dir)
    app = create_app(RouterConfig(prefill_urls=("http://vllm",), nats_url=nats_url, vllm_surface="off"),
                     settle_heap=True)
    router: Router = app.state.router
    await router.http.aclose()
    router.http = httpx.AsyncClient(transport=httpx.MockTransport(world.handler))
    await router.start()
    try:
        deadline = time.monotonic() + 60
        while not router.is_ready:
            assert time.monotonic() < deadline, "the router never became ready"
            assert not (router._loaded and not router.heap_settled and router.is_ready)
            await asyncio.sleep(0.01)
        assert router.heap_settled and gc.get_freeze_count() > 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            assert (await client.get("/health")).status_code == 200
            gc.collect(2)  # a full collection while serving is measured
            text = (await client.get("/metrics")).text
        full = re.search(r'^expresslane_router_gc_pause_seconds_count\{generation="2"\} (\S+)$', text, re.M)
        assert full and float(full.group(1)) >= 1, text
        assert "expresslane_router_gc_frozen_objects" in text
    finally:
        await router.stop()
        gc.unfreeze()
    assert router.gc_pauses._on_gc not in gc.callbacks
