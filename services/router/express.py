"""The express leg of one request: claim, prefill in vLLM, decode on a node, migrate on failure.

Contract (``ExpressStream``):
- ``await open()``: claim a decode slot (``ClaimRejected`` for capacity -> ``ApiError`` 429 with
  Retry-After; no coordinator, or a rejection that no express node could ever take ->
  ``LaneFallback``: the caller serves the standard lane), then the prefill leg
  to vLLM (``max_tokens=1``, streamed, ``return_token_ids``, ``kv_transfer_params`` with the lease
  and its transfer target: shared.handoff), answered the moment vLLM streams the first token. A
  vLLM error passes through (``UpstreamError``) and the lease is cancelled. Returns the prompt's
  token ids. A prefill that could not hand the KV off (no staging slot, ...) says so on the bus
  (``KvFailed``): the lease fails and the request migrates like any failed leg.
- ``tokens()``: the completion's token ids as ``TokenBatch``es: the first token (from the prefill)
  at once, then (once the caller has taken it) ``DecodeStart`` to the node and its ``TokensGenerated`` relayed in order, ending
  with the node's finish reason. When the node fails (``RequestFailed``, a ``failed`` handoff, or
  silence past a timeout), the request migrates: prompt + ids already yielded go to another
  express node (new claim + prefill of those ids) or to the standard lane (vLLM continues from
  them), so the ids yielded are exactly those of an uninterrupted run: none lost, none repeated.
- Closing ``tokens()`` early (client gone, stop string) publishes ``CancelRequest`` for the live
  leg; every leg ends with its queue unregistered.

Each leg has its own request id (``<id>``, ``<id>-m1``, ...), so the coordinator's state machine
sees every attempt as one request with one terminal state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.router.backend import ModelInfo
from services.router.dispatch import Dispatcher
from services.router.errors import ApiError, rate_limited
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from services.router.standard import TokenBatch, UpstreamError, continuation_body, continue_tokens, unreachable
from shared import subjects
from shared.bus import Bus, BusError, BusNoResponders, BusTimeout
from shared.events import (
    CancelRequest, ClaimGranted, ClaimReply, ClaimRejected, ClaimRequest, DecodeStart, HandoffEvent,
    PrefillToken, RequestFailed, RequestFinished, SamplingParams, StructuredOutput, TokenLogprobs,
    TokensGenerated,
)
from shared.handoff import Handoff, request_params
from shared.log import get_logger
from shared.tracing import current_traceparent, inject_headers

_log = get_logger("services.router.express")
# Rejections that mean "busy, retry later" (429); any other reason sends the request to the
# standard lane (no compatible node, protocol mismatch, ...).
CAPACITY_REASONS = frozenset({"no_free_slot", "queue_full", "deadline", "coordinator_stopping"})
CLAIM_RETRY_S = 0.05  # between claims while no coordinator answers


def claim_request(info: ModelInfo, request_id: str, *, num_prompt_tokens: int, max_tokens: int,
                  wait_ms: int, tenant: str = "", exclude_nodes: Iterable[str] = ()) -> ClaimRequest:
    """The claim for one leg: the served name and the model's other names (shared.models), the
    prefill vLLM's KV cache dtype (only nodes keeping KV in it are paired), and the nodes where an
    earlier leg of the request failed (never paired again)."""
    return ClaimRequest(request_id=request_id, model=info.name,
                        model_aliases=sorted(info.aliases - {info.name}),
                        num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, wait_ms=wait_ms,
                        tenant=tenant, kv_cache_dtype=info.kv_cache_dtype,
                        exclude_nodes=sorted(set(exclude_nodes)))


def handoff_params(grant: ClaimGranted, traceparent: str = "", start: SamplingParams | None = None,
                   ) -> dict[str, Any]:
    """The prefill request's ``kv_transfer_params`` for a granted claim (shared.handoff); with
    ``start`` the prefill starts the decode itself at its first token."""
    return request_params(Handoff.from_grant(grant, traceparent=traceparent, start=start))


def _token_id(text: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token: ``token_id:123``."""
    return int(text.rpartition(":")[2])


