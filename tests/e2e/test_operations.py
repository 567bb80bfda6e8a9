"""What an operator relies on, every component real: one trace per request, the lifecycle on the
bus, resources freed on disconnect, back-pressure, clean 4xx errors; nothing leaks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import (
    E2E_VLLM_SERVERS,
    CLI, DS_NODES, LLAMA_NODES, assert_nothing_leaked, chat_request, sse_events, wait_until,
)

pytestmark = pytest.mark.e2e
VLLM_SERVERS = E2E_VLLM_SERVERS


# ---------------------------------------------------------------- traces


def _is_prefill(span) -> bool:
    """A span of the prefill (the connector inside vLLM), not the router's prefill hop."""
    return span.service_name != "router" and ("prefill" in span.name or "prefill" in span.service_name)


def _ancestors(span, by_id) -> list:
    out = []
    while span.parent_span_id:
        span = by_id.get(span.parent_span_id)
        if span is None:
            return out + [None]
        out.append(span)
    return out


async def test_one_trace_per_request_across_every_hop(deployment, otlp_receiver):
    r = httpx.post(f"{deployment.router_url}/v1/chat/completions", timeout=120,
                   json=chat_request(deployment.llama_model, max_tokens=8), headers={"x-expresslane": "on"})
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    rid = r.headers["x-request-id"]

    def complete(spans):
        roots = [s for s in spans if s.name == "router.request" and s.attributes.get("request_id") == rid]
        if not roots:
            return False
        mine = [s for s in spans if s.trace_id == roots[0].trace_id]
        services = {s.service_name for s in mine}
        by_id = {s.span_id: s for s in mine}
        # and every span's parent arrived: each process exports its spans when they end, in batches, so a
        # child (the coordinator's KvReady) can reach the receiver before its parent in the prefill's connector
        return ({"router", "coordinator", "decode"} <= services
                and any(_is_prefill(s) for s in mine)
                and all(None not in _ancestors(s, by_id) for s in mine))

    spans = otlp_receiver.wait_for(complete, timeout_s=30.0)
    root = next(s for s in spans if s.name == "router.request" and s.attributes.get("request_id") == rid)
    mine = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in mine}
    # one trace: every span of this request in it, one root, every parent present
    assert [s for s in mine if not s.parent_span_id] == [root]
    assert all(None not in _ancestors(s, by_id) for s in mine), sorted(
        f"{s.service_name}:{s.name}" for s in mine if None in _ancestors(s, by_id))
    strays = [f"{s.service_name}:{s.name} {s.attributes}" for s in spans
              if s.attributes.get("request_id") == rid and s.trace_id != root.trace_id]
    assert not strays, strays
    hops = {s.name: s for s in mine if s.service_name == "router"}
    for name in ("router.claim", "router.prefill", "router.decode"):
        assert hops[name].parent_span_id == root.span_id, name

    def under(is_service, hop):
        return any(hops[hop] in _ancestors(s, by_id) for s in mine if is_service(s))

    if hops["router.claim"].attributes.get("warm_lease"):
        # a lease claimed ahead of the request (services.router.warm): its claim is in no request's
        # trace, the coordinator's part of this one is the KV-ready and decode reports
        assert r.headers["x-expresslane-leg"] != rid
        assert any(s.service_name == "coordinator" for s in mine)
    else:
        assert r.headers["x-expresslane-leg"] == rid
        assert under(lambda s: s.service_name == "coordinator", "router.claim")
    assert under(_is_prefill, "router.prefill")
    # The node's decode hangs under the DecodeStart that reached it first: the prefill's own (sent
    # with the prefill hop's context the moment vLLM had the first token) or the router's.
    decode_hops = [hop for hop in ("router.prefill", "router.decode")
                   if under(lambda s: s.service_name == "decode", hop)]
    assert len(decode_hops) == 1, decode_hops
    if hops["router.decode"].attributes.get("started_by_prefill"):
        assert decode_hops == ["router.prefill"]


# ---------------------------------------------------------------- events


