"""Structured output: xgrammar grammars compiled exactly as vLLM's xgrammar backend compiles them
(vllm/v1/structured_output/backend_xgrammar.py), so both lanes allow the same tokens.

- ``Grammars(tokenizer_dir, vocab_size)``: one ``xgr.GrammarCompiler`` (its cache on, keyed by the
  grammar's text) over ``TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model config's
  vocab_size>)``, built on first use. ``compile(spec)`` per kind: ``json`` -> compile_json_schema
  (any_whitespace, separators ``(",", ":")`` without any whitespace, as vLLM), ``json_object`` ->
  the schema ``{"type": "object"}``, ``regex`` -> compile_regex, ``choice`` -> vLLM's
  ``choice_as_grammar`` EBNF, ``grammar`` -> compile_lark when the text looks like Lark, else
  compile_grammar (EBNF), ``structural_tag`` -> compile_structural_tag, the legacy form
  (``structures`` + ``triggers``) as ``StructuralTagItem``s, else the JSON text itself, as vLLM
  0.32 does (its tool parsers' tag for tool_choice required/named). Raises ``GrammarError``
  saying what is wrong (a regex also after ``COMPILE_TIMEOUT_S``, vLLM's regex compilation
  timeout).
- ``matcher(compiled, stop_token_ids, max_rollback)``: a ``GrammarMatcher`` with vLLM's
  ``override_stop_tokens`` (the request's stop ids and the model's EOS ids); rollback for drafts
  is unlimited in xgrammar 0.2.8.
- ``SlotGrammar``: one request's matcher with vLLM's bookkeeping (tokens after termination are
  ignored; a terminated matcher masks nothing). With a reasoning gate (``reasoning_end``: the think
  end token's id) it masks nothing and feeds nothing to the matcher until that token has been
  accepted, the token itself included (vLLM's StructuredOutputManager with a think-tag reasoning
  parser and ``enable_in_reasoning`` off): the grammar constrains the answer after the reasoning.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from pathlib import Path

import torch

from shared.events import StructuredOutput

COMPILE_TIMEOUT_S = 5.0  # vLLM's VLLM_REGEX_COMPILATION_TIMEOUT_S default
MAX_ABANDONED_COMPILES = 2  # regex compiles left running past their timeout before regexes are refused
MAX_TIMED_OUT_REMEMBERED = 256  # patterns that timed out, refused at once when asked again


class GrammarError(ValueError):
    """A request's grammar does not compile (or its tokens so far do not match it): no node can
    serve it (the decode node fails the request with ``retryable`` False and this ``code``)."""

    retryable = False
    code = "invalid_grammar"


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's ``choice_as_grammar`` (vllm/v1/structured_output/utils.py): one EBNF alternative each."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape_char(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join(f'"{"".join(escape_char(ch) for ch in c)}"' for c in choice)


def grammar_is_likely_lark(grammar_str: str) -> bool:
    """vLLM's ``grammar_is_likely_lark``: a rule line ``name: ...`` without ``::=``."""
    if not grammar_str or not isinstance(grammar_str, str):
        return False
    for line in grammar_str.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if not line:
            continue
        if "::=" in line:
            return False
    return True


def cache_key(spec: StructuredOutput) -> tuple:
    return (spec.kind, spec.json_schema, spec.regex, tuple(spec.choices), spec.grammar, spec.structural_tag,
            spec.any_whitespace)


