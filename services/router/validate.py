"""OpenAI request validation: raw body bytes -> ``ParsedRequest``, or ``ApiError`` with the right 4xx.

Contract:
- Malformed input (not JSON, not an object, wrong types, values out of range, missing required
  fields, empty prompt) raises ``ApiError`` 400 naming the parameter; a client-supplied
  ``kv_transfer_params`` is refused (the router owns that field).
- Nothing is dropped silently: every parameter the express lane cannot honour with its value is
  listed in ``ParsedRequest.express_blockers`` (``"n"``, ``"echo"``, ...), so the lane policy
  sends the request to the standard lane or refuses it.
- What agents send (``tools``, ``tool_choice``, ``response_format``, ``structured_outputs``,
  ``logprobs``/``top_logprobs``) is listed in ``ParsedRequest.vllm_fields`` instead: the express
  lane honours it through vLLM's own serving code (services.router.vllm_surface), which also
  judges its values; a router without vLLM turns them into blockers. Unknown fields are blockers too: the router
  cannot know that the express lane honours them; vLLM will judge them on the standard lane.
- Whether the model exists, the prompt fits and the lane is open is decided later (needs state).

Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from services.router.errors import ApiError, bad_request

Endpoint = Literal["chat", "completions"]

ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})

# Fields the express lane honours whatever their value (rendering is done by vLLM in both lanes).
_HONOURED = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "return_token_ids", "user",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "add_special_tokens", "documents", "metadata", "store", "service_tier", "request_id",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
    "logit_bias", "allowed_token_ids", "bad_words",
})

# Fields the express lane honours only at their neutral value: name -> predicate "is neutral".
_NEUTRAL = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "prompt_logprobs": lambda v: v is None,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "functions": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v in (None, 1),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "truncate_prompt_tokens": lambda v: v is None,
    "priority": lambda v: v in (None, 0),
    "return_tokens_as_token_ids": lambda v: not v,
}

# Fields the express lane honours through vLLM's serving code (services.router.vllm_surface):
# name -> predicate "is neutral" (a neutral value needs nothing).
_VLLM_FIELDS = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "structured_outputs": lambda v: v is None,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v in (None, 0),
}

_NUMBER = (int, float)


@dataclass
class ParsedRequest:
    """A syntactically valid OpenAI request; ``None`` sampling values mean "server default"."""

    endpoint: Endpoint
    model: str
    body: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # completions: one text or one token-id list
    express_blockers: list[str] = field(default_factory=list)
    vllm_fields: list[str] = field(default_factory=list)  # honoured through vLLM's serving code


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _get(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad_request(f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name)
    return v


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode the JSON body; 400 for anything but a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if m.get("role") not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {m.get('role')!r}",
                "messages",
            )
        content = m.get("content")
        if content is None and m.get("role") == "assistant":
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            continue
        raise bad_request(
            f"messages[{i}].content must be a string or an array of content parts", "messages"
        )
    return msgs


def _is_multimodal(msgs: list[dict]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"])
        for m in msgs
    )


def _prompt(body: dict) -> tuple[str | list[int], bool]:
    """The completions prompt and whether it is a batch (several prompts)."""
    p = body.get("prompt")
    if isinstance(p, str):
        if not p:
            raise bad_request("'prompt' must not be empty", "prompt")
        return p, False
    if isinstance(p, list) and p:
        if all(_is_int(t) and t >= 0 for t in p):
            return p, False
        if all(isinstance(s, str) and s for s in p):
            return p[0], len(p) > 1
        if all(isinstance(s, list) and s and all(_is_int(t) and t >= 0 for t in s) for s in p):
            return p[0], len(p) > 1
    raise bad_request(
        "'prompt' must be a non-empty string, array of strings, array of token ids or array of "
        "token-id arrays",
        "prompt",
    )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad_request("'stop' must be a string or an array of strings", "stop")


def parse_request(endpoint: Endpoint, body: dict[str, Any]) -> ParsedRequest:
    """Validate a decoded body for ``endpoint``; raises ``ApiError`` (400) on malformed input."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    if "kv_transfer_params" in body:
        raise bad_request("'kv_transfer_params' is reserved for the router", "kv_transfer_params")
    req = ParsedRequest(endpoint=endpoint, model=model, body=body)
    if endpoint == "chat":
        req.messages = _messages(body)
        if _is_multimodal(req.messages):
            req.express_blockers.append("multimodal content")
        if body.get("prompt") is not None:
            raise bad_request("'prompt' is not a chat completions parameter; use 'messages'", "prompt")
    else:
        req.prompt, is_batch = _prompt(body)
        if is_batch:
            req.express_blockers.append("prompt (batch)")
        if body.get("messages") is not None:
            raise bad_request("'messages' is not a completions parameter; use 'prompt'", "messages")
    _sampling(body, req)
    _neutral_checks(body, req)
    return req


