"""The router's prompt length before the prefill: a cheap upper bound where it decides every check
as the exact count would, the tokenizer's exact count otherwise."""

from __future__ import annotations

import pytest

from services.router import backend
from services.router.app import _prompt_tokens
from services.router.validate import parse_request

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def info(tiny_model):
    from transformers import AutoTokenizer

    path = str(tiny_model("llama"))
    return backend.ModelInfo(name="tiny", root=path, url="http://vllm", max_model_len=2048,
                             tokenizer=AutoTokenizer.from_pretrained(path))


def _chat(messages, **kw):
    return parse_request("chat", {"model": "tiny", "messages": messages, **kw})


ASCII_REQUESTS = [
    _chat([{"role": "user", "content": "hi"}]),
    _chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story. " * 40}]),
    _chat([{"role": "user", "content": "   spaces\tand\ttabs\n\nnewlines   "}]),
    _chat([{"role": "user", "content": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}]),
    _chat([{"role": "user", "content": "~!@#$%^&*()_+{}|:<>?`-=[]\\;',./ 0123456789"}]),
    _chat([{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}]),
    _chat([{"role": "user", "content": "weather?"}], tools=TOOLS),
    _chat([{"role": "user", "content": "go on"}, {"role": "assistant", "content": "Once"}],
          add_generation_prompt=False, continue_final_message=True),
    parse_request("completions", {"model": "tiny", "prompt": "Once upon a time " * 30}),
    parse_request("completions", {"model": "tiny", "prompt": " "}),
]


@pytest.mark.parametrize("req", ASCII_REQUESTS, ids=range(len(ASCII_REQUESTS)))
def test_the_bound_holds_the_exact_count_for_ascii_prompts(info, req):
    bound, exact = backend.prompt_tokens_at_most(info, req), backend.count_prompt_tokens(info, req)
    assert bound is not None and exact <= bound


def test_token_id_prompts_are_their_length(info):
    req = parse_request("completions", {"model": "tiny", "prompt": [5, 6, 7]})
    assert backend.prompt_tokens_at_most(info, req) == backend.count_prompt_tokens(info, req) == 3


@pytest.mark.parametrize("text", ["café", "日本語のテキスト", "emoji 🙂", "\u0958 composed on NFC"])
def test_no_bound_for_text_a_normalizer_may_expand(info, text):
    assert backend.prompt_tokens_at_most(info, _chat([{"role": "user", "content": text}])) is None
    assert backend.prompt_tokens_at_most(
        info, parse_request("completions", {"model": "tiny", "prompt": text})) is None


LONG = "Tell me about express lanes. " * 30  # ~900 characters, far fewer tokens


@pytest.mark.parametrize("max_tokens, max_model_len, smallest_slot, content, counted", [
    (64, 2048, 2048, LONG, False),     # fits everything: the bound is used
    (64, 2048, None, LONG, False),     # no live node: only the model's context decides
    (64, 0, 2048, LONG, False),        # the server did not say its context
    (None, 2048, 2048, LONG, True),    # max_tokens defaults to what the context leaves: exact
    (64, 600, 2048, LONG, True),       # the bound passes the context, exact may: exact
    (64, 2048, 600, LONG, True),       # the bound passes the smallest live slot, exact may: exact
    (64, 2048, 2048, "日本語", True),  # no bound
])
def test_the_exact_count_runs_only_where_the_bound_cannot_decide(info, monkeypatch, max_tokens, max_model_len,
                                                                 smallest_slot, content, counted):
    calls = []
    real = backend.count_prompt_tokens
    monkeypatch.setattr(backend, "count_prompt_tokens", lambda i, r: calls.append(1) or real(i, r))
    model = backend.ModelInfo(**{**info.__dict__, "max_model_len": max_model_len})
    req = _chat([{"role": "user", "content": content}], **({"max_tokens": max_tokens} if max_tokens else {}))
    n = _prompt_tokens(model, req, smallest_slot)
    assert bool(calls) == counted
    exact = real(model, req)
    assert n == exact if counted else n >= exact