def test_events_command_shows_the_lifecycle_in_order(deployment):
    proc = subprocess.Popen(CLI + ["events", "--json", "--nats-url", deployment.nats_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    try:
        assert proc.stderr.readline(), "the events command said nothing on stderr"
        reader.start()
        time.sleep(0.2)
        r = httpx.post(f"{deployment.router_url}/v1/chat/completions", timeout=120,
                       json=chat_request(deployment.llama_model, max_tokens=6),
                       headers={"x-expresslane": "on"})
        assert r.status_code == 200
        rid = r.headers["x-expresslane-leg"]  # the request's leg (a warm lease's own id)
        warm = rid != r.headers["x-request-id"]
        wait_until(lambda: any(f"handoff.{rid}.completed" in ln for ln in list(lines)), 15.0,
                   "the completed handoff event")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=5)
    assert proc.returncode == 0
    mine = [json.loads(ln) for ln in lines if rid in ln]
    kinds = [m["event"]["type"] + (":" + m["event"]["state"] if m["event"]["type"] == "handoff" else "")
             for m in mine]
    states = [m["event"]["state"] for m in mine if m["subject"].startswith("xl.handoff.")]
    order = ["queued", "claimed", "kv_ready", "decoding", "completed"]
    # a warm lease (services.router.warm) was claimed before the command started listening
    seen = {"completed"} if warm else {"claimed", "completed"}
    assert states == [s for s in order if s in states] and seen <= set(states), kinds
    # the lease's end also went to its decode node, on the node's own subject
    ended = [m for m in mine if m["subject"].startswith("xl.decode.") and m["subject"].endswith(".ended")]
    assert [m["event"]["state"] for m in ended] == ["completed"], kinds
    pos = {k: kinds.index(k) for k in reversed(kinds)}  # first position of each kind
    assert pos["kv_ready"] < pos["tokens"] and (warm or pos["handoff:claimed"] < pos["kv_ready"])
    assert pos["decode_start"] < pos["tokens"] < kinds.index("finished")
    assert kinds.index("finished") > max(i for i, k in enumerate(kinds) if k == "tokens")
    assert [(m["subject"], m["event"]) for m in mine if not m["traceparent"]] == []
    assert len({m["traceparent"].split("-")[1] for m in mine}) == 1  # one trace


# ---------------------------------------------------------------- disconnect


async def test_client_disconnect_frees_slot_lease_and_staging(deployment):
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{deployment.router_url}/v1/chat/completions",
                                 json=chat_request(deployment.llama_model, max_tokens=1500,
                                                   ignore_eos=True, stream=True),
                                 headers={"x-expresslane": "on"}) as r:
            assert r.headers["x-expresslane-lane"] == "express"
            num_chunks = 0
            async for line in r.aiter_lines():
                num_chunks += line.startswith("data: ")
                if num_chunks >= 5:
                    break
            busy = [n for n in LLAMA_NODES if deployment.health(n)["active"]]
            assert len(busy) == 1

            def one_lease_beside_the_warm_ones():
                # the router tops its warm lease up on the other node's free slot meanwhile
                # (services.router.warm); the coordinator is read first, so a claim in flight is
                # counted there before the router holds it, and the next poll agrees
                leases = deployment.health("coordinator")["leases"]
                return leases == 1 + len(deployment.health("router")["warm_leases"])
            wait_until(one_lease_beside_the_warm_ones, 10.0, "the request's lease beside the warm ones")
        # leaving the block closed the connection mid-stream
    assert_nothing_leaked(deployment, timeout_s=30.0)  # how fast: bench/chaos.py


# ---------------------------------------------------------------- back-pressure


async def test_saturation_gives_429_with_retry_after_and_the_rest_completes(deployment):
    num_requests, max_tokens = 6, 200  # 2 llama slots + a queue of 1

    async def one(client):
        body = chat_request(deployment.llama_model, max_tokens=max_tokens, ignore_eos=True, stream=True,
                            stream_options={"include_usage": True})
        async with client.stream("POST", f"{deployment.router_url}/v1/chat/completions", json=body,
                                 headers={"x-expresslane": "on"}) as r:
            if r.status_code != 200:
                return r.status_code, dict(r.headers), json.loads(await r.aread())
            return 200, dict(r.headers), sse_events([ln async for ln in r.aiter_lines()])

    async with httpx.AsyncClient(timeout=300) as client:
        results = await asyncio.gather(*(one(client) for _ in range(num_requests)))
    ok = [res for res in results if res[0] == 200]
    rejected = [res for res in results if res[0] == 429]
    assert len(ok) + len(rejected) == num_requests, [res[0] for res in results]
    assert len(rejected) >= num_requests - 3 and len(ok) >= 2
    for _, headers, body in rejected:
        assert int(headers["retry-after"]) >= 1
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["message"]
    for _, headers, events in ok:
        assert headers["x-expresslane-lane"] == "express"
        assert events[-1]["usage"]["completion_tokens"] == max_tokens
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert_nothing_leaked(deployment)


