"""shared.tracing.extract_context: the context a message's or request's headers carry, as OpenTelemetry's
global propagator reads it, remembered per distinct trace headers."""

from __future__ import annotations

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.tracing import extract_context

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TP2 = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def seen(ctx):
    sc = trace.get_current_span(ctx).get_span_context()
    return sc.trace_id, sc.span_id, sc.trace_flags, sc.is_remote, str(sc.trace_state), baggage.get_all(ctx)


@pytest.mark.parametrize("headers", [
    None, {},
    {"traceparent": TP},
    {"traceparent": TP2},  # another trace: not the first one's context
    {"traceparent": TP, "tracestate": "vendor=1", "content-length": "12", "x-expresslane": "on"},
    {"traceparent": TP, "baggage": "tenant=voice"},
    {"traceparent": "00-not-a-traceparent"},
    {"content-type": "application/json"},
])
def test_the_context_is_the_global_propagators(headers):
    for _ in range(2):  # the second call comes from the cache
        assert seen(extract_context(headers)) == seen(propagate.extract(headers or {}))


def test_a_new_global_propagator_is_used():
    before = propagate.get_global_textmap()
    try:
        propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator()]))
        ctx = extract_context({"traceparent": TP, "baggage": "tenant=voice"})
        assert baggage.get_all(ctx) == {} and trace.get_current_span(ctx).get_span_context().is_valid
        propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator()]))
        ctx = extract_context({"traceparent": TP, "baggage": "tenant=voice"})
        assert baggage.get_all(ctx) == {"tenant": "voice"}
        assert not trace.get_current_span(ctx).get_span_context().is_valid
    finally:
        propagate.set_global_textmap(before)
