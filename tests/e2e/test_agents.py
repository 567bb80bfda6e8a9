"""What agents send rides the express lane: tool calls, structured output, logprobs, reasoning.

With the official ``openai`` SDK against the router, express-lane output equals vLLM alone's at
temperature 0. Tool calls and reasoning run on a planted tiny Llama (``make-model --plant
reasoning-tool-call``: it greedily thinks, then calls ``get_weather``), served by one extra prefill
vLLM with vLLM's ``hermes`` and ``deepseek_r1`` parsers, one decode node and a router configured
from the same vLLM flags; structured output and logprobs run on the shared deployment's llama.
tool_choice required and named run on a planted tool-call Llama (``--plant tool-call``) served
with vLLM's ``hermes`` parser alone, under vLLM's defaults: its parser constrains them with an
xgrammar structural tag, which the decode node compiles as vLLM does.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from openai import OpenAI

from infra.processes import free_port
from infra.up import Proc, stop_all
from tests.e2e.conftest import CLI, E2E_VLLM_SERVERS, HEARTBEAT_MS, wait_until
from tests.fixtures.prefill import Express

AGENT_ARGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1")
PLANT = "reasoning-tool-call"
TOOL_ARGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
TOOL_PLANT = "tool-call"
VLLM_SERVERS = [*E2E_VLLM_SERVERS, Express("llama", plant=PLANT, vllm_args=AGENT_ARGS),
                Express("llama", plant=TOOL_PLANT, vllm_args=TOOL_ARGS)]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


class Agent:
    def __init__(self, router_url: str, vllm_url: str, model: str) -> None:
        self.model = model
        self.router = OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=120)
        self.vllm = OpenAI(base_url=f"{vllm_url}/v1", api_key="none", max_retries=0, timeout=120)


def _stack(deployment, express_vllm, plant: str, vllm_args: tuple[str, ...], node: str):
    """A planted model's prefill (with vLLM's parser flags), one decode node, a router with the same flags."""
    prefill = express_vllm("llama", plant=plant, vllm_args=vllm_args)
    model = str(prefill.model_dir)
    port, router_port = free_port(), free_port()
    procs = [
        Proc(f"{node}-decode", CLI + ["decode", "--nats-url", deployment.nats_url, "--model", model,
                                      "--node-id", f"{node}-0", "--slots", "1", "--dtype", "float32",
                                      "--heartbeat-ms", str(HEARTBEAT_MS), "--http-port", str(port)],
             f"http://127.0.0.1:{port}/health"),
        # no warm leases: the shared deployment's leak checks count the coordinator's leases
        Proc(f"{node}-router", CLI + ["router", "--nats-url", deployment.nats_url, "--port", str(router_port),
                                      "--prefill-url", prefill.url, "--vllm-args", " ".join(vllm_args),
                                      "--warm-leases", "0", "--claim-wait-ms", "1000",
                                      "--first-decode-timeout-s", "20", "--token-timeout-s", "3"],
             f"http://127.0.0.1:{router_port}/health"),
    ]
    try:
        for proc in procs:
            proc.env = dict(deployment.env)
            proc.start(deployment.log_dir)
            proc.wait_healthy(300)
        router_url = f"http://127.0.0.1:{router_port}"
        wait_until(lambda: httpx.get(f"{router_url}/health").json()["express_capacity"].get(model),
                   30.0, "the planted model's decode node seen by the router")
        yield Agent(router_url, prefill.url, model)
    finally:
        stop_all(procs, grace_s=10.0)


@pytest.fixture(scope="module")
def agent(deployment, express_vllm):
    """The reasoning-then-tool-call model with the hermes and deepseek_r1 parsers."""
    yield from _stack(deployment, express_vllm, PLANT, AGENT_ARGS, "agent")


@pytest.fixture(scope="module")
def tool_agent(deployment, express_vllm):
    """The tool-call model with the hermes parser alone, vLLM's strict tool calling left at its default."""
    yield from _stack(deployment, express_vllm, TOOL_PLANT, TOOL_ARGS, "tools")