# ---------------------------------------------------------------- bad input


def _bad_requests(dep) -> list[tuple[str, object, dict, int]]:
    m = dep.llama_model
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    long_prompt = "express lane " * 1500
    return [
        (chat, b"{", {}, 400),
        (chat, b"[1, 2]", {}, 400),
        (chat, b"", {}, 400),
        (chat, {"messages": msgs}, {}, 400),
        (chat, {"model": 7, "messages": msgs}, {}, 400),
        (chat, {"model": "no-such-model", "messages": msgs}, {}, 404),
        (chat, {"model": m}, {}, 400),
        (chat, {"model": m, "messages": []}, {}, 400),
        (chat, {"model": m, "messages": "hi"}, {}, 400),
        (chat, {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}, {}, 400),
        (chat, {"model": m, "messages": [{"role": "user", "content": 5}]}, {}, 400),
        (chat, {"model": m, "messages": msgs, "max_tokens": 0}, {}, 400),
        (chat, {"model": m, "messages": msgs, "max_tokens": -1}, {}, 400),
        (chat, {"model": m, "messages": msgs, "max_tokens": "5"}, {}, 400),
        (chat, {"model": m, "messages": msgs, "temperature": "hot"}, {}, 400),
        (chat, {"model": m, "messages": msgs, "temperature": 5}, {}, 400),
        (chat, {"model": m, "messages": msgs, "top_p": 0}, {}, 400),
        (chat, {"model": m, "messages": msgs, "n": 2}, {}, 400),
        (chat, {"model": m, "messages": msgs, "n": 0}, {}, 400),
        (chat, {"model": m, "messages": msgs, "logprobs": True, "top_logprobs": 21}, {}, 400),
        (chat, {"model": m, "messages": msgs, "presence_penalty": 5}, {}, 400),
        (chat, {"model": m, "messages": msgs, "logit_bias": {"five": 10}}, {}, 400),
        (chat, {"model": m, "messages": msgs, "min_tokens": 9, "max_tokens": 4}, {}, 400),
        (chat, {"model": m, "messages": msgs, "bad_words": [""]}, {}, 400),
        (chat, {"model": m, "messages": msgs, "response_format": {"type": "json_schema"}}, {}, 400),
        (chat, {"model": m, "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400),
        (chat, {"model": m, "messages": msgs, "stream": "yes"}, {}, 400),
        (chat, {"model": m, "messages": msgs, "stop": 5}, {}, 400),
        (chat, {"model": m, "messages": msgs, "stream_options": {"include_usage": True}}, {}, 400),
        (chat, {"model": m, "messages": msgs, "kv_transfer_params": {"expresslane": {}}}, {}, 400),
        (chat, {"model": m, "messages": msgs}, {"x-expresslane": "maybe"}, 400),
        (comp, {"model": m, "prompt": long_prompt, "max_tokens": 8}, {}, 400),
        (comp, {"model": m, "prompt": "hi", "max_tokens": 5000}, {}, 400),
        (comp, {"model": m, "prompt": ""}, {}, 400),
        (comp, {"model": m, "prompt": [-1]}, {}, 400),
        (comp, {"model": m, "prompt": "hi", "echo": True}, {}, 400),
    ]


def test_malformed_and_unsupported_requests_are_clean_4xx(deployment):
    cases = _bad_requests(deployment)
    assert len(cases) >= 30
    with httpx.Client(timeout=60) as client:
        for path, body, headers, status in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(f"{deployment.router_url}{path}", content=content,
                            headers={"content-type": "application/json", **headers})
            assert r.status_code == status, (body, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"} and err["message"], (body, err)
    assert_nothing_leaked(deployment)