class Grammars:
    """The engine's grammar compiler (module docstring); thread-safe, compiled grammars cached."""

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int, max_threads: int = 2,
                 cache_limit_bytes: int = 512 * 1024 * 1024):
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        self.max_threads, self.cache_limit_bytes = max_threads, cache_limit_bytes
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # regexes that ran past the timeout (refused at once if asked again), and their compiles still running
        # (a thread cannot be stopped: each went on in a pool of its own, the next regex gets a fresh one)
        self._timed_out: dict[str, None] = {}
        self._abandoned: list[concurrent.futures.Future] = []

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                if self.tokenizer_dir is None:
                    raise RuntimeError("structured output needs the model's tokenizer: this engine was built "
                                       "without one (pass EngineConfig.tokenizer)")
                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
                except Exception as e:  # noqa: BLE001 - a node without tokenizer files: another node may have them
                    raise RuntimeError(f"structured output needs the model's tokenizer files in {self.tokenizer_dir} "
                                       f"(or --tokenizer): {type(e).__name__}: {e}") from None
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=True,
                                                     cache_limit_bytes=self.cache_limit_bytes)
            return self._compiler

    def _compile_now(self, spec: StructuredOutput):
        c = self.compiler()
        separators = None if spec.any_whitespace else (",", ":")
        if spec.kind == "json":
            try:
                json.loads(spec.json_schema)
            except ValueError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
            return c.compile_json_schema(spec.json_schema, any_whitespace=spec.any_whitespace, separators=separators)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace,
                                         separators=separators)
        if spec.kind == "regex":
            return c.compile_regex(spec.regex)
        if spec.kind == "choice":
            if not spec.choices:
                raise GrammarError("choice needs at least one string")
            return c.compile_grammar(choice_as_grammar(spec.choices))
        if spec.kind == "grammar":
            if grammar_is_likely_lark(spec.grammar):
                return c.compile_lark(spec.grammar)
            return c.compile_grammar(spec.grammar)
        if spec.kind == "structural_tag":
            return self._compile_structural_tag(c, spec.structural_tag)
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")

    @staticmethod
    def _compile_structural_tag(c, text: str):
        """vLLM 0.32's XgrammarBackend.compile_grammar for STRUCTURAL_TAG, branch for branch."""
        import xgrammar as xgr

        try:
            s_tag = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
        if isinstance(s_tag, dict) and "structures" in s_tag:  # vLLM's fallback to the deprecated form
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in s_tag["structures"]]
            return c.compile_structural_tag(tags, s_tag["triggers"])
        return c.compile_structural_tag(text)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (xgrammar's cache answers a grammar seen before at once); a regex
        gets vLLM's compilation timeout (a pathological pattern must not hang the node)."""
        self.compiler()  # built once (the tokenizer's vocabulary), outside the timeout
        try:
            if spec.kind != "regex":
                return self._compile_now(spec)
            future = self._submit_regex(spec)
            return future.result(timeout=COMPILE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            self._abandon(spec, future)
            raise GrammarError(f"regex did not compile within {COMPILE_TIMEOUT_S:g} s: simplify it") from None
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with its reason
            raise GrammarError(f"{spec.kind} grammar does not compile: {type(e).__name__}: {e}") from None

    def _submit_regex(self, spec: StructuredOutput) -> concurrent.futures.Future:
        with self._lock:
            if spec.regex in self._timed_out:
                raise GrammarError(f"regex did not compile within {COMPILE_TIMEOUT_S:g} s before: simplify it")
            self._abandoned = [f for f in self._abandoned if not f.done()]
            if len(self._abandoned) >= MAX_ABANDONED_COMPILES:
                raise GrammarError(f"{len(self._abandoned)} earlier regexes are still compiling past their timeout "
                                   "on this node: retry later, or send a simpler pattern")
            return self._pool.submit(self._compile_now, spec)

    def _abandon(self, spec: StructuredOutput, future: concurrent.futures.Future) -> None:
        """A regex ran past its timeout: its compile goes on (a thread cannot be stopped) in a pool left to it;
        later regexes get a fresh worker instead of queueing behind it, and this pattern is refused at once."""
        with self._lock:
            self._abandoned.append(future)
            self._pool.shutdown(wait=False)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
            self._timed_out[spec.regex] = None
            while len(self._timed_out) > MAX_TIMED_OUT_REMEMBERED:
                del self._timed_out[next(iter(self._timed_out))]

    def matcher(self, compiled, stop_token_ids: list[int], max_rollback: int,
                reasoning_end: int = -1) -> SlotGrammar:
        import xgrammar as xgr

        del max_rollback  # vLLM passes its drafts per step; xgrammar 0.2.8 always keeps unlimited rollback
        return SlotGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None),
                           reasoning_end)


class SlotGrammar:
    """One request's matcher, with vLLM's XgrammarGrammar bookkeeping; ``reasoning_end`` >= 0: the
    grammar starts after that token (module docstring)."""

    def __init__(self, matcher, reasoning_end: int = -1):
        self.matcher = matcher
        self.is_terminated = False
        self.reasoning_end = reasoning_end
        self.reasoning = reasoning_end >= 0  # still reasoning: nothing masked, nothing fed to the matcher

    def accept(self, tokens: list[int]) -> bool:
        """Advance through ``tokens`` (those after termination ignored); False at the first rejected one."""
        for t in tokens:
            if self.reasoning:
                self.reasoning = t != self.reasoning_end
                continue
            if self.is_terminated:
                return True
            if not self.matcher.accept_token(t):
                return False
            self.is_terminated = self.matcher.is_terminated()
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's mask into ``bitmask[row]`` (all allowed while reasoning or once terminated, as vLLM)."""
        if self.is_terminated or self.reasoning:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_through(self, drafts: list[int], bitmask: torch.Tensor, row0: int) -> int:
        """Masks for the positions after each grammar-valid prefix of ``drafts``: rows ``row0 + j``
        for j = 0..v, where v is the length of the longest prefix the grammar accepts; the matcher
        ends where it started (rolled back). Returns v. Rows past v are left all allowed. While
        reasoning, drafts are unconstrained up to the reasoning's end token; the drafts after it are
        not verified this step (v stops there, the row after it has the grammar's first mask)."""
        if self.reasoning:
            for v, t in enumerate(drafts):
                bitmask[row0 + v].fill_(-1)
                if t == self.reasoning_end:
                    self.matcher.fill_next_token_bitmask(bitmask, row0 + v + 1)
                    return v + 1
            bitmask[row0 + len(drafts)].fill_(-1)
            return len(drafts)
        v = 0
        self.fill(bitmask, row0)
        if not self.is_terminated:
            for t in drafts:
                if not self.matcher.accept_token(t):
                    break
                v += 1
                if self.matcher.is_terminated():
                    bitmask[row0 + v].fill_(-1)
                    break
                self.matcher.fill_next_token_bitmask(bitmask, row0 + v)
            if v:
                self.matcher.rollback(v)
        return v
