"""The decode engine's greedy tokens equal the real vLLM's (CPU, float32) for the same checkpoint.

Three prompts per family, as token ids (no tokenizer in between); vLLM generates with
``ignore_eos`` and temperature 0, the engine prefills the same ids and decodes greedily. With
logprobs, each token's logprob and top 5 equal vLLM's (1e-4, float32); under a json_schema the
tokens and the finish reason equal vLLM's (xgrammar on both sides).
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams, StructuredOutput
from tests.fixtures.vllm import Plain, vllm_greedy

PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 8], [1, 200, 201, 9, 77, 31, 12, 4, 66, 150, 151, 152, 5], [1, 88, 121, 150]]
NUM_TOKENS = 24

pytestmark = pytest.mark.vllm
ARCHS = ["llama", "qwen2", "qwen3", "deepseek_v3"]
VLLM_SERVERS = [Plain(arch) for arch in ARCHS]


def engine_greedy(engine: Engine, prompt: list[int], num_tokens: int) -> list[int]:
    first = int(engine.prefill(0, prompt).argmax())
    engine.start(0, first, SamplingParams(max_tokens=num_tokens - 1, ignore_eos=True))
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
    engine.release(0)
    return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_vllm(tiny_model, vllm_servers, arch):
    torch.set_num_threads(1)
    model_dir = tiny_model(arch)
    server = vllm_servers.get(model_dir, dtype="float32")
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=128, dtype=torch.float32)
    for prompt in PROMPTS:
        expected = vllm_greedy(server, prompt, NUM_TOKENS)
        assert len(expected) == NUM_TOKENS
        assert engine_greedy(engine, prompt, NUM_TOKENS) == expected
    assert engine.free_slots() == [0] and engine.active_slots() == []


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


def vllm_completion(server, prompt: list[int], **body) -> dict:
    import httpx

    body = {"model": server.model_name, "prompt": prompt, "temperature": 0.0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]


def engine_run(engine: Engine, prompt: list[int], sampling: SamplingParams, grammar=None):
    """The engine's tokens and logprobs after its own prefill (its first token under the grammar,
    with its logprobs, as the prefill computes them)."""
    import xgrammar as xgr

    from services.decode.engine import logprobs as lpmod

    logits = engine.prefill(0, prompt)[None].clone()
    if grammar is not None:
        mask = xgr.allocate_token_bitmask(1, engine.cfg.vocab_size)
        xgr.GrammarMatcher(engine.grammars.compile(grammar)).fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
    first = int(logits.argmax())
    n = sampling.logprobs or 0
    lp, rank, top_lp, top_ids = lpmod.compute(logits, torch.tensor([first]), n)
    lps = lpmod.to_wire(lp.tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist())
    engine.start(0, first, sampling)
    tokens, reason = [first], None
    while engine.active_slots():
        out = engine.step()[0]
        tokens, lps, reason = tokens + out.token_ids, lps + (out.logprobs or []), out.finish_reason
    engine.release(0)
    return tokens, lps, reason


def test_logprobs_and_json_schema_equal_vllm(tiny_model, vllm_servers):
    """logprobs=5 at temperature 0: the same tokens, each token's logprob and its top 5 (ids and
    values to 1e-4, float32); a json_schema request: the same tokens and the same end."""
    torch.set_num_threads(1)
    model_dir = tiny_model("llama")
    server = vllm_servers.get(model_dir, dtype="float32")
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=128, dtype=torch.float32)
    prompt = PROMPTS[0]
    want = vllm_completion(server, prompt, max_tokens=12, logprobs=5, ignore_eos=True)
    tokens, lps, _ = engine_run(engine, prompt, SamplingParams(max_tokens=11, ignore_eos=True, logprobs=5))
    assert tokens == want["token_ids"]
    got_lp = [lp.logprob for lp in lps]
    assert max(abs(a - b) for a, b in zip(got_lp, want["logprobs"]["token_logprobs"], strict=True)) < 1e-4
    for lp, top in zip(lps, want["logprobs"]["top_logprobs"], strict=True):
        top_ids = [int(k.removeprefix("token_id:")) for k in top]
        assert sorted(lp.top_ids) == sorted(top_ids)
        assert max(abs(v - top[f"token_id:{t}"]) for t, v in zip(lp.top_ids, lp.top_logprobs)) < 1e-4

    import json

    # vLLM's xgrammar backend takes any_whitespace from the server (--structured-outputs-config
    # disable_any_whitespace, off by default), not from the request
    spec = StructuredOutput(kind="json", json_schema=json.dumps(SCHEMA), any_whitespace=True)
    want = vllm_completion(server, prompt, structured_outputs={"json": SCHEMA}, max_tokens=40)
    tokens, _, reason = engine_run(engine, prompt, SamplingParams(max_tokens=39, structured=spec), spec)
    assert tokens == want["token_ids"]
    assert reason == want["finish_reason"]
