"""Load and abort storms on the real deployment (shorter than bench/chaos.py, outcomes only): every
client is served in full or told 429 with Retry-After, none hangs, none is lost; a burst of client
disconnects leaves no lease, decode slot or staging slot behind, and the lane serves again after."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.conftest import (
    E2E_VLLM_SERVERS, LLAMA_NODES, assert_nothing_leaked, chat_request, sse_events, wait_until,
)
from tests.fixtures.vllm import vllm_greedy

pytestmark = pytest.mark.e2e
VLLM_SERVERS = E2E_VLLM_SERVERS
PROMPTS = ["Tell me a long story.", "Name three rivers.", "Why is the sky blue?", "Count to ten."]
CLIENT_TIMEOUT_S = 600.0  # a client still waiting after this long counts as hung


async def _stream(client: httpx.AsyncClient, dep, body: dict) -> tuple[int, dict, list]:
    async with client.stream("POST", f"{dep.router_url}/v1/chat/completions", json=body,
                             headers={"x-expresslane": "on"}) as r:
        if r.status_code != 200:
            return r.status_code, dict(r.headers), [json.loads(await r.aread())]
        return 200, dict(r.headers), sse_events([line async for line in r.aiter_lines()])


async def test_concurrent_clients_are_served_in_full_or_told_to_retry(deployment):
    num_clients, max_tokens = 24, 12

    async def one(client, i):
        body = chat_request(deployment.llama_model, max_tokens=max_tokens, ignore_eos=True, stream=True,
                            return_token_ids=True, stream_options={"include_usage": True},
                            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        try:
            return await asyncio.wait_for(_stream(client, deployment, body), CLIENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "hung", {}, []

    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(num_clients)))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses  # nothing hung, nothing failed
    assert statuses.count(200) >= len(LLAMA_NODES)
    expected: dict[tuple, list[int]] = {}
    for status, headers, events in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert events[0]["error"]["code"] == "rate_limit_exceeded"
            continue
        prompt_ids = tuple(events[0]["prompt_token_ids"])
        if prompt_ids not in expected:
            expected[prompt_ids] = vllm_greedy(deployment.llama.server, list(prompt_ids), max_tokens,
                                               timeout_s=600.0)
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert ids == expected[prompt_ids]
        assert events[-1]["usage"]["completion_tokens"] == max_tokens
    assert_nothing_leaked(deployment, timeout_s=30.0)


async def test_burst_of_disconnects_frees_everything_and_the_lane_serves_again(deployment):
    num_clients = 40
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        body = chat_request(deployment.llama_model, max_tokens=1500, ignore_eos=True, stream=True)
        tasks = [asyncio.create_task(_stream(client, deployment, body)) for _ in range(num_clients)]
        # Cut everyone off once both decode slots are busy (the rest wait or were told to retry).
        await asyncio.to_thread(wait_until, lambda: all(deployment.health(n)["active"] for n in LLAMA_NODES),
                                120.0, "both llama decode slots busy")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert_nothing_leaked(deployment, timeout_s=30.0)  # how fast: bench/chaos.py
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        status, headers, events = await _stream(client, deployment, chat_request(
            deployment.llama_model, max_tokens=8, ignore_eos=True, stream=True,
            stream_options={"include_usage": True}))
    assert status == 200 and headers["x-expresslane-lane"] == "express"
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert_nothing_leaked(deployment, timeout_s=30.0)