@pytest.fixture(scope="module")
def llama(deployment):
    """The shared deployment's router once vLLM's serving code is loaded in it."""
    wait_until(lambda: httpx.get(f"{deployment.router_url}/health").json().get("vllm_surface"), 60.0,
               "vLLM's serving code loaded in the router")
    return Agent(deployment.router_url, deployment.llama.url, deployment.llama_model)


def _create(client: OpenAI, **kw):
    """(parsed response, lane header, reason header)."""
    raw = client.chat.completions.with_raw_response.create(temperature=0, **kw)
    return raw.parse(), raw.headers.get("x-expresslane-lane"), raw.headers.get("x-expresslane-reason")


def _full(resp) -> dict:
    msg = resp.choices[0].message
    extra = msg.model_extra or {}
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    return {"content": msg.content, "reasoning": extra.get("reasoning"), "tool_calls": calls,
            "finish_reason": resp.choices[0].finish_reason}


THINK_START = "<think>"


def _streamed(stream) -> dict:
    """Reassemble a chat stream: content, reasoning and tool calls from their deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    # vLLM's own stream puts the start-of-thinking tag into the reasoning text when one of its chunks
    # carries that token together with the next ones, which happens when its engine outruns its API
    # server (so, on the host's speed); streamed one token a chunk, as the express lane streams, the
    # tag is not reasoning. The tag is left out of both sides.
    reasoning = reasoning.removeprefix(THINK_START)
    return {"content": content or None, "reasoning": reasoning or None,
            "tool_calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            "finish_reason": finish}


def _both(a: Agent, stream: bool, **kw) -> tuple[dict, dict, str]:
    """(express lane's answer, vLLM alone's answer, lane) for one chat request."""
    if stream:
        raw = a.router.chat.completions.with_raw_response.create(model=a.model, temperature=0, stream=True, **kw)
        express, lane = _streamed(raw.parse()), raw.headers.get("x-expresslane-lane")
        alone = _streamed(a.vllm.chat.completions.create(model=a.model, temperature=0, stream=True, **kw))
        return express, alone, lane
    resp, lane, _ = _create(a.router, model=a.model, **kw)
    return _full(resp), _full(_create(a.vllm, model=a.model, **kw)[0]), lane


# ---------------------------------------------------------------- tool calls and reasoning


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_reasoning_equal_vllm_alone(agent, stream):
    express, alone, lane = _both(agent, stream, messages=ASK, tools=TOOLS, max_tokens=40)
    assert lane == "express"
    assert express == alone
    assert express["tool_calls"] == [("get_weather", {"city": "Paris"})]  # a real call, not "none"
    assert express["reasoning"] and "weather" in express["reasoning"]
    assert express["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split_without_tools_equals_vllm_alone(agent, stream):
    express, alone, lane = _both(agent, stream, messages=ASK, max_tokens=40)
    assert lane == "express"
    assert express == alone and express["reasoning"] and "<tool_call>" in express["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_after_the_reasoning_equals_vllm_alone(agent, stream):
    """deepseek_r1 with a JSON schema: vLLM leaves the reasoning unconstrained and puts the answer after
    ``</think>`` under the schema; the express lane's decode node does the same (the grammar's think-tag gate)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    express, alone, lane = _both(agent, stream, messages=ASK, response_format=fmt, max_tokens=60)
    assert lane == "express"
    assert express == alone
    assert express["reasoning"] and "weather" in express["reasoning"]  # the planted reasoning, unconstrained
    assert express["content"].startswith("{") and "<tool_call>" not in express["content"]  # the answer constrained


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_after_the_reasoning_equals_vllm_alone(agent, stream):
    express, alone, lane = _both(agent, stream, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60)
    assert lane == "express"
    assert express == alone and express["reasoning"] and express["tool_calls"]


