"""OpenTelemetry set-up from the standard ``OTEL_*`` variables, and W3C trace context helpers.

Contract:
    setup_tracing(service_name) -> Tracer
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT set: spans are exported
        with OTLP/HTTP (protobuf) in batches (the exporter reads its other OTEL_EXPORTER_OTLP_*
        variables itself). Neither set, OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true:
        nothing is exported, but spans still get real ids, so ``traceparent`` propagation and the
        trace ids in logs work the same. OTEL_SERVICE_NAME overrides ``service_name``;
        OTEL_RESOURCE_ATTRIBUTES adds resource attributes. The first call installs the global
        provider; later calls in the same process reuse it.
    build_tracer_provider(service_name, env) -> TracerProvider   (the pure part; tests use it)
    inject_headers(headers)           # adds "traceparent" (and "tracestate") of the current span
    extract_context(headers) -> Context
    current_traceparent() -> str      # "" when no span is active
    context_from_traceparent(tp) -> Context
    current_trace_id_hex() -> str     # 32 hex digits, "" when no span is active
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_TRACEPARENT = TraceContextTextMapPropagator()


def otlp_traces_endpoint(env: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL the standard variables ask for, or "" for no export."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    exporters = env.get("OTEL_TRACES_EXPORTER", "otlp").lower().replace(" ", "").split(",")
    if "otlp" not in exporters:
        return ""
    explicit = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if explicit:
        return explicit
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return f"{base.rstrip('/')}/v1/traces" if base else ""


def build_tracer_provider(service_name: str, env: Mapping[str, str] = os.environ) -> TracerProvider:
    """A provider for ``service_name`` exporting where ``env`` says (nowhere if it says nothing)."""
    name = env.get("OTEL_SERVICE_NAME", "").strip() or service_name
    resource = Resource.create({"service.name": name})  # adds OTEL_RESOURCE_ATTRIBUTES itself
    provider = TracerProvider(resource=resource)
    endpoint = otlp_traces_endpoint(env)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def setup_tracing(service_name: str) -> trace.Tracer:
    """Install the process's tracer provider from OTEL_* (once) and return a tracer."""
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        trace.set_tracer_provider(build_tracer_provider(service_name))
    return trace.get_tracer(service_name)


def shutdown_tracing() -> None:
    """Flush and stop the exporter (also done at interpreter exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (``traceparent``, ``tracestate``) to ``headers``."""
    propagate.inject(headers)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context carried by ``headers`` (an empty context when there is none). Only the headers
    the global propagator reads (its ``fields``) are looked at, and the context they make is remembered:
    a stream's every message carries the same ``traceparent``, and parsing it each time was ~8% of the
    router's CPU on the token path."""
    textmap = propagate.get_global_textmap()
    items = tuple((f, headers[f]) for f in sorted(textmap.fields) if f in headers) if headers else ()
    return _extract(textmap, items)


@functools.lru_cache(maxsize=4096)
def _extract(textmap, items: tuple[tuple[str, str], ...]) -> otel_context.Context:
    return textmap.extract(dict(items))  # a new Context from the carrier alone: the same for the same items


def current_traceparent() -> str:
    """The W3C traceparent of the current span, or "" when no span is active."""
    carrier: dict[str, str] = {}
    _TRACEPARENT.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    """A context whose parent is the span named by ``traceparent`` (empty if it is invalid)."""
    return _TRACEPARENT.extract({"traceparent": traceparent} if traceparent else {})


def current_trace_id_hex() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def current_span_id_hex() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.span_id, "016x") if ctx.is_valid else ""
