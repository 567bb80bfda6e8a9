"""A decode node killed mid-stream: the client's stream completes with exactly the tokens of an
uninterrupted run (runs last in the package; the nodes are started again afterwards).

The nodes run with ``--fault-stall-after-tokens``: the engine hangs after a few tokens of a request
that started there, so the kill always lands mid-stream however fast the machine decodes."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from tests.e2e.conftest import E2E_VLLM_SERVERS, LLAMA_NODES, assert_nothing_leaked, chat_request, sse_events
from tests.fixtures.vllm import vllm_greedy

pytestmark = pytest.mark.e2e
VLLM_SERVERS = E2E_VLLM_SERVERS
MAX_TOKENS = 300
STALL_AFTER = 10  # completion tokens before the engine of the first node hangs


def _migrations(dep) -> float:
    text = httpx.get(f"{dep.router_url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^expresslane_router_migrations_total\{[^}]*\} (\S+)$", text, re.M))


async def test_decode_node_killed_mid_stream_the_stream_completes_unchanged(deployment):
    for name in LLAMA_NODES:
        deployment.restart_node(name, env={"EXPRESSLANE_FAULT_STALL_AFTER_TOKENS": str(STALL_AFTER)})
    before = _migrations(deployment)
    body = chat_request(deployment.llama_model, max_tokens=MAX_TOKENS, ignore_eos=True, stream=True,
                        return_token_ids=True, stream_options={"include_usage": True})
    lines, killed = [], None
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream("POST", f"{deployment.router_url}/v1/chat/completions", json=body,
                                     headers={"x-expresslane": "on"}) as r:
                assert r.headers["x-expresslane-lane"] == "express"
                async for line in r.aiter_lines():
                    lines.append(line)
                    if killed is None and sum(ln.startswith("data: ") for ln in lines) >= STALL_AFTER // 2:
                        busy = [n for n in LLAMA_NODES if deployment.health(n)["active"]]
                        assert len(busy) == 1
                        killed = busy[0]
                        deployment.procs[killed].signal(signal.SIGKILL)
        events = sse_events(lines)
        prompt_ids = events[0]["prompt_token_ids"]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert killed is not None
        assert ids == vllm_greedy(deployment.llama.server, prompt_ids, MAX_TOKENS, ignore_eos=True,
                                  timeout_s=600.0)  # a loaded 2-core machine can be slow
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert _migrations(deployment) == before + 1
    finally:
        for name in LLAMA_NODES:  # without the fault
            deployment.restart_node(name)
    assert_nothing_leaked(deployment, timeout_s=30.0)
