"""Sampling fields the router resolves for the decode node, as vLLM resolves them.

- ``bad_words_token_ids(tokenizer, words)``: vLLM's tokenization of ``bad_words``
  (``SamplingParams.update_from_tokenizer``): each word without a prefix space, and with one when
  that gives a different first token and the same length, so the word is barred at the start of
  the text and in the middle of it.
"""

from __future__ import annotations

from typing import Any

from services.router.errors import bad_request


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise bad_request("bad_words entries must tokenize to at least one token.",
                                      param="bad_words")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(list(ids))
    return out
