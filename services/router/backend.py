"""The models behind the router: which vLLM serves each, its tokenizer, limits and defaults.

Contract:
- ``discover(client, url)`` asks one vLLM server (``GET /v1/models``) what it serves and returns a
  ``ModelInfo`` per model; the tokenizer is loaded from the model's checkpoint directory (``root``,
  or an override) so the router detokenizes exactly as vLLM would, and the server's KV cache dtype
  (its ``--kv-cache-dtype``, from ``vllm:cache_config_info`` on ``GET /metrics``; "" when it does not
  say), which each claim carries so the coordinator pairs it only with nodes that keep that KV dtype.
- ``count_prompt_tokens(info, req)``: the prompt's length the way vLLM renders it (chat template
  with the generation prompt, BOS for text completions). Used for the claim and for the context
  check before the prefill; vLLM's own count (``prompt_token_ids``) is authoritative afterwards.
- ``prompt_tokens_at_most(info, req)``: an upper bound on that count without the tokenizer (the
  rendered text's length where it is ASCII), or None; the router uses it where it decides the same.
- ``sampling_defaults``: what vLLM applies when a request leaves temperature/top_p/top_k unset
  (``generation_config.json``, else 1.0 / 1.0 / off), so both lanes sample alike.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.router.validate import ParsedRequest
from shared.models import model_aliases


@dataclass
class ModelInfo:
    name: str
    root: str
    url: str  # base URL of the vLLM server that serves it (prefill and, by default, standard lane)
    max_model_len: int
    tokenizer: Any = None
    eos_token_ids: list[int] = field(default_factory=list)
    defaults: dict[str, Any] = field(default_factory=dict)
    kv_cache_dtype: str = ""  # the server's --kv-cache-dtype (auto, fp8, ...); "": not known

    @property
    def aliases(self) -> frozenset[str]:
        """Every name of the model (shared.models: the coordinator matches nodes by the same)."""
        return model_aliases(self.name, self.root)


def _generation_config(root: str) -> dict[str, Any]:
    path = Path(root) / "generation_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def sampling_defaults(gen_config: dict[str, Any]) -> dict[str, Any]:
    """The defaults vLLM takes from ``generation_config.json`` (only the keys it uses)."""
    out = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
    for key in out:
        if gen_config.get(key) is not None:
            out[key] = gen_config[key]
    return out


def _eos_ids(gen_config: dict[str, Any], tokenizer: Any) -> list[int]:
    eos = gen_config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


_load_lock = threading.Lock()  # transformers' lazy imports are not thread-safe


def load_tokenizer(path: str) -> Any:
    """The HF tokenizer of a checkpoint directory (blocking: call it in a thread)."""
    with _load_lock:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{[^}]*\bcache_dtype="([^"]*)"', re.MULTILINE)


def kv_cache_dtype_from_metrics(text: str) -> str:
    """vLLM's ``--kv-cache-dtype`` from its Prometheus text (``vllm:cache_config_info``); "" if absent."""
    m = _CACHE_INFO.search(text)
    return m.group(1) if m else ""


async def _kv_cache_dtype(client: httpx.AsyncClient, url: str) -> str:
    try:
        resp = await client.get(f"{url.rstrip('/')}/metrics", timeout=5.0)
        return kv_cache_dtype_from_metrics(resp.text) if resp.status_code == 200 else ""
    except Exception:  # metrics off or unreachable: claims then pair with any node, as before
        return ""


async def discover(
    client: httpx.AsyncClient, url: str, tokenizer_paths: dict[str, str] | None = None
) -> list[ModelInfo]:
    """The models one vLLM server serves, with tokenizers loaded; raises httpx errors."""
    import asyncio

    resp = await client.get(f"{url.rstrip('/')}/v1/models", timeout=5.0)
    resp.raise_for_status()
    kv_cache_dtype = await _kv_cache_dtype(client, url)
    out = []
    for entry in resp.json().get("data", []):
        name = entry["id"]
        root = entry.get("root") or name
        tok_path = (tokenizer_paths or {}).get(name, root)
        tokenizer = await asyncio.to_thread(load_tokenizer, tok_path)
        gen = _generation_config(root)
        out.append(ModelInfo(
            name=name, root=root, url=url.rstrip("/"),
            max_model_len=int(entry.get("max_model_len") or 0),
            tokenizer=tokenizer, eos_token_ids=_eos_ids(gen, tokenizer),
            defaults=sampling_defaults(gen), kv_cache_dtype=kv_cache_dtype,
        ))
    return out


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({**m, "content": content or ""})
    return out


def _chat_template(info: ModelInfo, req: ParsedRequest, tokenize: bool) -> Any:
    body = req.body
    return info.tokenizer.apply_chat_template(
        _text_messages(req.messages or []),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        tools=body.get("tools") or None,
        tokenize=tokenize,
        **(body.get("chat_template_kwargs") or {}),
    )


def count_prompt_tokens(info: ModelInfo, req: ParsedRequest) -> int:
    """The prompt's length in tokens as vLLM will render it."""
    tok = info.tokenizer
    if req.endpoint == "completions":
        if isinstance(req.prompt, list):
            return len(req.prompt)
        return len(tok.encode(req.prompt or ""))
    try:
        ids = _chat_template(info, req, tokenize=True)
    except Exception:
        text = "\n".join(m["content"] for m in _text_messages(req.messages or []))
        return len(tok.encode(text))
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


# Tokens a tokenizer may add beside the text's own: BOS/EOS of a text completion, a prefix space.
_SPECIAL_MARGIN = 4


def prompt_tokens_at_most(info: ModelInfo, req: ParsedRequest) -> int | None:
    """An upper bound on ``count_prompt_tokens`` without running the tokenizer (which costs ~0.5 ms
    a thousand tokens, on every request), or None where no cheap bound holds.

    The bound is the rendered text's length for ASCII text: tokenizer normalizers (NFC, NFKC,
    sentencepiece's space marker) map ASCII one character to one, and every token the model's
    tokenization emits covers at least one character of it, so a prompt of n ASCII characters is
    at most n tokens plus what the tokenizer adds around it. Non-ASCII text (where a normalizer
    can expand a character, and byte-level tokens cover less than one) has no such bound here."""
    if req.endpoint == "completions":
        if isinstance(req.prompt, list):
            return len(req.prompt)
        text = req.prompt or ""
    else:
        try:
            text = _chat_template(info, req, tokenize=False)
        except Exception:
            return None
        if not isinstance(text, str):
            return None
    return len(text) + _SPECIAL_MARGIN if text.isascii() else None
