"""Warm leases (services.router.warm): which grant a request may take, when to claim another."""

from __future__ import annotations

import pytest

from services.router.warm import WarmLeases
from shared.events import ClaimGranted, KvLayoutSpec, SlotTarget, TransferTarget

LAYOUT = KvLayoutSpec(layout_version=1, kind="gqa", dtype="float32", num_layers=2, max_tokens=256,
                      slot_nbytes=1, segments=[])


def grant(rid: str, expires_at_ms: int) -> ClaimGranted:
    target = TransferTarget(node_id="n0", transport="mooncake", endpoint="e",
                            slot=SlotTarget(slot=0, base_addr=0, nbytes=1), layout=LAYOUT)
    return ClaimGranted(request_id=rid, lease_id="L" + rid, generation=1, node_id="n0",
                        expires_at_ms=expires_at_ms, target=target)


# (received at, asked at, tokens asked for, taken?)  lifetime 30 s: fresh while 15 s or more are left
TAKE_CASES = [
    (1000, 1000, 100, True),
    (1000, 16_000, 100, True),     # exactly half the lifetime left
    (1000, 16_001, 100, False),    # less than half left: the transfer might not make it
    (1000, 1000, 256, True),       # the slot holds prompt + output exactly
    (1000, 1000, 257, False),      # too long for the slot
]


@pytest.mark.parametrize("received,now,tokens,taken", TAKE_CASES)
def test_take(received, now, tokens, taken):
    w = WarmLeases(size=1)
    w.add("m", grant("g1", received + 30_000), received)
    got = w.take("m", tokens, now)
    assert (got is not None) is taken
    assert w.held_ids() == ([] if taken else ["g1"])
    assert w.take("other-model", 1, now) is None


def test_take_skips_a_grant_whose_node_changed_and_leaves_it_for_stale():
    w = WarmLeases(size=2)
    w.add("m", grant("old", 31_000), 1000)  # granted before its node restarted
    w.add("m", grant("new", 31_000), 1000)
    current = lambda g: g.request_id != "old"  # noqa: E731
    assert w.take("m", 1, 1000, current).request_id == "new"
    assert w.take("m", 1, 1000, current) is None
    assert [g.request_id for g in w.stale(current)] == ["old"]
    assert w.held_ids() == []


# (size, held, in flight, free slots by heartbeat) -> claims to send
WANTED_CASES = [
    (1, 0, 0, 2, 1),   # one free slot stays unheld
    (1, 0, 0, 1, 0),   # the last free slot is never held
    (1, 0, 0, 0, 0),
    (1, 1, 0, 5, 0),   # already held
    (1, 0, 1, 5, 0),   # already being claimed
    (2, 0, 0, 5, 2),
    (2, 0, 0, 2, 1),
    (2, 1, 0, 2, 0),   # the held one counts as free in the node table
    (0, 0, 0, 9, 0),   # off
]


@pytest.mark.parametrize("size,held,pending,free,want", WANTED_CASES)
def test_wanted(size, held, pending, free, want):
    w = WarmLeases(size=size)
    for i in range(held):
        w.add("m", grant(f"g{i}", 60_000), 0)
    w.claiming("m", pending)
    assert w.wanted("m", free) == want


def test_aged_grants_are_removed_and_returned_and_drain_takes_the_rest():
    w = WarmLeases(size=2)
    w.add("m", grant("old", 30_000), 0)
    w.add("m", grant("new", 50_000), 20_000)
    assert [g.request_id for g in w.aged(16_000)] == ["old"]
    assert w.held_ids() == ["new"]
    assert w.aged(16_000) == []
    assert [g.request_id for g in w.drain()] == ["new"] and w.held_ids() == []


def test_claimed_never_goes_below_zero():
    w = WarmLeases(size=1)
    w.claimed("m")
    w.claiming("m")
    w.claimed("m")
    assert w.wanted("m", 2) == 1


def test_stale_grants_are_removed_and_returned():
    w = WarmLeases(size=2)
    w.add("m", grant("kept", 60_000), 0)
    w.add("m", grant("gone", 60_000), 0)
    assert [g.request_id for g in w.stale(lambda g: g.request_id == "kept")] == ["gone"]
    assert w.held_ids() == ["kept"]