def chunk_logprobs(choice: dict[str, Any]) -> TokenLogprobs | None:
    """The first token's logprobs from a prefill chunk rendered with ``return_tokens_as_token_ids``
    (chat: ``logprobs.content[0]``; completions: ``tokens``/``token_logprobs``/``top_logprobs``).
    vLLM lists the sampled token first, then the most likely others: ``top_ids`` keeps that order,
    so the router renders the same entries again."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:
        if not lp["content"]:
            return None
        entry = lp["content"][0]
        sampled = _token_id(entry["token"])
        tops = [(_token_id(t["token"]), float(t["logprob"])) for t in entry.get("top_logprobs") or []]
        logprob = float(entry["logprob"])
    else:
        if not lp.get("tokens"):
            return None
        sampled = _token_id(lp["tokens"][0])
        logprob = float(lp["token_logprobs"][0])
        tops = [(_token_id(t), float(v)) for t, v in ((lp.get("top_logprobs") or [None])[0] or {}).items()]
    if tops and tops[0][0] == sampled:
        tops = tops[1:]
    rank = 1 + sum(1 for _, v in tops if v > logprob)  # not rendered by vLLM: as far as it shows
    return TokenLogprobs(logprob=logprob, rank=rank, top_ids=[t for t, _ in tops],
                         top_logprobs=[v for _, v in tops])


def stream_error_status(chunk: dict) -> int:
    """The status for an error vLLM streamed after its 200 (e.g. a schema its grammar compiler refuses): the
    chunk's own 4xx code, which vLLM alone answers with, else 502."""
    code = (chunk.get("error") or {}).get("code") if isinstance(chunk.get("error"), dict) else None
    return code if isinstance(code, int) and 400 <= code < 500 else 502


async def _first_token(lines: AsyncIterator[str]) -> tuple[TokenBatch, list[int]]:
    """From a streamed prefill (``max_tokens=1``, ``return_token_ids``): its one token (finish
    reason "stop" when vLLM stopped on it, its logprobs when asked) and the prompt's token ids."""
    prompt_ids: list[int] = []
    async for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = msgspec.json.decode(line[6:])
        if "error" in chunk:
            raise UpstreamError(stream_error_status(chunk), msgspec.json.encode(chunk))
        prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
        for choice in chunk.get("choices") or []:
            prompt_ids = choice.get("prompt_token_ids") or prompt_ids
            token_ids = choice.get("token_ids") or []
            if token_ids:
                if len(token_ids) != 1:
                    break
                finish = "stop" if choice.get("finish_reason") == "stop" else None
                lp = chunk_logprobs(choice)
                return TokenBatch(list(token_ids), finish, [lp] if lp is not None else None), list(prompt_ids)
    raise ApiError(502, "the prefill server's stream ended without exactly 1 token id: is it vLLM "
                        ">= 0.32 with return_token_ids?")


async def _drain(upstream: httpx.Response, lines: AsyncIterator[str]) -> None:
    """Read a prefill stream to its end (vLLM would take an early close for a client gone)."""
    try:
        async for _ in lines:
            pass
    except httpx.HTTPError:
        pass
    finally:
        await upstream.aclose()


async def _finish_quietly(streamed: asyncio.Future, request_id: str, leg_id: str) -> None:
    """Let a prefill stream whose first token came over the bus end on its own."""
    try:
        await streamed
    except Exception as exc:  # the token is out already; the KV's fate comes over the bus
        _log.info("express_prefill_stream_after_bus_token", request_id=request_id, leg_id=leg_id, error=str(exc))


class LaneFallback(Exception):
    """The express lane cannot take the request; nothing was sent yet: use the standard lane."""


class ClaimUnanswered(LaneFallback):
    """No coordinator answered the claim in time (it may still grant it later)."""


class _LegFailed(Exception):
    """The decode side of one leg failed; the request migrates."""


@dataclass
class ExpressDeps:
    bus: Bus
    http: httpx.AsyncClient
    dispatcher: Dispatcher
    nodes: NodeTable
    metrics: RouterMetrics
    tracer: trace.Tracer
    spawn: Callable[[Any], None]  # run a coroutine in the background, safe under cancellation
    cfg: Any  # RouterConfig
    warm: Any = None  # services.router.warm.WarmLeases: grants held ready, or None


@dataclass
class _Leg:
    id: str
    grant: ClaimGranted
    queue: asyncio.Queue
    finished: bool = False
    span: trace.Span | None = None  # router.decode: from DecodeStart to the leg's end
    # The first token came over the bus (PrefillToken): the prefill started the decode itself (or
    # sent no start: vLLM stopped on the token, or the KV was not staged), so no DecodeStart from here.
    first_from_bus: bool = False
    early: list = field(default_factory=list)  # leg events that came while the first token was awaited

    def end_span(self, status: str) -> None:
        if self.span is not None:
            self.span.set_attribute("outcome", status)
            self.span.end()
            self.span = None


