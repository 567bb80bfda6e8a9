"""The garbage collector in a latency-critical process: its heap frozen once the service has loaded,
and every collection's pause measured.

Why: a router with vLLM's serving code imported holds ~630k objects, a decode node ~200k (torch,
transformers). CPython's full collection walks all of them (0.25-0.4 s on a 2-core host) and holds the
GIL meanwhile: every stream the process relays, every step it runs, waits. It comes whenever the objects
promoted since the last one pass a quarter of the heap, so under steady traffic at intervals of some
hundreds of requests: a rare, long stall in the per-token path. What the imports and the model load
created lives as long as the process; :func:`freeze_heap` moves it into the permanent generation
(``gc.freeze``), so later collections walk only what requests create. Reference counting still frees
everything as before; only cycles among the frozen objects are never collected.

Process entry points call these (the decode node's, the router's, the coordinator's; vLLM's engine core
freezes its own heap the same way); library objects do not, so tests that build many nodes in one process
pay nothing.

Metrics (on the service's registry, under its prefix): ``<prefix>_gc_pause_seconds{generation}`` (each
collection's duration) and ``<prefix>_gc_frozen_objects`` (``xl_decode``, ``expresslane_router``, ``xl_coord``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

# 50 us .. 1 s: young collections take tens of microseconds, a full one of a large heap hundreds of ms
PAUSE_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


def freeze_heap() -> dict[str, Any]:
    """Collect once, then freeze what is left (everything the service loaded). Returns what it did, to log."""
    t0 = time.perf_counter()
    collected = gc.collect()
    gc.freeze()
    return {"frozen_objects": gc.get_freeze_count(), "collected": collected,
            "took_ms": round((time.perf_counter() - t0) * 1000, 1)}


class GcPauses:
    """Every collection's pause into a histogram by generation (``gc.callbacks``); :meth:`close` removes it."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.pauses = Histogram(f"{prefix}_gc_pause_seconds", "Garbage collector pauses (the GIL held), by generation",
                                ["generation"], registry=registry, buckets=PAUSE_BUCKETS_S)
        self.frozen = Gauge(f"{prefix}_gc_frozen_objects", "Objects in the frozen heap (gc.freeze)", registry=registry)
        self.frozen.set_function(gc.get_freeze_count)
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # collections never nest and run under the GIL: one start time is enough
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self.pauses.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = 0.0

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
