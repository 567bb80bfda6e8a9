"""Prometheus metrics of the coordinator, read from the core at scrape time.

Gauges: queue depth, free slots, held leases, live nodes, whether this coordinator leads
(``xl_coord_is_leader``). Counters: every core counter (claims, grants, rejections by reason, lease
outcomes, stale messages, dead nodes), leadership won and lost by reason
(``xl_coord_leadership{change}``). Histograms:
queue wait, transfer (claimed -> kv_ready) and handoff (claim -> decoding) latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.coordinator.core import CoordinatorCore
from services.coordinator.leadership import Leadership

_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _CoreCollector:
    def __init__(self, core: CoordinatorCore, leadership: Leadership | None) -> None:
        self.core, self.leadership = core, leadership

    def collect(self):
        core = self.core
        for name, doc, value in (
            ("xl_coord_queue_depth", "Claims waiting for a slot", len(core.queue)),
            ("xl_coord_free_slots", "Slots that could be leased now", core.num_free_slots()),
            ("xl_coord_leases", "Leases held (live or fencing)", len(core.leases)),
            ("xl_coord_nodes", "Decode nodes known", len(core.nodes)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        outcomes = CounterMetricFamily("xl_coord_lease_outcomes", "Leases ended", labels=["outcome"])
        events = CounterMetricFamily("xl_coord_events", "Coordinator events", labels=["event"])
        for key, value in sorted(core.counters.items()):
            if key.startswith("lease_outcome."):
                outcomes.add_metric([key.split(".", 1)[1]], value)
            else:
                events.add_metric([key], value)
        yield outcomes
        yield events
        if self.leadership is not None:
            is_leader = self.leadership.role == "leader"
            yield GaugeMetricFamily("xl_coord_is_leader", "1 while this coordinator leads",
                                    value=int(is_leader))
            changes = CounterMetricFamily("xl_coord_leadership", "Leadership won and lost",
                                          labels=["change"])
            for key, value in sorted(self.leadership.counters.items()):
                changes.add_metric([key], value)
            yield changes


class CoordinatorMetrics:
    def __init__(self, core: CoordinatorCore, leadership: Leadership | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(core, leadership))
        self.histograms = {
            name: Histogram(f"xl_coord_{name}_seconds", doc, buckets=_BUCKETS_S, registry=self.registry)
            for name, doc in (
                ("queue_wait", "Claim arrival to grant"),
                ("transfer", "Grant to KV-ready"),
                ("handoff", "Claim arrival to decoding"),
            )
        }

    def observe(self, metric: str, value_s: float) -> None:
        histogram = self.histograms.get(metric)
        if histogram is not None:
            histogram.observe(max(0.0, value_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)
