"""The express lane through the official ``openai`` SDK, every component real: the tokens equal
vLLM's own greedy tokens, text and usage equal the standard lane's, both lanes share one prefill."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_VLLM_SERVERS
from tests.fixtures.vllm import vllm_greedy

pytestmark = pytest.mark.e2e
VLLM_SERVERS = E2E_VLLM_SERVERS

PROMPTS = [
    "Tell me about express lanes on a highway.",
    "Write a haiku about the sea",
]
MAX_TOKENS = 24


def _client(deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", timeout=180.0,
                              max_retries=0)


async def _stream_chat(client, model: str, prompt: str, lane: str):
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True,
        max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"x-expresslane": lane})
    served_by = raw.headers["x-expresslane-lane"]
    text, ids, prompt_ids, usage, finish = "", [], None, None, None
    async for chunk in raw.parse():
        extra = chunk.model_extra or {}
        if extra.get("prompt_token_ids") is not None:
            prompt_ids = extra["prompt_token_ids"]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
    return served_by, text, ids, prompt_ids, usage, finish


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
async def test_sdk_streaming_chat_equals_vllm_greedy(deployment, arch, request):
    if arch == "deepseek_v3":
        request.getfixturevalue("deepseek_node")
    prefill = deployment.llama if arch == "llama" else deployment.deepseek
    model = str(prefill.model_dir)
    client = _client(deployment)
    for prompt in PROMPTS:
        started_before = prefill.stats()["decode_started"]
        lane, text, ids, prompt_ids, usage, finish = await _stream_chat(client, model, prompt, "on")
        assert lane == "express"
        # the prefill's connector started the decode itself, the moment vLLM had the first token
        assert prefill.stats()["decode_started"] == started_before + 1
        assert prompt_ids, "the first chunk carries the prompt's token ids"
        # vLLM alone (no kv_transfer_params: the connector is a strict no-op), same prompt ids
        assert ids == vllm_greedy(prefill.server, prompt_ids, MAX_TOKENS, ignore_eos=True)
        assert len(ids) == MAX_TOKENS and finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(prompt_ids), MAX_TOKENS, len(prompt_ids) + MAX_TOKENS)
        # the standard lane of the same deployment, served by the same prefill vLLM
        s_lane, s_text, s_ids, s_prompt_ids, s_usage, s_finish = await _stream_chat(client, model, prompt, "off")
        assert s_lane == "standard"
        assert (s_text, s_ids, s_prompt_ids, s_finish) == (text, ids, prompt_ids, finish)
        assert (s_usage.prompt_tokens, s_usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    await client.close()


async def test_completions_api_both_lanes_stream_and_not(deployment):
    client = _client(deployment)
    model = deployment.llama_model
    kwargs = dict(model=model, prompt="The express lane", max_tokens=16, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    results = {}
    for lane in ("on", "off"):
        raw = await client.completions.with_raw_response.create(**kwargs, extra_headers={"x-expresslane": lane})
        assert raw.headers["x-expresslane-lane"] == {"on": "express", "off": "standard"}[lane]
        full = raw.parse()
        choice = full.choices[0]
        assert full.usage.completion_tokens == 16 and choice.finish_reason == "length"
        stream = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                 extra_headers={"x-expresslane": lane})
        text, ids, usage = "", [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.text or ""
                ids += (c.model_extra or {}).get("token_ids") or []
        assert (text, ids) == (choice.text, choice.model_extra["token_ids"])
        assert usage.completion_tokens == 16 and usage.prompt_tokens == full.usage.prompt_tokens
        results[lane] = (choice.text, ids, full.usage.prompt_tokens)
    assert results["on"] == results["off"]
    prompt_ids = httpx.post(f"{deployment.llama.url}/tokenize",
                            json={"model": model, "prompt": "The express lane"}).json()["tokens"]
    assert results["on"][1] == vllm_greedy(deployment.llama.server, prompt_ids, 16)
    await client.close()


async def test_stop_strings_and_eos_end_the_express_stream(deployment):
    client = _client(deployment)
    model = deployment.llama_model
    base = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=20,
                                           temperature=0, extra_headers={"x-expresslane": "on"})
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"completion too short to pick a stop string from: {text!r}"
    results = {}
    for lane in ("on", "off"):
        r = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=20,
                                            temperature=0, stop=[stop], extra_headers={"x-expresslane": lane})
        c = r.choices[0]
        results[lane] = (c.text, c.finish_reason, r.usage.completion_tokens)
    assert results["on"] == results["off"]
    assert results["on"][1] == "stop" and stop not in results["on"][0]
    assert results["on"][0] == text[: text.index(stop)]
    await client.close()


SAMPLING_CASES = [
    {"repetition_penalty": 1.6},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"logit_bias": "ban the plain run's 2nd and 5th tokens, favour one", "bad_words": ["the", " and"]},
    {"allowed_token_ids": list(range(40, 400)), "min_tokens": 20, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("fields", SAMPLING_CASES)
async def test_sampling_fields_ride_the_express_lane_with_vllms_tokens(deployment, fields):
    """Penalties, logit_bias, allowed_token_ids, bad_words and min_tokens: the decode node samples
    with them as vLLM does (greedy, so the tokens are comparable)."""
    # the tiny model's plain greedy run first repeats a token at about 40: penalties then matter
    model, prompt, n = deployment.llama_model, "The express lane carries", 48
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}
    plain = vllm_greedy(deployment.llama.server, prompt, n, ignore_eos=False)
    if isinstance(fields.get("logit_bias"), str):  # relative to the run without it
        fields = {**fields, "logit_bias": {str(plain[1]): -100, str(plain[4]): -100, "123": 3.0}}
    body.update(fields)
    async with httpx.AsyncClient(timeout=180) as client:
        express = await client.post(f"{deployment.router_url}/v1/completions", json=body,
                                    headers={"x-expresslane": "on"})
        alone = await client.post(f"{deployment.llama.url}/v1/completions", json=body)
    assert express.status_code == 200 and express.headers["x-expresslane-lane"] == "express", express.text
    assert alone.status_code == 200, alone.text
    ids = express.json()["choices"][0]["token_ids"]
    assert ids == alone.json()["choices"][0]["token_ids"]
    assert ids != plain  # the fields mattered