def _sampling(body: dict, req: ParsedRequest) -> None:
    req.stream = bool(_get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False))
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if opts and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    req.include_usage = bool(
        _get(opts, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    )
    for name in ("max_completion_tokens", "max_tokens"):
        v = _get(body, name, _is_int, "an integer", None)
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be at least 1, got {v}", param=name)
            req.max_tokens = v if req.max_tokens is None else min(req.max_tokens, v)
    req.temperature = _get(body, "temperature", lambda v: _is_num(v) and 0 <= v <= 2,
                           "a number between 0 and 2")
    req.top_p = _get(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")
    req.top_k = _get(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1")
    req.seed = _get(body, "seed", _is_int, "an integer")
    n = _get(body, "n", lambda v: _is_int(v) and 1 <= v <= 128, "an integer between 1 and 128", 1)
    best_of = _get(body, "best_of", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    if best_of is not None and best_of < n:
        raise bad_request("'best_of' must be at least 'n'", "best_of")
    req.stop = _stop(body)
    req.stop_token_ids = list(_get(
        body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
        "an array of token ids", [],
    ))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "return_token_ids"):
        val = _get(body, name, lambda v: isinstance(v, bool), "a boolean")
        if val is not None:
            setattr(req, name, val)
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(req, name, _get(body, name, lambda v: _is_num(v) and -2 <= v <= 2, "a number between -2 and 2"))
    req.repetition_penalty = _get(body, "repetition_penalty", lambda v: _is_num(v) and v > 0, "a number > 0")
    req.min_p = _get(body, "min_p", lambda v: _is_num(v) and 0 <= v <= 1, "a number between 0 and 1")
    req.min_tokens = _get(body, "min_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0", 0)
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request(f"'min_tokens' ({req.min_tokens}) must be at most 'max_tokens' ({req.max_tokens})",
                          param="min_tokens")
    bias = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object", {})
    for key, value in bias.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit() and int(key) >= 0) or not (
                _is_num(value) and -100 <= value <= 100):
            raise bad_request("'logit_bias' maps token ids to numbers between -100 and 100, got "
                              f"{json.dumps({key: value})[:80]}", param="logit_bias")
    req.logit_bias = {int(k): float(v) for k, v in bias.items()}
    allowed = _get(body, "allowed_token_ids", lambda v: isinstance(v, list) and v and all(
        _is_int(t) and t >= 0 for t in v), "a non-empty array of token ids")
    req.allowed_token_ids = list(allowed) if allowed is not None else None
    req.bad_words = list(_get(body, "bad_words", lambda v: isinstance(v, list) and all(
        isinstance(w, str) and w.strip() for w in v), "an array of non-empty strings", []))
    _get(body, "tools", lambda v: isinstance(v, list), "an array")
    _get(body, "response_format", lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
         "an object with a 'type'")
    if req.endpoint == "chat":
        _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
        _get(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= 20, "an integer 0..20")
    else:
        _get(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= 20, "an integer 0..20")
        _get(body, "echo", lambda v: isinstance(v, bool), "a boolean")
        _get(body, "suffix", lambda v: isinstance(v, str), "a string")
    _get(body, "user", lambda v: isinstance(v, str), "a string")


def _neutral_checks(body: dict, req: ParsedRequest) -> None:
    for name, value in body.items():
        if name in _HONOURED:
            continue
        surface = _VLLM_FIELDS.get(name)
        if surface is not None:
            if not surface(value):
                req.vllm_fields.append(name)
            continue
        check = _NEUTRAL.get(name)
        if check is None or not check(value):
            req.express_blockers.append(name)