class ExpressStream:
    def __init__(self, deps: ExpressDeps, info: ModelInfo, *, request_id: str, path: str,
                 body: dict[str, Any], sampling: dict[str, Any], stop_token_ids: list[int],
                 ignore_eos: bool, max_tokens: int, num_prompt_tokens: int, tenant: str,
                 parent: trace.Span, logprobs: int | None = None,
                 structured: StructuredOutput | None = None) -> None:
        self.deps = deps
        self.info = info
        self.request_id = request_id
        self._path = path
        self._body = body
        self._sampling = sampling
        self._stop_ids = list(stop_token_ids) + ([] if ignore_eos else
                                                 [t for t in info.eos_token_ids if t not in stop_token_ids])
        self._ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self._num_prompt_tokens = num_prompt_tokens
        self._tenant = tenant
        self._logprobs = logprobs
        self._structured = structured
        self._ctx = trace.set_span_in_context(parent)
        self.prompt_ids: list[int] = []
        self._leg: _Leg | None = None
        self._first: TokenBatch | None = None
        self.num_migrations = 0
        self.failed_nodes: set[str] = set()  # nodes where a leg of this request failed
        self.timings: dict[str, float] = {}
        self.first_leg_id = request_id  # a warm lease's own request id when one served
        self._warm_grant: ClaimGranted | None = None  # logged once the first token is out
        self._legs: list[_Leg] = []  # every leg opened, for close()

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end the completion (the request's stop_token_ids, EOS unless ignore_eos)."""
        return list(self._stop_ids)

    # ---------------------------------------------------------------- one leg

    async def _claim(self, leg_id: str, num_prompt: int, max_tokens: int, wait_ms: int) -> ClaimGranted:
        t0 = time.perf_counter()
        with self.deps.tracer.start_as_current_span("router.claim", context=self._ctx,
                                                    attributes={"request_id": leg_id}):
            while True:
                # No coordinator listens while a standby takes over (about a second): ask again
                # within the claim's own wait rather than leave the lane. A retried claim is
                # answered with the same lease.
                left_ms = max(0, wait_ms - int((time.perf_counter() - t0) * 1000))
                req = claim_request(self.info, leg_id, num_prompt_tokens=num_prompt,
                                    max_tokens=max_tokens, wait_ms=left_ms, tenant=self._tenant,
                                    exclude_nodes=self.failed_nodes)
                try:
                    reply = await self.deps.bus.request(
                        subjects.CLAIM, req, ClaimReply, timeout_s=left_ms / 1000 + self.deps.cfg.claim_margin_s)
                    break
                except BusNoResponders as exc:
                    if left_ms < CLAIM_RETRY_S * 1000:
                        raise ClaimUnanswered(f"coordinator: {exc}") from None
                    await asyncio.sleep(CLAIM_RETRY_S)
                except BusTimeout as exc:
                    raise ClaimUnanswered(f"coordinator: {exc}") from None
                except BusError as exc:  # the bus is down or refused: as unanswered (the standard lane)
                    raise ClaimUnanswered(f"bus: {exc}") from None
        self.deps.metrics.claim_ms.observe((time.perf_counter() - t0) * 1000)
        if isinstance(reply, ClaimRejected):
            if reply.reason not in CAPACITY_REASONS:  # no express node can take it: not back-pressure
                raise LaneFallback(f"claim rejected: {reply.reason}")
            self.deps.metrics.rejected.inc()
            raise rate_limited(
                f"the express lane is saturated ({reply.reason}); retry later or send "
                "'x-expresslane: off'", max(1, -(-reply.retry_after_ms // 1000)))
        return reply

    def _cancel(self, leg: _Leg, reason: str) -> None:
        """Tell node and coordinator to drop the leg (fire and forget)."""
        self.deps.dispatcher.close(leg.id)
        leg.end_span(reason)
        if leg.finished:
            return
        leg.finished = True
        self.deps.metrics.cancels.labels(reason).inc()
        self.deps.spawn(self.deps.bus.publish(subjects.req_cancel(leg.id),  # idempotent: sent again after a
                                              CancelRequest(request_id=leg.id, reason=reason), replay=True))

    async def _open_leg(self, leg_id: str, path: str, body: dict[str, Any], num_prompt: int,
                        max_tokens: int, wait_ms: int, grant: ClaimGranted | None = None,
                        start: SamplingParams | None = None) -> tuple[_Leg, TokenBatch, list[int]]:
        """Claim (unless ``grant``: a warm lease), prefill; return the leg, its first token and the
        prompt ids vLLM saw. ``start``: the node's sampling, for the prefill to start the decode."""
        queue = self.deps.dispatcher.open(leg_id)
        try:
            if grant is None:
                grant = await self._claim(leg_id, num_prompt, max_tokens, wait_ms)
            self.deps.dispatcher.hold(leg_id, grant.node_id, grant.target.slot.slot)
        except (asyncio.CancelledError, ClaimUnanswered) as exc:
            # The client left while the claim waited, or no coordinator answered in time: a lease
            # granted after all (a late answer, a standby restoring the queue) must not hold a slot
            # for a prefill that will never write.
            self.deps.dispatcher.close(leg_id)
            reason = "client_disconnected" if isinstance(exc, asyncio.CancelledError) else "claim_abandoned"
            self.deps.spawn(self.deps.bus.publish(subjects.req_cancel(leg_id), CancelRequest(
                request_id=leg_id, reason=reason, is_before_prefill=True), replay=True))
            raise
        except BaseException:
            self.deps.dispatcher.close(leg_id)
            raise
        leg = _Leg(id=leg_id, grant=grant, queue=queue)
        self._legs.append(leg)
        try:
            first, prompt_ids = await self._prefill(leg, path, body, start)
        except BaseException:
            self._cancel(leg, "prefill_failed")
            raise
        return leg, first, prompt_ids

    async def _prefill(self, leg: _Leg, path: str, body: dict[str, Any],
                       start: SamplingParams | None = None) -> tuple[TokenBatch, list[int]]:
        """The leg's prefill, streamed: returns as soon as the first token is here. With ``start``
        the prefill publishes the token on the bus (``PrefillToken``) the moment vLLM's scheduler
        has it, and starts the decode itself; vLLM's stream carries it too, a little later: the
        first of the two answers (the stream alone when the first token's logprobs are asked for:
        only vLLM renders them). The rest of the stream is read in the background. Whether the KV
        was handed off is not in a streamed answer: a prefill that kept it reports ``KvFailed`` on
        the bus and the lease fails."""
        g = leg.grant
        t0 = time.perf_counter()
        with self.deps.tracer.start_as_current_span("router.prefill", context=self._ctx, kind=SpanKind.CLIENT,
                                                    attributes={"request_id": leg.id, "node_id": g.node_id}) as span:
            body = {**body, "max_tokens": 1, "stream": True, "return_token_ids": True,
                    "kv_transfer_params": handoff_params(g, current_traceparent(), start)}
            if body.get("min_tokens"):
                body["min_tokens"] = 1  # vLLM: at most max_tokens; the node holds back stops after
            for key in ("max_completion_tokens", "stream_options", "stop"):
                body.pop(key, None)
            if self._logprobs is not None:  # ids, not text: the router renders them again
                body["return_tokens_as_token_ids"] = True
            if body.get("include_reasoning") is False:  # else vLLM streams no token ids
                body["include_reasoning"] = True
            streamed = asyncio.ensure_future(self._stream_first(path, body))
            if start is None or self._logprobs is not None:
                first = await streamed
            else:
                first = await self._first_of(leg, streamed)
            source = "bus" if leg.first_from_bus else "stream"
            span.set_attribute("first_token_from", source)
            self.deps.metrics.first_token_source.labels(source).inc()
        self.deps.metrics.prefill_ms.observe((time.perf_counter() - t0) * 1000)
        return first

    async def _stream_first(self, path: str, body: dict[str, Any]) -> tuple[TokenBatch, list[int]]:
        """POST the prefill, streamed; its first token and prompt ids (the rest is drained in the
        background)."""
        url = f"{self.info.url}{path}"
        request = self.deps.http.build_request("POST", url, json=body, headers=inject_headers({}),
                                               timeout=self.deps.cfg.prefill_timeout_s)
        try:
            upstream = await self.deps.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise unreachable(self.info.url, exc) from None
        try:
            if upstream.status_code >= 400:
                raise UpstreamError(upstream.status_code, await upstream.aread(),
                                    upstream.headers.get("content-type", "application/json").split(";")[0])
            lines = upstream.aiter_lines()
            first = await _first_token(lines)
        except httpx.HTTPError as exc:
            await upstream.aclose()
            raise unreachable(self.info.url, exc) from None
        except BaseException:
            await upstream.aclose()
            raise
        self.deps.spawn(_drain(upstream, lines))
        return first

    async def _first_of(self, leg: _Leg, streamed: asyncio.Future) -> tuple[TokenBatch, list[int]]:
        """The first token from whichever comes first: the bus (``PrefillToken``: the decode is
        started already unless vLLM stopped on it) or vLLM's stream (which then also errors)."""
        from_bus = asyncio.ensure_future(self._bus_first(leg))
        try:
            await asyncio.wait({streamed, from_bus}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            from_bus.cancel()
            streamed.cancel()
            raise
        if not from_bus.done() or streamed.done() and streamed.exception() is not None:
            from_bus.cancel()
            return streamed.result()  # vLLM's answer (or its error) came first
        self.deps.spawn(_finish_quietly(streamed, self.request_id, leg.id))
        token: PrefillToken = from_bus.result()
        leg.first_from_bus = True
        finish = "stop" if token.finish_reason == "stop" else None
        return TokenBatch([token.token_id], finish, None), list(token.prompt_token_ids)

    @staticmethod
    async def _bus_first(leg: _Leg) -> PrefillToken:
        while True:
            event = await leg.queue.get()
            if isinstance(event, PrefillToken):
                return event
            leg.early.append(event)  # for _relay, in order

    def _engine_sampling(self, remaining: int, generated: list[int]) -> SamplingParams:
        """The decode node's share of the request's sampling; ``generated`` ends with this leg's
        first token (min_tokens and penalties count what came before it, see SamplingParams; only
        its length and the ids before its last are read, so a first leg's sampling can be built
        before its first token). Prompt ids for repetition_penalty: None before the prefill (the
        prefill fills them in when it starts the decode)."""
        s = self._sampling
        repetition = float(s["repetition_penalty"])
        return SamplingParams(
            max_tokens=remaining, temperature=float(s["temperature"]), top_p=float(s["top_p"]),
            top_k=max(0, int(s["top_k"])), min_p=float(s["min_p"]), repetition_penalty=repetition,
            presence_penalty=float(s["presence_penalty"]), frequency_penalty=float(s["frequency_penalty"]),
            logit_bias=dict(s["logit_bias"]), allowed_token_ids=s["allowed_token_ids"],
            bad_words_token_ids=s["bad_words_token_ids"], min_tokens=max(0, s["min_tokens"] - len(generated)),
            seed=s.get("seed"), stop_token_ids=self._stop_ids, ignore_eos=self._ignore_eos,
            prompt_token_ids=list(self.prompt_ids) if repetition != 1.0 and self.prompt_ids else None,
            output_token_ids=list(generated[:-1]), logprobs=self._logprobs, structured=self._structured)

    async def _start_decode(self, leg: _Leg, first_id: int, num_prompt: int, remaining: int,
                            generated: list[int]) -> None:
        g = leg.grant
        sampling = self._engine_sampling(remaining, generated)
        start = DecodeStart(request_id=leg.id, lease_id=g.lease_id, generation=g.generation,
                            slot=g.target.slot.slot, first_token_id=first_id,
                            num_prompt_tokens=num_prompt, sampling=sampling,
                            migration=self.num_migrations)
        leg.span = self.deps.tracer.start_span("router.decode", context=self._ctx, attributes={
            "request_id": leg.id, "node_id": g.node_id, "slot": g.target.slot.slot})
        if leg.first_from_bus:  # the prefill sent the same DecodeStart already
            leg.span.set_attribute("started_by_prefill", True)
            return
        with trace.use_span(leg.span, end_on_exit=False):
            await self.deps.bus.publish(subjects.decode_start(g.node_id), start, replay=True)

    async def _relay(self, leg: _Leg) -> AsyncIterator[TokenBatch]:
        """The decode node's tokens for one leg (leg-local index 1 onwards), in order."""
        expected = 1
        timeout_s = self.deps.cfg.first_decode_timeout_s
        while True:
            if leg.early:
                event = leg.early.pop(0)
            else:
                try:
                    event = await asyncio.wait_for(leg.queue.get(), timeout_s)
                except asyncio.TimeoutError:
                    raise _LegFailed(f"decode node {leg.grant.node_id} silent for {timeout_s:g} s") from None
            if isinstance(event, PrefillToken):
                continue  # vLLM's stream was first; the first token is out already
            if isinstance(event, TokensGenerated):
                skip = max(0, expected - event.index)
                ids = event.token_ids[skip:]
                if event.index > expected:
                    raise _LegFailed(f"tokens {expected}..{event.index - 1} never arrived")
                expected += len(ids)
                timeout_s = self.deps.cfg.token_timeout_s
                if ids:
                    lps = list(event.logprobs[skip:]) if self._logprobs is not None else None
                    yield TokenBatch(list(ids), logprobs=lps)
            elif isinstance(event, RequestFinished):
                if event.finish_reason == "cancelled":
                    raise _LegFailed("the decode node cancelled the request")
                leg.finished = True
                leg.end_span(event.finish_reason)
                yield TokenBatch([], event.finish_reason)
                return
            elif isinstance(event, RequestFailed):
                raise _LegFailed(f"decode node: {event.reason}")
            elif isinstance(event, HandoffEvent) and event.state in ("failed", "cancelled"):
                raise _LegFailed(f"lease {event.state}: {event.reason}")

    # ---------------------------------------------------------------- the request

    async def open(self) -> list[int]:
        """Claim and prefill the first leg; returns the prompt's token ids."""
        t0 = time.perf_counter()
        warm = self.deps.warm
        now_s = time.monotonic()
        grant = (warm.take(self.info.name, self._num_prompt_tokens + self.max_tokens, int(time.time() * 1000),
                           lambda g: self.deps.nodes.serves_target(g.target, now_s))
                 if warm is not None else None)
        self.first_leg_id = grant.request_id if grant is not None else self.request_id
        if grant is not None:  # the trace still shows where the lease came from
            self.deps.metrics.warm_leases_used.inc()
            self.deps.tracer.start_span("router.claim", context=self._ctx, attributes={
                "request_id": self.first_leg_id, "warm_lease": True, "lease_id": grant.lease_id,
                "node_id": grant.node_id}).end()
            self._warm_grant = grant
        # The prefill starts the decode itself (no round trip through here) when a token is left
        # for the node after the prefill's one.
        start = (self._engine_sampling(self.max_tokens - 1, [-1])
                 if self.max_tokens > 1 and self.deps.cfg.prefill_starts_decode else None)
        self._leg, self._first, self.prompt_ids = await self._open_leg(
            self.first_leg_id, self._path, self._body, self._num_prompt_tokens, self.max_tokens,
            self.deps.cfg.claim_wait_ms, grant, start)
        if self._structured is not None:  # a reasoning gate: did the prompt end the reasoning? (later legs keep it)
            self._structured = self._structured.with_prompt(self.prompt_ids)
        self.timings["open_ms"] = (time.perf_counter() - t0) * 1000
        return self.prompt_ids

    async def tokens(self) -> AsyncIterator[TokenBatch]:
        """Every completion token id, in order (see the module contract)."""
        assert self._leg is not None and self._first is not None, "call open() first"
        leg: _Leg | None = self._leg
        generated: list[int] = []
        batch: TokenBatch | None = self._first
        try:
            while True:
                # a leg's first token (from its prefill), then its decode node's tokens
                generated += batch.token_ids
                remaining = self.max_tokens - len(generated)
                if batch.finish_reason or remaining <= 0:
                    if leg is not None:
                        self._cancel(leg, "finished_at_prefill")
                    yield TokenBatch(batch.token_ids, batch.finish_reason or "length", batch.logprobs)
                    return
                # The token first, then the node's start: the client's first token does not wait
                # for the publish, nor share the host with the node's first step where it does.
                yield batch
                self._log_warm_lease()  # off the first token's path
                await self._start_decode(leg, batch.token_ids[0],
                                         len(self.prompt_ids) + len(generated) - 1, remaining, generated)
                try:
                    async for item in self._relay(leg):
                        generated += item.token_ids
                        yield item
                        if item.finish_reason:
                            self.deps.dispatcher.close(leg.id)
                            return
                    return
                except _LegFailed as exc:
                    _log.warning("express_leg_failed", request_id=self.request_id, leg_id=leg.id,
                                 node_id=leg.grant.node_id, error=str(exc))
                    self.failed_nodes.add(leg.grant.node_id)
                    self._cancel(leg, "migrating")
                    leg = None
                if len(generated) >= self.max_tokens:
                    yield TokenBatch([], "length")
                    return
                leg, batch = await self._migrate(generated)
                if leg is None:
                    async for item in self._continue_standard(generated):
                        generated += item.token_ids
                        yield item
                    return
        finally:
            self.close()  # the live leg, if any, as the client's (the others are finished already)

    def close(self) -> None:
        """End the request's express side in whatever state it is (idempotent): every leg not yet
        finished is cancelled as the client's, its dispatcher queue and slot given up. For the
        response's owner: a streamed body that never started (the client left before the first
        chunk) runs no ``finally`` of its own."""
        self._log_warm_lease()
        for leg in self._legs:
            self._cancel(leg, "client_disconnected")

    def _log_warm_lease(self) -> None:
        """The warm lease the first leg took, logged once the first token is out (the stream's
        task: the request's ids given, not inherited)."""
        if (grant := self._warm_grant) is not None:
            self._warm_grant = None
            with trace.use_span(trace.get_current_span(self._ctx), end_on_exit=False):
                _log.info("express_warm_lease", request_id=self.request_id, leg_id=self.first_leg_id,
                          lease_id=grant.lease_id, node_id=grant.node_id)

    async def _migrate(self, generated: list[int]) -> tuple[_Leg | None, TokenBatch | None]:
        """Another express node for the rest of the request, or (None, None): the standard lane."""
        self.num_migrations += 1
        if self.num_migrations > self.deps.cfg.max_migrations:
            raise ApiError(503, f"request failed after {self.deps.cfg.max_migrations} migrations")
        ids = self.prompt_ids + generated
        remaining = self.max_tokens - len(generated)
        if self.deps.cfg.migrate_to == "express" and self.deps.nodes.live(time.monotonic(), self.info.aliases):
            body = continuation_body(self.info.name, ids, 1, self._vllm_sampling(generated, 1))
            body["stream"] = False
            try:
                leg, first, _ = await self._open_leg(
                    f"{self.request_id}-m{self.num_migrations}", "/v1/completions", body, len(ids),
                    remaining, self.deps.cfg.migrate_wait_ms)
                self.deps.metrics.migrations.labels("express").inc()
                return leg, first
            except (LaneFallback, ApiError, UpstreamError, BusError, httpx.HTTPError) as exc:
                _log.warning("express_migration_fell_back", request_id=self.request_id, error=str(exc))
        self.deps.metrics.migrations.labels("standard").inc()
        return None, None

    def _vllm_sampling(self, generated: list[int], max_tokens: int) -> dict[str, Any]:
        """The request's sampling for a vLLM continuation of ``generated`` (``max_tokens`` more);
        presence/frequency penalties there see ``generated`` as prompt, not output."""
        s = self._sampling
        out = {"temperature": s["temperature"], "top_p": s["top_p"], "seed": s.get("seed"),
               "ignore_eos": self._ignore_eos, "stop_token_ids": self._stop_ids or None,
               "min_p": s["min_p"], "repetition_penalty": s["repetition_penalty"],
               "presence_penalty": s["presence_penalty"], "frequency_penalty": s["frequency_penalty"],
               "logit_bias": {str(k): v for k, v in s["logit_bias"].items()} or None,
               "allowed_token_ids": s["allowed_token_ids"], "bad_words": s["bad_words"] or None,
               "min_tokens": min(max(0, s["min_tokens"] - len(generated)), max_tokens) or None}
        if self._logprobs is not None:
            out.update(logprobs=self._logprobs, return_tokens_as_token_ids=True)
        if s["top_k"]:
            out["top_k"] = s["top_k"]
        return out

    async def _continue_standard(self, generated: list[int]) -> AsyncIterator[TokenBatch]:
        ids = self.prompt_ids + generated
        body = continuation_body(self.info.name, ids, self.max_tokens - len(generated),
                                 self._vllm_sampling(generated, self.max_tokens - len(generated)))
        url = self.deps.cfg.standard_url or self.info.url
        with self.deps.tracer.start_as_current_span("router.continue_standard", context=self._ctx,
                                                    kind=SpanKind.CLIENT):
            headers = inject_headers({})
        async for batch in continue_tokens(self.deps.http, url, body, headers, self.deps.cfg.standard_timeout_s):
            yield batch
