"""vLLM's own serving surface for what agents send on the express lane: the request's grammar, the
response's logprobs, tool calls and reasoning split, produced by vLLM's code, not ours.

Contract:
- ``load(tool_parser, reasoning_parser, enable_auto_tools)`` imports vLLM (and torch) once, in a
  thread (seconds). Until it is loaded, or when vLLM is not installed, ``Surface.ready`` is False
  and requests that need it stay on the standard lane (services.router.validate lists them as
  blockers): a router without vLLM stays a small Python process.
- ``check_parsers(tool, reasoning)`` raises ValueError naming the choices when vLLM's registries
  do not know a parser name (``--tool-call-parser``, ``--reasoning-parser``).
- ``Surface.prepare(endpoint, body, tokenizer) -> Prepared``: the request as vLLM's protocol
  model (``ChatCompletionRequest``/``CompletionRequest``, validated by vLLM: ``ValueError`` when
  vLLM would refuse it, so the caller sends it where vLLM answers with its own 400), the tool
  parser's ``adjust_request`` applied as vLLM's renderer applies it (tool_choice required/named ->
  a JSON schema, or under vLLM's default strict tool calling an xgrammar structural tag, passed
  through as its JSON text), and the decode node's ``StructuredOutput`` and ``logprobs`` derived
  from vLLM's ``StructuredOutputsParams``/``SamplingParams``. ``Prepared.blocker`` names what the
  express lane cannot honour (whitespace patterns, a grammar beside a reasoning parser other than a
  think-tag one). With a think-tag reasoning parser (deepseek_r1, ernie45, deepseek_v3 thinking) the
  grammar carries the parser's start/end token ids: the decode node constrains the answer after the
  reasoning, as vLLM's engine does (``reasoning_gate``).
- ``Surface.render(prepared, ...)``: an async iterator of SSE strings (stream) or the response
  body (not streamed), from vLLM's own ``chat_completion_stream_generator`` /
  ``chat_completion_full_generator`` (completions alike), fed with ``RequestOutput``s built from
  the express lane's tokens: text deltas (our detokenizer, stop strings applied), token ids, and
  logprobs as vLLM's ``LogprobsProcessor`` builds them (decoded tokens, U+FFFD repair).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from shared.events import StructuredOutput, TokenLogprobs
from shared.log import get_logger

_log = get_logger("services.router.vllm_surface")


def available() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def parser_names() -> tuple[list[str], list[str]]:
    """vLLM's registered tool-call and reasoning parser names (imports vLLM's registries)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tools = sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers))
    return tools, ReasoningParserManager.list_registered()


def check_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError naming the valid choices when a parser name is not one of vLLM's."""
    if not tool_parser and not reasoning_parser:
        return
    if not available():
        raise ValueError("--tool-call-parser/--reasoning-parser need vLLM in this environment "
                         "(pip install 'expresslane[vllm]' or run the router image built with vLLM)")
    tools, reasoning = parser_names()
    if tool_parser and tool_parser not in tools:
        raise ValueError(f"--tool-call-parser {tool_parser!r} is not one of vLLM's tool parsers: "
                         f"{', '.join(tools)}")
    if reasoning_parser and reasoning_parser not in reasoning:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r} is not one of vLLM's reasoning "
                         f"parsers: {', '.join(reasoning)}")


