"""OpenAI response bodies for chat and completions: SSE chunks while streaming, one JSON at the end.

Contract (``ResponseBuilder``), matching what vLLM's own server sends:
- chat stream: a first chunk with ``delta={"role": "assistant", "content": ""}``, one chunk per
  text delta ``delta={"content": ...}``, a last chunk with ``delta={}`` and ``finish_reason``;
  completions stream: ``choices=[{"index": 0, "text": ..., "finish_reason": ...}]``.
- ``stream_options.include_usage``: one more chunk with ``choices=[]`` and the usage; then
  ``data: [DONE]``.
- ``return_token_ids``: each chunk carries the ``token_ids`` it covers, the first one the
  ``prompt_token_ids``; the full response carries both.
- An error after the stream began is sent as ``data: {"error": {...}}`` followed by ``[DONE]``.

Pure: builds dicts and bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

DONE = b"data: [DONE]\n\n"
# compact UTF-8 JSON, the bytes json.dumps(separators=(",", ":"), ensure_ascii=False) gives for these
# chunks (floats aside: the shortest form of the same value, 1e-05 as 0.00001), at ~1/10 of the cost: one
# chunk a token for every stream the router relays
_JSON = msgspec.json.Encoder()


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponseBuilder:
    endpoint: Literal["chat", "completions"]
    response_id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _started: bool = False

    @property
    def _object(self) -> str:
        if self.endpoint == "chat":
            return "chat.completion.chunk"
        return "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _choice(self, text: str | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
        if self.endpoint == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def start(self, prompt_token_ids: list[int] | None = None) -> bytes:
        """The opening chunk (chat: the assistant role; completions: nothing)."""
        if self._started:
            return b""
        self._started = True
        if self.endpoint != "chat":
            return b""
        chunk = self._chunk(self._choice("", None, first=True))
        if self.return_token_ids:
            chunk["prompt_token_ids"] = prompt_token_ids
            chunk["choices"][0]["token_ids"] = []
        return sse(chunk)

    def delta(self, text: str, token_ids: list[int], prompt_token_ids: list[int] | None = None) -> bytes:
        """A content chunk; empty bytes when there is nothing to say."""
        head = self.start(prompt_token_ids)
        if not text and not (self.return_token_ids and token_ids):
            return head
        chunk = self._chunk(self._choice(text, None, first=False))
        if self.return_token_ids:
            chunk["choices"][0]["token_ids"] = list(token_ids)
            if self.endpoint == "completions" and head == b"" and prompt_token_ids is not None:
                chunk["prompt_token_ids"] = prompt_token_ids
        return head + sse(chunk)

    def finish(self, finish_reason: str, stop_reason: str | None, usage: dict[str, int]) -> bytes:
        """The closing chunks: finish reason, usage if asked, ``[DONE]``."""
        choice = self._choice(None if self.endpoint == "chat" else "", finish_reason, first=False)
        choice["stop_reason"] = stop_reason
        if self.return_token_ids:
            choice["token_ids"] = []
        out = self.start() + sse(self._chunk(choice))
        if self.include_usage:
            chunk = self._chunk(choice)
            chunk["choices"] = []
            chunk["usage"] = usage
            out += sse(chunk)
        return out + DONE

    def full(
        self,
        text: str,
        finish_reason: str,
        stop_reason: str | None,
        usage: dict[str, int],
        token_ids: list[int],
        prompt_token_ids: list[int] | None,
    ) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.endpoint == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0, "text": text, "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": stop_reason,
            }
            obj = "text_completion"
        body: dict[str, Any] = {
            "id": self.response_id, "object": obj, "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage,
        }
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            body["prompt_token_ids"] = prompt_token_ids
        return body


def sse_error(body: dict[str, Any]) -> bytes:
    """An error inside an already started stream, then the end of the stream."""
    return sse(body) + DONE
