"""The decode node's observability: ``/health``, ``/metrics`` (read-only views of its slot core)
and each lease's trace span.

``/health``: 200 with ``status: ok`` while connected and not draining, else 503 (``draining`` or
``unavailable``); the body lists total and free slots, the slots the engine holds (``active``) and
the stale halves ignored. ``/metrics`` (Prometheus): active and free slots, stale halves, one
counter per node event (``xl_decode_events{event=...}``), the engine step time histogram and the
KV checksum verification time histogram (``xl_decode_kv_verify_seconds``, opt-in checksums), and
with MTP drafts the speculation totals per model as vLLM's spec-decode metrics name them
(``xl_decode_spec_decode_num_drafts``: steps that verified drafts, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos{position}``; the mean acceptance
length is 1 + accepted tokens / drafts).
Traces: a lease's ``decode`` span is a child of the context its ``DecodeStart`` came with; the
node's messages for the lease are sent inside it; it ends when the lease leaves the node.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.decode.effects import Finished, StartEngine
from services.decode.slots import SlotCore

STEP_BUCKETS_S = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
                  0.25, 1)  # fine from 1 to 5 ms: where a step of a small model or one GPU lands


class NodeStatus:
    """Health and metrics of one decode node (its own registry, no module globals)."""

    def __init__(self, core: SlotCore, is_connected: Callable[[], bool],
                 is_draining: Callable[[], bool], spec_counters: Callable[[], dict] | None = None,
                 model: str = "") -> None:
        self.core, self.is_connected, self.is_draining = core, is_connected, is_draining
        self.spec_counters, self.model = spec_counters, model  # the engine's totals (engine.spec_counters)
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.step_seconds = Histogram("xl_decode_step_seconds", "One engine step over all slots",
                                      registry=self.registry, buckets=STEP_BUCKETS_S)
        self.requests = Counter("xl_decode_requests", "Requests ended, by the path that decoded them "
                                "(fast, reference, cpu-fused: the Llama family's one-token CPU step in one call; "
                                "mixed: some steps each; none: no step)",
                                ["path"], registry=self.registry)
        self.steps = Counter("xl_decode_steps", "Engine steps by path (a batched step counts once)",
                             ["path"], registry=self.registry)
        self.kv_verify_seconds = Histogram("xl_decode_kv_verify_seconds",
                                           "Verifying one KV-ready's segment checksums",
                                           registry=self.registry, buckets=STEP_BUCKETS_S)

    @property
    def routes(self) -> dict[str, Callable[[], tuple[int, str, bytes]]]:
        return {"/health": self.health, "/metrics": self.metrics}

    def collect(self):
        core = self.core
        yield GaugeMetricFamily("xl_decode_active_slots", "Slots decoding", value=len(core.engine_slots()))
        yield GaugeMetricFamily("xl_decode_free_slots", "Slots free", value=len(core.free_slots()))
        yield CounterMetricFamily("xl_decode_stale_ignored", "Stale start/KV-ready ignored",
                                  value=core.num_stale)
        family = CounterMetricFamily("xl_decode_events", "Decode node events", labels=["event"])
        for key, value in sorted(core.counters.items()):
            family.add_metric([key], value)
        yield family
        spec = self.spec_counters() if self.spec_counters is not None else None
        if spec is not None:
            for name, key, what in (("num_drafts", "steps", "Steps that verified MTP drafts"),
                                    ("num_draft_tokens", "draft_tokens", "MTP draft tokens verified"),
                                    ("num_accepted_tokens", "accepted_tokens", "MTP draft tokens accepted")):
                f = CounterMetricFamily(f"xl_decode_spec_decode_{name}", what, labels=["model"])
                f.add_metric([self.model], spec[key])
                yield f
            f = CounterMetricFamily("xl_decode_spec_decode_num_accepted_tokens_per_pos",
                                    "MTP draft tokens accepted, by draft position", labels=["model", "position"])
            for pos, n in enumerate(spec["accepted_per_pos"]):
                f.add_metric([self.model, str(pos)], n)
            yield f

    def health(self) -> tuple[int, str, bytes]:
        is_connected, is_draining = self.is_connected(), self.is_draining()
        is_ok = is_connected and not is_draining
        body = {"status": "ok" if is_ok else ("draining" if is_draining else "unavailable"),
                "node_id": self.core.node_id, "connected": is_connected,
                "total_slots": self.core.num_slots, "free_slots": self.core.free_slots(),
                "active": self.core.engine_slots(), "stale_ignored": self.core.num_stale}
        return (200 if is_ok else 503), "application/json", json.dumps(body).encode()

    def metrics(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4", generate_latest(self.registry)


class DecodePaths:
    """Per lease: why it could not take the fast path (from its start) and how many of its steps
    each path served, so the node can say which path decoded each request."""

    def __init__(self) -> None:
        self.reasons: dict[str, str | None] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def start(self, lease_id: str, fast_path_reason: str | None) -> None:
        self.reasons[lease_id], self.counts[lease_id] = fast_path_reason, {}

    def step(self, lease_id: str, path: str) -> None:
        counts = self.counts.get(lease_id)
        if counts is not None:
            counts[path] = counts.get(path, 0) + 1

    def end(self, lease_id: str) -> tuple[str, str | None]:
        """(fast | reference | cpu-fused | mixed | none, the fast path's refusal or None); forgets the lease."""
        counts, reason = self.counts.pop(lease_id, {}), self.reasons.pop(lease_id, None)
        paths = sorted(p for p, n in counts.items() if n)
        return (paths[0] if len(paths) == 1 else "mixed" if paths else "none"), reason


class LeaseTraces:
    """Per lease: the trace context its DecodeStart came with, then its ``decode`` span."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.tracer = trace.get_tracer("expresslane.decode")
        self.contexts: dict[str, otel_context.Context] = {}  # lease id -> DecodeStart's context
        self.spans: dict[str, trace.Span] = {}  # lease id -> its decode span

    def remember(self, lease_id: str) -> None:
        """Keep the current context (the DecodeStart handler's) as the lease's parent."""
        self.contexts[lease_id] = otel_context.get_current()

    def start(self, work: StartEngine) -> None:
        self.spans[work.lease_id] = self.tracer.start_span(
            "decode", context=self.contexts.pop(work.lease_id, None),
            attributes={"expresslane.request_id": work.request_id, "expresslane.slot": work.slot,
                        "expresslane.node_id": self.node_id})

    def use(self, lease_id: str):
        """A context manager: what is sent inside it belongs to the lease's span (if it has one)."""
        span = self.spans.get(lease_id)
        return contextlib.nullcontext() if span is None else trace.use_span(span, end_on_exit=False)

    def finished(self, e: Finished, path: str = "", fast_path_reason: str | None = None) -> None:
        span = self.spans.get(e.lease_id)
        if span is not None:
            span.set_attribute("expresslane.completion_tokens", e.num_completion_tokens)
            span.set_attribute("expresslane.outcome", e.outcome)
            span.set_attribute("expresslane.decode_path", path)
            if fast_path_reason:
                span.set_attribute("expresslane.fast_path_reason", fast_path_reason)

    def forget(self, lease_id: str) -> None:
        self.contexts.pop(lease_id, None)
        span = self.spans.pop(lease_id, None)
        if span is not None:
            span.end()
