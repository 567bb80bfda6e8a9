"""Request validation: every malformed body is a 400 naming the parameter; blockers are listed."""

from __future__ import annotations

import json

import pytest

from services.router.errors import ApiError
from services.router.validate import parse_body, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}

BAD = [
    # (endpoint, body overrides (None value deletes), param named in the error)
    ("chat", {"model": None}, "model"),
    ("chat", {"model": 3}, "model"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": -3}, "max_tokens"),
    ("chat", {"max_tokens": "10"}, "max_tokens"),
    ("chat", {"max_tokens": 1.5}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"temperature": 3}, "temperature"),
    ("chat", {"temperature": True}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_k": -5}, "top_k"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": "2"}, "n"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"stop": ["a", 1]}, "stop"),
    ("chat", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat", {"seed": "x"}, "seed"),
    ("chat", {"presence_penalty": 5}, "presence_penalty"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("chat", {"logit_bias": [1]}, "logit_bias"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("chat", {"bad_words": ["ok", ""]}, "bad_words"),
    ("chat", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("chat", {"kv_transfer_params": {}}, "kv_transfer_params"),
    ("chat", {"prompt": "x"}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": "no"}, "echo"),
    ("completions", {"n": 2, "best_of": 1}, "best_of"),
]


def _body(endpoint, overrides):
    body = dict(CHAT if endpoint == "chat" else COMP)
    for k, v in overrides.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return body


@pytest.mark.parametrize("endpoint,overrides,param", BAD)
def test_bad_requests_are_400_naming_the_param(endpoint, overrides, param):
    with pytest.raises(ApiError) as info:
        parse_request(endpoint, _body(endpoint, overrides))
    err = info.value
    assert err.status == 400
    assert err.param == param
    body = err.body()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"[1,2]", b'"s"', b"\xff\xfe"])
def test_bad_json(raw):
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert info.value.status == 400


BLOCKERS = [
    # (endpoint, body overrides, blockers, fields honoured through vLLM's serving code)
    ("chat", {}, [], []),
    ("chat", {"n": 1, "logprobs": False, "presence_penalty": 0, "tool_choice": "none"}, [], []),
    ("chat", {"n": 2}, ["n"], []),
    ("chat", {"logprobs": True, "top_logprobs": 2}, [], ["logprobs", "top_logprobs"]),
    # the remaining sampling fields ride the express lane (the decode node samples with them)
    ("chat", {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1}, [], []),
    ("chat", {"logit_bias": {"5": 10}, "allowed_token_ids": [1, 2], "bad_words": ["x"]}, [], []),
    ("chat", {"response_format": {"type": "json_object"}}, [], ["response_format"]),
    ("chat", {"response_format": {"type": "text"}}, [], []),
    ("chat", {"structured_outputs": {"regex": "a+"}}, [], ["structured_outputs"]),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     [], ["tools", "tool_choice"]),
    ("chat", {"tools": [], "tool_choice": "none"}, [], []),
    ("chat", {"guided_json": {"type": "object"}}, ["guided_json"], []),  # not a vLLM 0.32 field
    ("chat", {"prompt_logprobs": 1}, ["prompt_logprobs"], []),
    ("chat", {"use_beam_search": True}, ["use_beam_search"], []),
    ("chat", {"some_new_param": 1}, ["some_new_param"], []),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     ["multimodal content"], []),
    ("completions", {"prompt": ["a", "b"]}, ["prompt (batch)"], []),
    ("completions", {"echo": True, "logprobs": 2}, ["echo"], ["logprobs"]),
    ("completions", {"logprobs": 0}, [], ["logprobs"]),
    ("completions", {"suffix": "x"}, ["suffix"], []),
    ("completions", {"min_tokens": 3}, [], []),
]


@pytest.mark.parametrize("endpoint,overrides,blockers,vllm_fields", BLOCKERS)
def test_express_blockers(endpoint, overrides, blockers, vllm_fields):
    req = parse_request(endpoint, _body(endpoint, overrides))
    assert sorted(req.express_blockers) == sorted(blockers)
    assert sorted(req.vllm_fields) == sorted(vllm_fields)


def test_sampling_fields_parsed():
    body = {"model": "m", "prompt": "x", "max_tokens": 9, "min_p": 0.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.3, "min_tokens": 4,
            "logit_bias": {"7": -100, "9": 2.5}, "allowed_token_ids": [7, 9, 11], "bad_words": ["no"]}
    req = parse_request("completions", parse_body(json.dumps(body).encode()))
    assert (req.min_p, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.1, 0.5, -0.5, 1.3)
    assert (req.min_tokens, req.logit_bias, req.allowed_token_ids, req.bad_words) == (
        4, {7: -100.0, 9: 2.5}, [7, 9, 11], ["no"])
    assert req.express_blockers == []


def test_fields_parsed():
    body = {
        "model": "m", "prompt": [1, 2, 3], "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 20, "max_completion_tokens": 9,
        "temperature": 0, "top_p": 0.5, "top_k": 4, "seed": 7, "stop": "END",
        "stop_token_ids": [2], "ignore_eos": True, "return_token_ids": True,
    }
    req = parse_request("completions", parse_body(json.dumps(body).encode()))
    assert (req.prompt, req.stream, req.include_usage, req.max_tokens) == ([1, 2, 3], True, True, 9)
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (0, 0.5, 4, 7)
    assert (req.stop, req.stop_token_ids, req.ignore_eos, req.return_token_ids) == (["END"], [2], True, True)
    assert req.express_blockers == []