def test_tool_call_loop_stays_on_the_express_lane(agent):
    messages = list(ASK)
    for turn in range(5):
        resp, lane, reason = _create(agent.router, model=agent.model, messages=messages, tools=TOOLS,
                                     max_tokens=40)
        alone = _create(agent.vllm, model=agent.model, messages=messages, tools=TOOLS, max_tokens=40)[0]
        assert (lane, turn) == ("express", turn), reason
        assert _full(resp) == _full(alone)
        call = resp.choices[0].message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"sunny, {20 + turn} C"}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_equal_vllm_alone(tool_agent, stream):
    """vLLM constrains these with its parser's xgrammar structural tag; the decode node applies the same."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        express, alone, lane = _both(tool_agent, stream, messages=ASK, tools=TOOLS, tool_choice=choice,
                                     max_tokens=40)
        assert (lane, choice) == ("express", choice)
        assert express == alone, choice
        assert express["tool_calls"] == [("get_weather", {"city": "Paris"})], choice


# ---------------------------------------------------------------- 400s alike on both lanes


@pytest.mark.parametrize("fields", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "ten"}}}}}},
])
def test_invalid_requests_get_vllms_400_on_both_lanes(agent, fields):
    body = {"model": agent.model, "messages": ASK, "max_tokens": 8, **fields}
    url = str(agent.router.base_url).rstrip("/")
    answers = [httpx.post(f"{url}/chat/completions", json=body, headers={"x-expresslane": lane}, timeout=60)
               for lane in ("on", "off")]
    alone = httpx.post(f"{str(agent.vllm.base_url).rstrip('/')}/chat/completions", json=body, timeout=60)
    assert alone.status_code == 400, alone.text
    for r in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == alone.json()["error"]["message"]
        assert r.json()["error"]["type"] == alone.json()["error"]["type"]


# ---------------------------------------------------------------- structured output and logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_equals_vllm_alone(llama, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    express, alone, lane = _both(llama, stream, messages=ASK, response_format=fmt, max_tokens=48)
    assert lane == "express"
    assert express["content"] == alone["content"]
    if express["finish_reason"] == "stop":
        value = json.loads(express["content"])
        assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, abs_tol=1e-4))


def _chat_logprobs(resp_or_chunks, stream: bool) -> list[tuple]:
    entries = []
    if stream:
        for chunk in resp_or_chunks:
            for choice in chunk.choices:
                entries += (choice.logprobs.content or []) if choice.logprobs else []
    else:
        entries = resp_or_chunks.choices[0].logprobs.content
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


def _same_logprobs(a: list[tuple], b: list[tuple]) -> None:
    assert [x[0] for x in a] == [x[0] for x in b] and [x[2] for x in a] == [x[2] for x in b]
    for x, y in zip(a, b):
        assert _close(x[1], y[1]), (x, y)
        assert [t for t, _ in x[3]] == [t for t, _ in y[3]], (x, y)
        assert all(_close(p, q) for (_, p), (_, q) in zip(x[3], y[3])), (x, y)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_vllm_alone(llama, stream):
    kw = dict(model=llama.model, messages=[{"role": "user", "content": "Tell me a long story."}],
              temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=stream)
    raw = llama.router.chat.completions.with_raw_response.create(**kw)
    assert raw.headers.get("x-expresslane-lane") == "express", raw.headers.get("x-expresslane-reason")
    _same_logprobs(_chat_logprobs(raw.parse(), stream), _chat_logprobs(llama.vllm.chat.completions.create(**kw), stream))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_vllm_alone(llama, stream):
    kw = dict(model=llama.model, prompt="Once upon a time", temperature=0, max_tokens=12, logprobs=2,
              stream=stream)

    def flat(resp):
        chunks = list(resp) if stream else [resp]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            for choice in c.choices:
                if choice.logprobs:
                    for key in out:
                        out[key] += getattr(choice.logprobs, key) or []
        return out

    raw = llama.router.completions.with_raw_response.create(**kw)
    assert raw.headers.get("x-expresslane-lane") == "express", raw.headers.get("x-expresslane-reason")
    express, alone = flat(raw.parse()), flat(llama.vllm.completions.create(**kw))
    assert express["tokens"] == alone["tokens"] and express["text_offset"] == alone["text_offset"]
    assert all(_close(a, b) for a, b in zip(express["token_logprobs"], alone["token_logprobs"]))
    for a, b in zip(express["top_logprobs"], alone["top_logprobs"]):
        assert list(a) == list(b) and all(_close(a[k], b[k]) for k in a)
