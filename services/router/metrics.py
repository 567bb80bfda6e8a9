"""Prometheus metrics of the router, in a registry of their own (one per app instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("expresslane_router_requests", "Requests by endpoint, lane and status",
                                ["endpoint", "lane", "status"], registry=r)
        self.lane_reasons = Counter("expresslane_router_lane_decisions", "Lane decisions by reason",
                                    ["lane", "reason"], registry=r)
        self.rejected = Counter("expresslane_router_claims_rejected", "Claims the coordinator refused",
                                registry=r)
        self.fallbacks = Counter("expresslane_router_express_fallbacks",
                                 "Express requests served by the standard lane before any token",
                                 ["reason"], registry=r)
        self.migrations = Counter("expresslane_router_migrations", "Mid-stream migrations by target",
                                  ["target"], registry=r)
        self.cancels = Counter("expresslane_router_cancels", "Cancels published", ["reason"], registry=r)
        self.warm_leases_used = Counter("expresslane_router_warm_leases_used",
                                        "Express requests that took a warm lease (no claim round trip)",
                                        registry=r)
        self.active = Gauge("expresslane_router_active_streams", "Responses in progress", ["lane"],
                            registry=r)
        self.ttft_ms = Histogram("expresslane_router_ttft_ms", "Time to first token (ms)", ["lane"],
                                 buckets=_MS_BUCKETS, registry=r)
        self.prefill_ms = Histogram("expresslane_router_prefill_ms", "Express prefill leg (ms)",
                                    buckets=_MS_BUCKETS, registry=r)
        self.claim_ms = Histogram("expresslane_router_claim_ms", "Claim round trip (ms)",
                                  buckets=_MS_BUCKETS, registry=r)
        self.first_token_source = Counter(
            "expresslane_router_first_token_source",
            "Express legs by where their first token came from: bus (the prefill's PrefillToken, the "
            "decode started by the prefill) or stream (vLLM's response)", ["source"], registry=r)
        self.completion_tokens = Counter("expresslane_router_completion_tokens",
                                         "Completion tokens streamed", ["lane"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
