"""shared.gcheap: the frozen heap and the collector's pause histogram."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry

from shared.gcheap import GcPauses, freeze_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process's heap back to normal


def _count(registry: CollectorRegistry, generation: str) -> float:
    return registry.get_sample_value("xl_test_gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_every_collection_is_timed_by_generation_until_closed():
    registry = CollectorRegistry()
    pauses = GcPauses(registry, "xl_test")
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        assert _count(registry, "0") >= 1 and _count(registry, "2") >= 2
        total = registry.get_sample_value("xl_test_gc_pause_seconds_sum", {"generation": "2"})
        assert total > 0
    finally:
        pauses.close()
    assert pauses._on_gc not in gc.callbacks
    before = _count(registry, "2")
    gc.collect(2)
    assert _count(registry, "2") == before  # closed: nothing more recorded


def test_freeze_moves_the_loaded_heap_out_of_later_collections(unfrozen):
    registry = CollectorRegistry()
    pauses = GcPauses(registry, "xl_test")
    try:
        kept = [[i] for i in range(10_000)]  # what a service loaded: lives as long as the process
        info = freeze_heap()
        assert info["frozen_objects"] >= len(kept) and info["took_ms"] >= 0
        assert registry.get_sample_value("xl_test_gc_frozen_objects") == gc.get_freeze_count()
        assert not any(o is kept for o in gc.get_objects(generation=2))  # a full walk no longer sees it
        cycle: list = []
        cycle.append(cycle)  # garbage made after the freeze is still collected
        del cycle
        assert gc.collect() >= 1
    finally:
        pauses.close()