@dataclass
class Prepared:
    endpoint: str
    request: Any  # vLLM's ChatCompletionRequest / CompletionRequest (after adjust_request)
    structured: StructuredOutput | None = None
    logprobs: int | None = None
    blocker: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def structured_output(params: Any) -> tuple[StructuredOutput | None, str]:
    """vLLM's ``StructuredOutputsParams`` -> the wire's ``StructuredOutput`` (or a blocker)."""
    if params is None:
        return None, ""
    if params.whitespace_pattern is not None or params.disable_additional_properties:
        return None, "structured output (whitespace_pattern/disable_additional_properties)"
    ws = not params.disable_any_whitespace
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutput(kind="json", json_schema=schema, any_whitespace=ws), ""
    if params.json_object:
        return StructuredOutput(kind="json_object", any_whitespace=ws), ""
    if params.regex is not None:
        return StructuredOutput(kind="regex", regex=params.regex, any_whitespace=ws), ""
    if params.choice is not None:
        return StructuredOutput(kind="choice", choices=list(params.choice), any_whitespace=ws), ""
    if params.grammar is not None:
        return StructuredOutput(kind="grammar", grammar=params.grammar, any_whitespace=ws), ""
    if params.structural_tag is not None:  # the JSON text vLLM's xgrammar backend compiles
        return StructuredOutput(kind="structural_tag", structural_tag=params.structural_tag, any_whitespace=ws), ""
    return None, ""


def reasoning_gate(structured: StructuredOutput, request: Any, parser_cls: Any, info: Any,
                   chat_template_kwargs: dict, in_reasoning: bool = False) -> tuple[StructuredOutput, str]:
    """The grammar with vLLM's reasoning gate where the express lane can keep it, else a blocker.

    vLLM's API server constrains from the first token when the request does not include reasoning
    (``resolve_reasoning_ended``); otherwise its engine builds the reasoning parser per request (with
    the request's chat template kwargs), asks ``is_reasoning_end`` of the prompt, and then leaves
    tokens unconstrained until ``is_reasoning_end_streaming`` sees the end token. For think-tag
    parsers (BaseThinkingReasoningParser's own two methods) that is: the last start/end token of the
    prompt, then the end token's id, which the decode node follows (StructuredOutput). IdentityReasoningParser
    (deepseek_v3 without thinking) ends at once: the grammar constrains from the first token, as it does
    with vLLM's ``enable_in_reasoning`` (``in_reasoning``). ``chat_template_kwargs``: the request's
    effective ones (its own over vLLM's ``--default-chat-template-kwargs``, reasoning_effort's
    enable_thinking), as vLLM's engine builds the parser; completions: none (``request`` None: vLLM
    does not resolve the prompt's verdict in its frontend there)."""
    if in_reasoning:
        return structured, ""
    if request is not None and not request.include_reasoning:  # the express leg asks vLLM for the reasoning
        return structured, "structured output with include_reasoning false and a reasoning parser"
    kwargs = json.dumps(chat_template_kwargs, sort_keys=True, default=str) if request is not None else None
    kind, start, end = _think_tags(parser_cls.reasoning_parser_cls, info.tokenizer, kwargs)
    if kind == "identity":
        return structured, ""
    if kind == "think":
        import msgspec

        return msgspec.structs.replace(structured, reasoning_start_token_id=start, reasoning_end_token_id=end), ""
    return structured, f"structured output with the {kind} reasoning parser"


@functools.lru_cache(maxsize=64)
def _think_tags(reasoner_cls: Any, tokenizer: Any, kwargs: str | None) -> tuple[str, int, int]:
    """("identity" | "think" | the parser's class name, start id, end id) of the parser vLLM's engine builds
    with these chat template kwargs (JSON; None: none). Cached: a parser reads the tokenizer's whole
    vocabulary when built (0.14 ms for 782 tokens on a 2-vCPU host, growing with the vocabulary), which
    the router's loop would otherwise pay on every such request."""
    from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser as Think
    from vllm.reasoning.identity_reasoning_parser import IdentityReasoningParser

    extra = {} if kwargs is None else {"chat_template_kwargs": json.loads(kwargs)}
    reasoner = reasoner_cls(tokenizer, **extra)
    reasoner = getattr(reasoner, "_parser", reasoner)  # deepseek_v3's parser delegates to R1 or identity
    if isinstance(reasoner, IdentityReasoningParser):
        return "identity", -1, -1
    cls = type(reasoner)
    if (isinstance(reasoner, Think) and cls.is_reasoning_end is Think.is_reasoning_end
            and cls.is_reasoning_end_streaming is Think.is_reasoning_end_streaming):
        return "think", reasoner.start_token_id, reasoner.end_token_id
    return cls.__name__, -1, -1


