"""Dispatcher bookkeeping: the decode slots open legs hold (warm leases' free-slot count)."""

from __future__ import annotations

from services.router.dispatch import Dispatcher


def test_a_leg_holds_its_slot_until_it_closes():
    d = Dispatcher()
    d.open("a")
    d.open("b")
    d.hold("a", "n0", 1)
    d.hold("b", "n1", 0)
    d.hold("gone", "n0", 0)  # never opened (or closed already): holds nothing
    assert d.slots_in_use() == {("n0", 1), ("n1", 0)}
    d.close("a")
    assert d.slots_in_use() == {("n1", 0)} and d.num_open == 1
    d.close("b")
    d.close("b")
    assert d.slots_in_use() == set() and d.num_open == 0
