"""vLLM's serving code on the express lane: request reading, first-token logprobs, rendering."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from services.router.express import chunk_logprobs
from shared.events import StructuredOutput, TokenLogprobs

vllm_surface = pytest.importorskip("services.router.vllm_surface")
pytest.importorskip("vllm")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

CHUNKS = [
    # (rendered choice of a prefill chunk, TokenLogprobs)
    ({"logprobs": None}, None),
    ({"logprobs": {"content": [{"token": "token_id:5", "logprob": -0.25, "top_logprobs": [
        {"token": "token_id:5", "logprob": -0.25}, {"token": "token_id:9", "logprob": -1.5}]}]}},
     TokenLogprobs(-0.25, 1, [9], [-1.5])),
    ({"logprobs": {"content": [{"token": "token_id:5", "logprob": -3.0, "top_logprobs": []}]}},
     TokenLogprobs(-3.0, 1, [], [])),
    # a sampled token outside the top: vLLM still lists it first
    ({"logprobs": {"content": [{"token": "token_id:7", "logprob": -4.0, "top_logprobs": [
        {"token": "token_id:7", "logprob": -4.0}, {"token": "token_id:1", "logprob": -0.1}]}]}},
     TokenLogprobs(-4.0, 2, [1], [-0.1])),
    ({"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5], "text_offset": [0],
                   "top_logprobs": [{"token_id:5": -0.5, "token_id:2": -2.0}]}},
     TokenLogprobs(-0.5, 1, [2], [-2.0])),
]


@pytest.mark.parametrize("choice,expected", CHUNKS)
def test_chunk_logprobs(choice, expected):
    assert chunk_logprobs(choice) == expected


class _Info:
    name = "m"
    max_model_len = 512

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


@pytest.fixture(scope="module")
def info(tiny_model):
    from transformers import AutoTokenizer

    return _Info(AutoTokenizer.from_pretrained(tiny_model("llama")))


@pytest.fixture(scope="module")
def surface():
    s = vllm_surface.Surface("hermes", None, enable_auto_tools=True)
    s.load()
    assert s.ready, s.error
    return s


PREPARE = [
    # (endpoint, body fields, structured, logprobs, blocker)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutput(kind="json", json_schema=json.dumps(SCHEMA)), None, ""),
    ("chat", {"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object"), None, ""),
    ("chat", {"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput(kind="regex", regex="[ab]+"), None, ""),
    ("chat", {"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}},
     StructuredOutput(kind="choice", choices=["yes", "no"], any_whitespace=False), None, ""),
    ("chat", {"logprobs": True, "top_logprobs": 3}, None, 3, ""),
    ("chat", {"logprobs": True}, None, 0, ""),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, None, None, ""),
    ("completions", {"logprobs": 2}, None, 2, ""),
    ("completions", {"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object"), None, ""),
    ("completions", {"structured_outputs": {"grammar": "root ::= \"a\""}},
     StructuredOutput(kind="grammar", grammar='root ::= "a"'), None, ""),
]


@pytest.mark.parametrize("endpoint,fields,structured,logprobs,blocker", PREPARE)
def test_prepare(surface, info, endpoint, fields, structured, logprobs, blocker):
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
                             else {"prompt": "hi"}), **fields}
    prepared = surface.prepare(endpoint, body, info)
    assert (prepared.structured, prepared.logprobs, prepared.blocker) == (structured, logprobs, blocker)


@pytest.mark.parametrize("fields,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
     "does not match any of the specified `tools`"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_prepare_refuses_what_vllm_refuses(surface, info, fields, message):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ValueError, match=message):
        surface.prepare("chat", body, info)


def _render(surface, info, body, text, logprob):
    tok = info.tokenizer
    prepared = surface.prepare("chat", body, info)
    ids = tok.encode(text, add_special_tokens=False)

    async def outputs():
        b = vllm_surface.OutputBuilder(tok, "r", [1, 2], prepared.logprobs, body.get("stream", False))
        for i in range(0, len(ids), 3):
            chunk = ids[i:i + 3]
            b.add_logprobs(chunk, [logprob(t) for t in chunk])
            yield b.output(tok.decode(chunk), chunk, "stop" if i + 3 >= len(ids) else None, None)

    async def run():
        rendered = surface.render(prepared, info, "chatcmpl-r", [1, 2], outputs())
        if body.get("stream"):
            return [json.loads(line[6:]) for line in [x async for x in rendered]
                    if line.startswith("data: {")]
        return (await rendered).model_dump()

    return asyncio.run(run())


def test_tool_call_rendered_by_vllm_parser(surface, info):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    full = _render(surface, info, body, text, lambda t: None)
    call = full["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    chunks = _render(surface, info, {**body, "stream": True}, text, lambda t: None)
    name, args = "", ""
    for c in chunks:
        for tc in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            name += tc["function"].get("name") or ""
            args += tc["function"].get("arguments") or ""
    assert (name, json.loads(args)) == ("get_weather", {"city": "Paris"})


def test_logprobs_rendered_as_vllm_renders_them(surface, info):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    full = _render(surface, info, body, "ab", lambda t: TokenLogprobs(-0.5, 2, [3], [-0.25]))
    content = full["choices"][0]["logprobs"]["content"]
    tok = info.tokenizer
    ids = tok.encode("ab", add_special_tokens=False)
    assert [c["token"] for c in content] == [tok.decode([t]) for t in ids]
    # vLLM lists the sampled token first, then the most likely others, top_logprobs of them
    assert [c["logprob"] for c in content] == [-0.5] * len(ids)
    assert all(len(c["top_logprobs"]) == 1 and c["top_logprobs"][0]["logprob"] == -0.5 for c in content)


@pytest.mark.parametrize("choice, one_call", [
    ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_tool_choice_carry_vllms_structural_tag(surface, info, choice, one_call):
    """vLLM 0.32's hermes parser constrains tool_choice required/named with an xgrammar structural
    tag (its default, strict tool calling): the decode node gets the tag's JSON text as vLLM hands
    it to xgrammar, and the express lane takes the request."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
    prepared = surface.prepare("chat", body, info)
    assert (prepared.structured.kind, prepared.blocker) == ("structural_tag", "")
    assert prepared.structured.structural_tag == prepared.request.structured_outputs.structural_tag
    fmt = json.loads(prepared.structured.structural_tag)["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["stop_after_first"] is one_call
    assert all(t["begin"].startswith('<tool_call>') and '"get_weather"' in t["begin"] for t in fmt["tags"])


def test_required_and_named_tool_choice_become_vllms_json_schema_without_strict_tags(tmp_path, info):
    """With VLLM_ENFORCE_STRICT_TOOL_CALLING=0 on the prefill and the router, vLLM derives a JSON
    schema for tool_choice required/named instead of a structural tag; the express lane takes both."""
    import os
    import subprocess
    import sys

    info.tokenizer.save_pretrained(tmp_path)
    script = f"""
import json
from transformers import AutoTokenizer
from services.router.vllm_surface import Surface
class Info:
    name = "m"; max_model_len = 512; tokenizer = AutoTokenizer.from_pretrained({str(tmp_path)!r})
s = Surface("hermes", None, True); s.load()
out = []
for choice in ("required", {{"type": "function", "function": {{"name": "get_weather"}}}}):
    p = s.prepare("chat", {{"model": "m", "messages": [{{"role": "user", "content": "hi"}}],
                            "tools": {TOOLS!r}, "tool_choice": choice}}, Info)
    out.append([p.structured.kind, json.loads(p.structured.json_schema), p.blocker])
print(json.dumps(out))
"""
    env = {**os.environ, "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    required, named = json.loads(result.stdout.strip().splitlines()[-1])
    assert required[0] == "json" and required[1]["type"] == "array" and required[2] == ""
    assert named == ["json", TOOLS[0]["function"]["parameters"], ""]


REASONING = [
    # (reasoning parser, endpoint, extra body fields, Surface options, gated by the think tags, blocker)
    ("deepseek_r1", "chat", {}, {}, True, ""),
    ("deepseek_r1", "chat", {"include_reasoning": False}, {}, False,
     "structured output with include_reasoning false and a reasoning parser"),
    ("deepseek_v3", "chat", {}, {}, False, ""),  # without thinking: the identity parser, the grammar from the start
    ("deepseek_v3", "chat", {"chat_template_kwargs": {"thinking": True}}, {}, True, ""),
    ("deepseek_v3", "chat", {"reasoning_effort": "high"}, {}, True, ""),  # vLLM adds enable_thinking for it
    ("deepseek_v3", "chat", {}, {"default_chat_template_kwargs": {"thinking": True}}, True, ""),  # the server's
    ("deepseek_r1", "chat", {}, {"structured_in_reasoning": True}, False, ""),  # vLLM's enable_in_reasoning
    ("qwen3", "chat", {}, {}, False, "structured output with the Qwen3ParserReasoningAdapter reasoning parser"),
    ("deepseek_r1", "completions", {}, {}, True, ""),  # vLLM's engine gates completions too
    ("deepseek_v3", "completions", {}, {}, False, ""),  # (its parser built without kwargs: the identity)
]


@pytest.mark.parametrize("parser,endpoint,fields,options,gated,blocker", REASONING)
def test_structured_output_beside_a_reasoning_parser_carries_its_think_tags(tiny_model, parser, endpoint, fields,
                                                                            options, gated, blocker):
    """vLLM's engine leaves the reasoning unconstrained and the answer under the grammar; for think-tag parsers the
    decode node does the same from the tags' ids (the prompt's verdict comes later, with its token ids); a parser
    the node cannot follow keeps the standard lane and says which."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("llama", plant="reasoning-tool-call"))
    s = vllm_surface.Surface("hermes", parser, enable_auto_tools=True, **options)
    s.load()
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    body = {"model": "m", **prompt,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, **fields}
    prepared = s.prepare(endpoint, body, _Info(tok))
    want = StructuredOutput(kind="json", json_schema=json.dumps(SCHEMA))
    if gated:
        want = msgspec.structs.replace(want, reasoning_start_token_id=tok.convert_tokens_to_ids("<think>"),
                                       reasoning_end_token_id=tok.convert_tokens_to_ids("</think>"))
        assert want.reasoning_end_token_id >= 0 and want.gated and want.reasoning_ended is None
    assert (prepared.structured, prepared.blocker) == (want, blocker)


@pytest.mark.parametrize("args,want", [
    ([], ({}, False)),
    (["--default-chat-template-kwargs", '{"thinking": true}'], ({"thinking": True}, False)),
    (['--structured-outputs-config={"enable_in_reasoning": true}'], ({}, True)),
    (["--structured-outputs-config.enable_in_reasoning", "true"], ({}, True)),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], ({}, False)),
])
def test_the_prefills_template_defaults_and_enable_in_reasoning_come_from_its_arguments(args, want):
    from services.router.config import vllm_structured_flags

    assert vllm_structured_flags(args) == want
    with pytest.raises(ValueError, match="is not JSON"):
        vllm_structured_flags(["--default-chat-template-kwargs", "{thinking"])