class _Model:
    """The little of vLLM's ModelConfig that the response generators and parsers read."""

    def __init__(self, name: str, max_model_len: int) -> None:
        self.model = name
        self.served_model_name = name
        self.max_model_len = max_model_len
        self.hf_config = type("HfConfig", (), {"model_type": ""})()
        self.is_encoder_decoder = False


class Surface:
    """vLLM's serving pieces, loaded once (see the module contract)."""

    def __init__(self, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 enable_auto_tools: bool = False, tool_strict_level: str = "auto",
                 default_chat_template_kwargs: dict | None = None, structured_in_reasoning: bool = False) -> None:
        self.tool_strict_level = tool_strict_level or "auto"
        # the prefill vLLM's --default-chat-template-kwargs and structured outputs' enable_in_reasoning
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.structured_in_reasoning = structured_in_reasoning
        self.tool_parser = tool_parser or None
        self.reasoning_parser = reasoning_parser or None
        self.enable_auto_tools = enable_auto_tools
        self.ready = False
        self.error = ""
        self._parser_cls: dict[str, Any] = {}

    # ---------------------------------------------------------------- loading

    def load(self) -> None:
        """Import vLLM's serving code (blocking: run it in a thread)."""
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: F401
            from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat  # noqa: F401
            from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion  # noqa: F401
            from vllm.parser import ParserManager  # noqa: F401
            from vllm.v1.engine.logprobs import LogprobsProcessor  # noqa: F401
        except Exception as exc:  # not installed, or broken: these requests keep the standard lane
            self.error = f"{type(exc).__name__}: {exc}"
            _log.warning("vllm_surface_unavailable", error=self.error)
            return
        self.ready = True
        _log.info("vllm_surface_loaded", tool_parser=self.tool_parser,
                  reasoning_parser=self.reasoning_parser)

    def parser_cls(self, info: Any) -> Any:
        """vLLM's Parser class for a model (tool + reasoning), or None without parsers."""
        if not (self.tool_parser or self.reasoning_parser):
            return None
        if info.name not in self._parser_cls:
            from vllm.parser import ParserManager

            self._parser_cls[info.name] = ParserManager.get_parser(
                tool_parser_name=self.tool_parser, reasoning_parser_name=self.reasoning_parser or "",
                enable_auto_tools=self.enable_auto_tools, tool_strict_level=self.tool_strict_level,
                model_name=info.name, is_harmony=False, tokenizer=info.tokenizer)
        return self._parser_cls[info.name]

    # ---------------------------------------------------------------- the request

    def prepare(self, endpoint: str, body: dict[str, Any], info: Any) -> Prepared:
        """vLLM's reading of the request (see the module contract); ValueError if vLLM refuses it."""
        from pydantic import ValidationError

        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        try:
            if endpoint == "chat":
                return self._prepare_chat(body, info)
            return self._prepare_completion(body, info)
        except ValidationError as exc:
            raise ValueError(str(exc)) from None
        except Exception as exc:  # VLLMValidationError and what adjust_request raises
            raise ValueError(f"{type(exc).__name__}: {exc}") from None

    def _prepare_chat(self, body: dict[str, Any], info: Any) -> Prepared:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate(body)
        parser_cls = self.parser_cls(info)
        kwargs = dict(request.chat_template_kwargs or {})
        tool_parser = parser_cls.tool_parser_cls if parser_cls is not None else None
        if tool_parser is None and request.tools and request.tool_choice not in (None, "none"):
            # vLLM answers these with a 400 that names the missing flags: let it
            if request.tool_choice != "auto" or not self.enable_auto_tools:
                raise ValueError(f"tool_choice={request.tool_choice!r} needs --tool-call-parser")
        if parser_cls is not None and (parser_cls.reasoning_parser_cls is not None
                                       or request.tool_choice != "none"
                                       or getattr(parser_cls, "always_adjust_request", False)):
            request = parser_cls(info.tokenizer, request.tools, model_config=_Model(info.name, info.max_model_len),
                                 chat_template_kwargs=kwargs).adjust_request(request=request)
        prepared = Prepared("chat", request, chat_template_kwargs=kwargs)
        prepared.structured, prepared.blocker = structured_output(request.extract_structured_outputs())
        if getattr(request, "_grammar_from_parser", False):
            prepared.blocker = "structured output (parser grammar)"
        if prepared.structured is not None and parser_cls is not None and parser_cls.reasoning_parser_cls:
            effective = request.build_chat_params(None, "auto").with_defaults(
                self.default_chat_template_kwargs).chat_template_kwargs  # vLLM's _effective_chat_template_kwargs
            self._gate(prepared, parser_cls, info, request, effective)
        if request.logprobs:
            prepared.logprobs = request.top_logprobs or 0
            if prepared.logprobs < 0 or request.logprob_token_ids:
                prepared.blocker = prepared.blocker or "top_logprobs=-1"
        return prepared

    def _gate(self, prepared: Prepared, parser_cls: Any, info: Any, request: Any, kwargs: dict) -> None:
        """``prepared``'s grammar behind the reasoning parser's gate, or its blocker (``reasoning_gate``)."""
        prepared.structured, blocker = reasoning_gate(prepared.structured, request, parser_cls, info, kwargs,
                                                      self.structured_in_reasoning)
        prepared.blocker = prepared.blocker or blocker

    def _prepare_completion(self, body: dict[str, Any], info: Any) -> Prepared:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = CompletionRequest.model_validate(body)
        prepared = Prepared("completions", request)
        prepared.structured, prepared.blocker = structured_output(request.extract_structured_outputs())
        parser_cls = self.parser_cls(info) if self.reasoning_parser else None
        if prepared.structured is not None and parser_cls is not None and parser_cls.reasoning_parser_cls:
            self._gate(prepared, parser_cls, info, None, {})
        if request.logprobs is not None:
            prepared.logprobs = request.logprobs
            if prepared.logprobs < 0 or request.logprob_token_ids:
                prepared.blocker = prepared.blocker or "logprobs=-1"
        return prepared

    # ---------------------------------------------------------------- the response

    def _serving(self, prepared: Prepared, info: Any) -> Any:
        """vLLM's response generator object, without an engine (it only renders here)."""
        if prepared.endpoint == "chat":
            from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat as cls
        else:
            from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion as cls
        s = object.__new__(cls)
        s.model_config = _Model(info.name, info.max_model_len)
        s.request_logger = None
        s.return_tokens_as_token_ids = False
        s.response_role = "assistant"
        s.chat_template = None
        s.chat_template_content_format = "auto"
        s.default_chat_template_kwargs = dict(self.default_chat_template_kwargs)
        s.enable_log_outputs = False
        s.enable_log_deltas = False
        s.enable_auto_tools = self.enable_auto_tools
        s._include_reasoning_tokens_details = bool(self.reasoning_parser)
        s.parser_cls = self.parser_cls(info) if prepared.endpoint == "chat" else None
        s.exclude_tools_when_tool_choice_none = False
        s.enable_prompt_tokens_details = False
        s.enable_force_include_usage = False
        s.enable_per_request_metrics = False
        s.default_sampling_params = {}
        s.supports_browsing = False
        s.browser_tool = None
        s.supports_code_interpreter = False
        s.python_tool = None
        s.log_error_stack = False
        s.system_fingerprint = None
        s.has_kv_connector = False
        return s

    def render(self, prepared: Prepared, info: Any, request_id: str, prompt_ids: list[int],
               outputs: AsyncIterator[Any]) -> Any:
        """vLLM's response for ``outputs`` (``RequestOutput``s): an async iterator of SSE strings
        when streamed, else an awaitable of the response model (``model_dump()`` for JSON)."""
        from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

        serving = self._serving(prepared, info)
        meta = RequestResponseMetadata(request_id=request_id)
        req = prepared.request
        if prepared.endpoint == "chat":
            if req.stream:
                return serving.chat_completion_stream_generator(
                    req, outputs, request_id, info.name, [], info.tokenizer, meta,
                    chat_template_kwargs=prepared.chat_template_kwargs)
            parser = (serving._make_parser(req, info.tokenizer, prepared.chat_template_kwargs)
                      if serving.parser_cls is not None else None)
            return serving.chat_completion_full_generator(
                req, outputs, request_id, info.name, [], info.tokenizer, meta, parser=parser)
        import time

        created = int(time.time())
        if req.stream:
            async def indexed() -> AsyncIterator[tuple[int, Any]]:
                async for out in outputs:
                    yield 0, out
            return serving.completion_stream_generator(
                req, [{"prompt_token_ids": prompt_ids}], indexed(), request_id, created, info.name,
                1, info.tokenizer, meta)

        async def full() -> Any:
            last = None
            async for out in outputs:
                last = out
            return serving.request_output_to_completion_response(
                [last], req, request_id, created, info.name, info.tokenizer, meta)
        return full()


