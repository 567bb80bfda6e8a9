"""SSE chunks and full responses in the shapes vLLM and the openai SDK use."""

from __future__ import annotations

import json

import pytest

from services.router.stream import DONE, ResponseBuilder, usage_dict


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ")
        payload = block[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("return_ids", [False, True])
def test_stream_sequence(endpoint, include_usage, return_ids):
    b = ResponseBuilder(endpoint, "id-1", "m", include_usage=include_usage, return_token_ids=return_ids)
    raw = b.delta("Hel", [5, 6], prompt_token_ids=[1, 2]) + b.delta("", [7]) + b.delta("lo", [8])
    raw += b.finish("stop", None, usage_dict(2, 4))
    ev = _events(raw)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == (1 if include_usage else 0)
    if include_usage:
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    body = [c for c in chunks if c["choices"]]
    key = "delta" if endpoint == "chat" else None
    texts = [(c["choices"][0][key].get("content") if key else c["choices"][0]["text"]) or "" for c in body]
    assert "".join(texts) == "Hello"
    assert body[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
    assert all(c["id"] == "id-1" and c["model"] == "m" for c in chunks)
    if endpoint == "chat":
        assert body[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    if return_ids:
        ids = [t for c in body for t in c["choices"][0].get("token_ids", [])]
        assert ids == [5, 6, 7, 8]
        assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [[1, 2]]
    else:
        assert all("token_ids" not in c["choices"][0] for c in body)


@pytest.mark.parametrize("endpoint,obj", [("chat", "chat.completion"), ("completions", "text_completion")])
def test_full_response(endpoint, obj):
    b = ResponseBuilder(endpoint, "id-2", "m", return_token_ids=True)
    body = b.full("Hello", "length", None, usage_dict(3, 2), [4, 5], [1, 2, 3])
    assert body["object"] == obj
    choice = body["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert text == "Hello" and choice["finish_reason"] == "length" and choice["token_ids"] == [4, 5]
    assert body["usage"]["total_tokens"] == 5 and body["prompt_token_ids"] == [1, 2, 3]


def test_done_marker():
    assert DONE == b"data: [DONE]\n\n"
