"""Incremental detokenization with stop strings, for token ids arriving in batches.

Contract (``Detokenizer``):
- ``add(token_ids)`` consumes ids in order and returns a ``Delta``: the text that may be shown now,
  the ids consumed, and ``finish_reason="stop"`` once a stop string appeared. Concatenating every
  delta's text (then ``flush()``) gives exactly the text of the consumed ids, cut at the first stop
  string (kept when ``include_stop_str_in_output``); no token is lost or repeated, ids after the one
  that completed a stop string are not consumed.
- Text is decoded against a few prompt tokens of context (as vLLM does), so leading spaces and
  multi-token UTF-8 characters come out right: a piece that still ends in an incomplete character
  (U+FFFD) waits for the next id.
- ``stop_token_ids``: ids that end the completion (EOS, the request's stop_token_ids); as in
  vLLM, such an id is consumed but its text is not shown unless ``include_stop_str_in_output``.
- While stop strings are set, the last ``len(longest stop) - 1`` characters are held back (they may
  start a stop string); ``flush()`` releases them at the end.

Pure: the tokenizer is anything with ``decode(ids, skip_special_tokens=...)`` (HF ``tokenizers`` or
``transformers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

# Prompt tokens decoded as context before the first output token (vLLM uses the same).
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Literal["stop"] | None = None
    stop_reason: str | None = None  # the stop string that matched


class Detokenizer:
    """Incremental detokenizer for one completion."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._stop_ids = frozenset() if include_stop_str_in_output else frozenset(stop_token_ids)
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # output text so far (cut at a stop string)
        self.num_tokens = 0  # output ids consumed
        self.token_ids: list[int] = []
        self._sent = 0  # characters of self.text already returned
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _step(self, token_id: int) -> str:
        """Append one id; return the newly complete text (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _check_stop(self, start: int) -> str | None:
        """Cut ``self.text`` at the first stop string ending after ``start``; return it."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
        return s

    def add(self, token_ids: Sequence[int]) -> Delta:
        """Consume ids in order until a stop string appears; return what may be shown now."""
        delta = Delta()
        for token_id in token_ids:
            if self.finished:
                break
            start = len(self.text)
            if int(token_id) not in self._stop_ids:
                self.text += self._step(int(token_id))
            self.num_tokens += 1
            self.token_ids.append(int(token_id))
            delta.token_ids.append(int(token_id))
            if self._stop and len(self.text) > start:
                matched = self._check_stop(start)
                if matched is not None:
                    self.finished = True
                    delta.finish_reason = "stop"
                    delta.stop_reason = matched
        delta.text = self._release(final=self.finished)
        return delta

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._holdback)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def flush(self) -> str:
        """The held-back text, at the end of the completion."""
        return self._release(final=True)