class OutputBuilder:
    """``RequestOutput``s from the express lane's text deltas, token ids and logprobs, as vLLM's
    output processor builds them (DELTA while streaming, cumulative otherwise)."""

    def __init__(self, tokenizer: Any, request_id: str, prompt_ids: list[int], num_logprobs: int | None,
                 stream: bool) -> None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        self._request_id = request_id
        self._prompt_ids = list(prompt_ids)
        self._stream = stream
        self._num_logprobs = num_logprobs
        self._lp = None
        if num_logprobs is not None:
            self._lp = LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None,
                                         cumulative_logprob=0.0, num_logprobs=num_logprobs,
                                         num_prompt_logprobs=None)
        self._text = ""
        self._ids: list[int] = []

    def add_logprobs(self, token_ids: list[int], entries: list[TokenLogprobs | None] | None) -> None:
        """Logprobs of ``token_ids`` (one ``TokenLogprobs`` each, in order); a token whose entry is
        missing gets none (vLLM renders such a token without a logprob)."""
        if self._lp is None or not token_ids:
            return
        import numpy as np
        from vllm.v1.outputs import LogprobsLists

        entries = list(entries or [])
        entries += [None] * (len(token_ids) - len(entries))
        for tid, e in zip(token_ids, entries):
            if e is None:
                self._lp.logprobs.append(None)
                continue
            self._lp._update_sample_logprobs(LogprobsLists(
                [np.array([tid, *e.top_ids], dtype=np.int64)],
                [np.array([e.logprob, *e.top_logprobs], dtype=np.float32)],
                [np.array(e.rank, dtype=np.int64)], None))

    def output(self, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: str | int | None) -> Any:
        """The ``RequestOutput`` after ``text``/``token_ids`` (their logprobs added before)."""
        from vllm.outputs import CompletionOutput, RequestOutput

        start = len(self._ids)
        self._text += text
        self._ids += token_ids
        logprobs = None
        if self._lp is not None:
            logprobs = self._lp.logprobs[start:] if self._stream else list(self._lp.logprobs)
        out = CompletionOutput(
            index=0, text=text if self._stream else self._text,
            token_ids=list(token_ids) if self._stream else list(self._ids),
            cumulative_logprob=self._lp.cumulative_logprob if self._lp is not None else None,
            logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return RequestOutput(request_id=self._request_id, prompt=None, prompt_token_ids=self._prompt_ids,
                             prompt_logprobs=None, outputs=[out], finished=finish_reason is not None,
                             num_cached_tokens=0)
