"""``expresslane router``: the OpenAI-compatible endpoint in front of both lanes.

Contract:
- ``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, usage,
  ``stream_options.include_usage``, ``return_token_ids``): validated (OpenAI error body and 4xx on
  bad input), optional Bearer API keys (key -> tenant), lane chosen by services.router.policy. The
  response says which lane served it in ``x-expresslane-lane``.
- Express lane: services.router.express, detokenized here with the model's tokenizer and the
  request's stop strings. Standard lane: forwarded to the native pool or the prefill vLLM.
- ``GET /v1/models`` (models of the configured vLLM servers), ``GET /health`` (200 once every
  vLLM server answered; lists the express capacity per model), ``GET /metrics`` (Prometheus;
  with ``metrics_require_api_key``, only for a Bearer key of ``api_keys``).
- Every error is an OpenAI error body, including unknown routes (404), wrong methods (405, with
  ``Allow``), framework validation (400) and bugs (500).
- One span per request (``router.request``, parent: the client's ``traceparent`` if any) with child
  spans per hop (claim, prefill, decode); logs carry request_id and trace_id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router import backend, standard
from services.router.config import RouterConfig
from services.router.errors import ApiError, http_error, invalid_fields
from services.router.dispatch import Dispatcher
from services.router.express import ExpressDeps, ExpressStream, LaneFallback, claim_request
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from services.router import vllm_surface
from services.router.policy import HEADER, LaneDecision, LaneInputs, choose_lane
from services.router.respond import express_response
from services.router.transport import AiohttpTransport
from services.router.validate import ParsedRequest, parse_body, parse_request
from services.router.vllm_surface import Surface
from services.router.warm import WarmLeases
from services.router.sampling import bad_words_token_ids
from shared import subjects
from shared.bus import Bus, BusError, BusUnavailable
from shared.events import CancelRequest, ClaimGranted, ClaimReply, NodeMessage
from shared.gcheap import GcPauses, freeze_heap
from shared.log import get_logger
from shared.tracing import extract_context, inject_headers, setup_tracing

_log = get_logger("services.router")
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# --vllm-surface auto: how long /health waits for vLLM's serving code to load before saying ok without it
SURFACE_READY_WAIT_S = 120.0
WARM_INTERVAL_S = 0.1  # how often warm leases are topped up and aged ones released


class Router:
    """The router's state: config, bus, HTTP client, models, nodes."""

    def __init__(self, cfg: RouterConfig, settle_heap: bool = False) -> None:
        """``settle_heap`` (the router process's own entry point): measure the collector's pauses, and freeze
        the heap once everything is loaded, before /health says ready (shared.gcheap)."""
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self._settle_heap = settle_heap
        self.gc_pauses: GcPauses | None = None  # from the freeze on: the pauses while serving
        self.nodes = NodeTable()
        self.dispatcher = Dispatcher()
        self.models: dict[str, backend.ModelInfo] = {}
        self.discovered: set[str] = set()
        self.bus: Bus | None = None
        # httpx's API over aiohttp's pool and parser: less of the router's CPU on each first token's path
        self.http = httpx.AsyncClient(transport=AiohttpTransport(max_connections=1000))
        self.tracer = setup_tracing("router")
        self._tasks: set[asyncio.Task] = set()
        self._next_decode = -1
        self._surface_load_started = time.monotonic()  # reset when start() begins the load
        self.warm = WarmLeases(cfg.warm_leases)
        self.surface = Surface(cfg.tool_call_parser, cfg.reasoning_parser, cfg.enable_auto_tool_choice,
                               cfg.tool_strict_level, default_chat_template_kwargs=cfg.default_chat_template_kwargs,
                               structured_in_reasoning=cfg.structured_in_reasoning)

    # ---------------------------------------------------------------- lifecycle

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background (kept referenced until done); a failure is logged, not lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            _log.warning("background_task_failed", task=task.get_coro().__qualname__, error=repr(exc))

    @functools.cached_property
    def _surface_wanted(self) -> bool:
        return self.cfg.vllm_surface == "on" or (self.cfg.vllm_surface == "auto" and vllm_surface.available())

    async def start(self) -> None:
        if self._surface_wanted:
            self._surface_load_started = time.monotonic()
            self.spawn(asyncio.to_thread(self.surface.load))
        self.spawn(self._connect_bus())
        for url in self.cfg.prefill_urls:
            self.spawn(self._discover(url))
        if self._settle_heap:
            self.spawn(self._freeze_when_loaded())

    async def _freeze_when_loaded(self) -> None:
        while not self._loaded:
            await asyncio.sleep(0.05)
        _log.info("gc_heap_frozen", **freeze_heap())  # one pause (~0.3 s on 2 cores), before ready
        self.gc_pauses = GcPauses(self.metrics.registry, "expresslane_router")

    async def stop(self) -> None:
        if self.bus is not None:
            for grant in self.warm.drain():
                await self._release(grant.request_id, "router_stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()
        await self.http.aclose()
        if self.gc_pauses is not None:
            self.gc_pauses.close()

    async def _connect_bus(self) -> None:
        while True:
            try:
                bus = await Bus.connect(self.cfg.nats_url, name="router", auth=self.cfg.bus_auth)
                break
            except BusUnavailable as exc:
                _log.warning("bus_unavailable_retrying", error=str(exc))
                await asyncio.sleep(1.0)
        await self.dispatcher.start(bus)
        await bus.subscribe(subjects.NODE_AVAIL_ALL, self._on_node, NodeMessage)
        self.bus = bus
        if self.warm.size:
            self.spawn(self._warm_loop())

    # ---------------------------------------------------------------- warm leases

    async def _warm_loop(self) -> None:
        """Keep each model's warm leases claimed (services.router.warm); release aged ones."""
        while True:
            try:
                now_ms = int(time.time() * 1000)
                now_s = time.monotonic()
                for grant in self.warm.aged(now_ms):
                    await self._release(grant.request_id, "warm_lease_aged")
                for grant in self.warm.stale(lambda g: self.nodes.serves_target(g.target, now_s)):
                    await self._release(grant.request_id, "warm_lease_node_changed")
                for info in list(self.models.values()):
                    capacity = self.nodes.slot_capacity(info.aliases, now_s)
                    if not capacity:
                        continue
                    # a slot an open leg holds is busy, whatever its node's last beat says
                    free = self.nodes.free_slots(info.aliases, now_s) - self.dispatcher.slots_in_use()
                    for _ in range(self.warm.wanted(info.name, len(free))):
                        self.warm.claiming(info.name)
                        self.spawn(self._warm_claim(info, capacity))
            except Exception:
                _log.exception("warm_lease_loop_failed")
            await asyncio.sleep(WARM_INTERVAL_S)

    async def _warm_claim(self, info: backend.ModelInfo, capacity: int) -> None:
        request_id = uuid.uuid4().hex
        # the largest request a slot holds: the grant is good for any request the lane takes
        claim = claim_request(info, request_id, num_prompt_tokens=1, max_tokens=max(capacity - 1, 1),
                              wait_ms=0)
        try:
            reply = await self.bus.request(subjects.CLAIM, claim, ClaimReply,
                                           timeout_s=self.cfg.claim_margin_s)
        except BusError:  # unanswered: a late grant must not hold a slot
            await self._release(request_id, "claim_abandoned")
            return
        finally:
            self.warm.claimed(info.name)
        if isinstance(reply, ClaimGranted):
            self.warm.add(info.name, reply, int(time.time() * 1000))

    async def _release(self, request_id: str, reason: str) -> None:
        """Cancel a claim no prefill ever used (its slot comes back at once)."""
        try:
            await self.bus.publish(subjects.req_cancel(request_id), CancelRequest(
                request_id=request_id, reason=reason, is_before_prefill=True))
        except BusError as exc:
            _log.warning("warm_lease_release_failed", error=str(exc))

    async def _on_node(self, event: Any, msg: Any) -> None:
        self.nodes.observe(event, time.monotonic())

    async def _discover(self, url: str) -> None:
        while url not in self.discovered:
            try:
                for info in await backend.discover(self.http, url, self.cfg.tokenizers):
                    self.models[info.name] = info
                self.discovered.add(url)
                _log.info("models_discovered", url=url, models=sorted(self.models))
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                _log.info("vllm_not_ready", url=url, error=str(exc)[:200])
                await asyncio.sleep(1.0)
            except Exception:
                _log.exception("model_discovery_failed", url=url)
                await asyncio.sleep(2.0)

    @property
    def heap_settled(self) -> bool:
        """The heap is frozen (and the pauses measured) since everything loaded."""
        return self.gc_pauses is not None

    @property
    def is_ready(self) -> bool:
        return self._loaded and (self.heap_settled or not self._settle_heap)

    @property
    def _loaded(self) -> bool:
        # parsers configured (or --vllm-surface on): vLLM's serving code must be loaded before the lane answers.
        # Otherwise, where it is wanted, its load must have ended (loaded or given up): the import holds the GIL
        # and a core for seconds, and requests answered meanwhile stall behind it (first tokens 20-300 ms late
        # on a 2-core host, the first ~2 s after health said ok)
        if self.cfg.tool_call_parser or self.cfg.reasoning_parser or self.cfg.vllm_surface == "on":
            surface_ok = self.surface.ready
        else:  # a load that hangs past SURFACE_READY_WAIT_S stops holding the router back (those requests
            # keep the standard lane until it ends), as a router without vLLM would serve
            surface_ok = (self.surface.ready or bool(self.surface.error) or not self._surface_wanted
                          or time.monotonic() - self._surface_load_started > SURFACE_READY_WAIT_S)
        return self.discovered == set(self.cfg.prefill_urls) and surface_ok

    def express_capacity(self) -> dict[str, int | None]:
        now = time.monotonic()
        return {name: self.nodes.slot_capacity(info.aliases, now) for name, info in self.models.items()}

    # ---------------------------------------------------------------- requests

    def _tenant(self, request: Request) -> str:
        if not self.cfg.api_keys:
            return ""
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        tenant = self.cfg.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        return tenant

    def _sampling(self, info: backend.ModelInfo, req: ParsedRequest) -> dict[str, Any]:
        """The request's sampling as vLLM would apply it (the model's defaults where unset)."""
        d = info.defaults
        out: dict[str, Any] = {name: d.get(name) if getattr(req, name) is None else getattr(req, name)
                               for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                            "presence_penalty", "frequency_penalty")}
        out.update(seed=req.seed, min_tokens=req.min_tokens, logit_bias=req.logit_bias,
                   allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                   bad_words_token_ids=bad_words_token_ids(info.tokenizer, req.bad_words))
        return out

    async def handle(self, request: Request, endpoint: str) -> Response:
        request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        span = self.tracer.start_span("router.request", context=extract_context(dict(request.headers)),
                                      kind=SpanKind.SERVER,
                                      attributes={"request_id": request_id, "endpoint": endpoint})
        lane, reason = "none", ""
        try:
            with trace.use_span(span, end_on_exit=False):
                response, lane, reason = await self._handle(request, endpoint, request_id, span)
        except ApiError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except standard.UpstreamError as exc:
            response = exc.response()
        except Exception as exc:  # a bug: still an OpenAI error body, and the span ends
            _log.exception("request_failed")
            span.record_exception(exc)
            err = ApiError(500, f"internal error in the router: {type(exc).__name__}", code="internal_error")
            response = JSONResponse(err.body(), status_code=500)
        response.headers["x-request-id"] = request_id
        response.headers["x-expresslane-lane"] = lane
        if reason:
            response.headers["x-expresslane-reason"] = _header_text(reason)
        span.set_attribute("lane", lane)
        span.set_attribute("http.status_code", response.status_code)
        self.metrics.requests.labels(endpoint, lane, str(response.status_code)).inc()
        if not (isinstance(response, StreamingResponse) and lane == "express"):
            span.end()  # an express stream ends its span when the stream ends
        structlog.contextvars.unbind_contextvars("request_id")
        return response

    async def _handle(self, request: Request, endpoint: str, request_id: str,
                      span: trace.Span) -> tuple[Response, str, str]:
        t_arrival = time.perf_counter()
        tenant = self._tenant(request)
        req = parse_request(endpoint, parse_body(await request.body()))  # type: ignore[arg-type]
        info = self.models.get(req.model)
        if info is None:
            raise ApiError(404, f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found")
        now_s = time.monotonic()
        capacity = self.nodes.slot_capacity(info.aliases, now_s) if self.bus else None
        num_prompt = _prompt_tokens(info, req, self.nodes.smallest_slot_capacity(info.aliases, now_s)
                                    if self.bus else None)
        max_tokens = req.max_tokens or max(info.max_model_len - num_prompt, 1)
        if info.max_model_len and num_prompt + max_tokens > info.max_model_len:
            raise ApiError(400, (
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} in the completion)."), param="max_tokens", code="context_length_exceeded")
        prepared, refused = self._prepare(info, req)
        decision = choose_lane(self.cfg.policy, LaneInputs(
            model=req.model, tenant=tenant, header=request.headers.get(HEADER),
            blockers=tuple(req.express_blockers), max_tokens=max_tokens,
            num_prompt_tokens=num_prompt, slot_capacity=capacity)) if not refused else LaneDecision(
            "standard", f"vLLM answers it: {refused}")
        self.metrics.lane_reasons.labels(decision.lane, decision.reason.split(":")[0]).inc()
        span.set_attribute("lane_reason", decision.reason)
        if decision.lane == "express":
            es = ExpressStream(
                self._deps(), info, request_id=request_id, path=_PATHS[endpoint], body=req.body,
                sampling=self._sampling(info, req), stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, num_prompt_tokens=num_prompt,
                tenant=tenant, parent=span,
                logprobs=prepared.logprobs if prepared is not None else None,
                structured=prepared.structured if prepared is not None else None)
            try:
                await es.open()
                try:
                    response = await express_response(es, req, info, request_id, span, t_arrival, self.metrics,
                                                      self.surface, prepared)
                except BaseException:  # the legs opened must not outlive a response never sent
                    es.close()
                    raise
                response.headers["x-expresslane-leg"] = es.first_leg_id
                return response, "express", decision.reason
            except LaneFallback as exc:
                _log.warning("express_fallback", reason=str(exc))
                self.metrics.fallbacks.labels("coordinator").inc()
                decision = LaneDecision("standard", f"fallback: {exc}")
        headers = inject_headers({})
        if not self.cfg.standard_url and self.cfg.native_decode_urls:
            self._next_decode = (self._next_decode + 1) % len(self.cfg.native_decode_urls)
            resp = await standard.forward_native_pool(
                self.http, info.url, self.cfg.native_decode_urls[self._next_decode], _PATHS[endpoint],
                req.body, req.stream, headers, self.cfg.standard_timeout_s)
        else:
            resp = await standard.forward(self.http, self.cfg.standard_url or info.url, _PATHS[endpoint],
                                          req.body, req.stream, headers, self.cfg.standard_timeout_s)
        return resp, "standard", decision.reason

    def _prepare(self, info: backend.ModelInfo, req: ParsedRequest) -> tuple[Any, str]:
        """vLLM's reading of a request that needs its serving code (services.router.vllm_surface):
        (prepared or None, why vLLM refuses it or ""). What the lane cannot honour is added to the
        request's blockers."""
        reasoning = req.endpoint == "chat" and bool(self.cfg.reasoning_parser)
        if not (req.vllm_fields or reasoning):
            return None, ""
        if not self.surface.ready:
            why = self.surface.error or "loading" if self._surface_wanted else "off"
            req.express_blockers.extend(f"{name} (vLLM's serving code in the router: {why})"
                                        for name in (req.vllm_fields or ["reasoning"]))
            return None, ""
        try:
            prepared = self.surface.prepare(req.endpoint, req.body, info)
        except ValueError as exc:  # vLLM answers with its own 400 on the standard lane
            return None, str(exc).splitlines()[0][:200]
        if prepared.blocker:
            req.express_blockers.append(prepared.blocker)
        return prepared, ""

    def _deps(self) -> ExpressDeps:
        assert self.bus is not None
        return ExpressDeps(bus=self.bus, http=self.http, dispatcher=self.dispatcher, nodes=self.nodes,
                           metrics=self.metrics, tracer=self.tracer, spawn=self.spawn, cfg=self.cfg,
                           warm=self.warm)

def _prompt_tokens(info: backend.ModelInfo, req: ParsedRequest, smallest_slot: int | None) -> int:
    """The prompt's length for the checks before the prefill (the model's context, a decode slot,
    the claim): a cheap upper bound where it passes each check (so the exact count would too: the
    request names max_tokens and fits both the model and, with a live node, every live node's slot,
    ``smallest_slot``, so that a claim sized by it excludes no node the exact count would fit), else
    the exact count. The tokenizer costs ~0.5 ms a thousand tokens on the first token's way; the
    bound is only ever larger, and vLLM's count stays authoritative after the prefill."""
    if req.max_tokens:
        bound = backend.prompt_tokens_at_most(info, req)
        if (bound is not None and (not info.max_model_len or bound + req.max_tokens <= info.max_model_len)
                and (smallest_slot is None or bound + req.max_tokens <= smallest_slot)):
            return bound
    return backend.count_prompt_tokens(info, req)


def _header_text(text: str) -> str:
    """A header-safe (latin-1, one line) version of ``text``."""
    return " ".join(text.encode("latin-1", "replace").decode("latin-1").split())[:300]


def create_app(cfg: RouterConfig, settle_heap: bool = False) -> FastAPI:
    router = Router(cfg, settle_heap=settle_heap)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="expresslane router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            router._tenant(request)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        now = int(time.time())
        data = [{"id": m.name, "object": "model", "created": now, "owned_by": "expresslane",
                 "root": m.root, "max_model_len": m.max_model_len} for m in router.models.values()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        body = {"status": "ok" if router.is_ready else "starting", "bus": router.bus is not None,
                "models": sorted(router.models), "express_capacity": router.express_capacity(),
                "warm_leases": router.warm.held_ids(), "nodes": router.nodes.describe(time.monotonic()),
                "vllm_surface": router.surface.ready,
                "missing": sorted(set(cfg.prefill_urls) - router.discovered)}
        return JSONResponse(body, status_code=200 if router.is_ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if cfg.metrics_require_api_key:
            try:
                router._tenant(request)
            except ApiError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    _add_error_handlers(app)
    return app


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _add_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for what no handler answers: FastAPI's own {"detail": ...} never shows."""

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        allow = (exc.headers or {}).get("Allow", "")
        return _error_response(http_error(exc.status_code, request.method, request.url.path, allow))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(invalid_fields(list(exc.errors())))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        _log.exception("unhandled_error", path=request.url.path)
        return _error_response(ApiError(500, f"internal error in the router: {type(exc).__name__}",
                                        code="internal_error"))


def main(argv: list[str]) -> int:
    import uvicorn

    from services.router.config import build_parser, from_args
    from shared import config as shared_config
    from shared.log import setup_logging

    parser = build_parser()
    args = shared_config.parse_args(parser, argv)
    try:
        cfg = from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("router", level=args.log_level, json=args.log_format == "json")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(cfg, settle_heap=True)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=5))
    server.run()
    return 0
