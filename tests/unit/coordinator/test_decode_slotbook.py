"""Table-driven tests of the decode node's lease bookkeeping (services.decode.receiver.SlotBook):
both halves of the same lease generation in either order, stale generations, supersession, ends."""

from __future__ import annotations

import pytest

from services.decode.receiver import SlotBook
from shared.events import DecodeStart, KvReady, SamplingParams


def start(gen, lease=None, slot=0, rid=None):
    return DecodeStart(request_id=rid or f"r{gen}", lease_id=lease or f"L{gen}", generation=gen,
                       slot=slot, first_token_id=1, num_prompt_tokens=4,
                       sampling=SamplingParams(max_tokens=3))


def kv(gen, lease=None, slot=0, rid=None):
    return KvReady(request_id=rid or f"r{gen}", lease_id=lease or f"L{gen}", generation=gen,
                   node_id="n", slot=slot, num_tokens=4, layout_version=1, nbytes=1)


# steps: (op, arg, expected ready lease id or None, expected stale count, expected free slots)
CASES = {
    "start_then_kv": [("add", start(1), None, 0, [1]), ("add", kv(1), "L1", 0, [1])],
    "kv_then_start": [("add", kv(1), None, 0, [1]), ("add", start(1), "L1", 0, [1])],
    "other_slot_independent": [("add", kv(1, slot=1), None, 0, [0]), ("add", start(2), None, 0, []),
                               ("add", start(1, slot=1), "L1", 0, [])],
    "older_generation_is_stale": [("add", start(5), None, 0, [1]), ("add", kv(4), None, 1, [1]),
                                  ("add", kv(5), "L5", 1, [1])],
    "newer_generation_supersedes": [("add", start(1), None, 0, [1]), ("add", kv(2), None, 0, [1]),
                                    ("add", start(2), "L2", 0, [1]), ("add", kv(1), None, 1, [1])],
    "end_raises_floor": [("add", kv(3), None, 0, [1]), ("end", (0, "L3", 3), None, 0, [0, 1]),
                         ("add", start(3), None, 1, [0, 1]), ("add", kv(4), None, 1, [1])],
    "duplicate_after_active_is_stale": [("add", kv(1), None, 0, [1]), ("add", start(1), "L1", 0, [1]),
                                        ("activate", 0, None, 0, [1]), ("add", kv(1), None, 1, [1]),
                                        ("end", (0, "L1", 1), None, 1, [0, 1])],
    "next_lease_waits_for_active_to_end": [
        ("add", kv(1), None, 0, [1]), ("add", start(1), "L1", 0, [1]), ("activate", 0, None, 0, [1]),
        ("add", kv(2), None, 0, [1]), ("add", start(2), None, 0, [1]),
        ("end", (0, "L1", 1), "L2", 0, [1]),
    ],
    "bad_slot_is_stale": [("add", kv(1, slot=9), None, 1, [0, 1])],
}


@pytest.mark.parametrize("name", list(CASES))
def test_slotbook(name):
    book = SlotBook(num_slots=2)
    for op, arg, want_ready, want_stale, want_free in CASES[name]:
        if op == "add":
            ready, _ = book.add(arg.slot, arg)
        elif op == "activate":
            book.activate(arg)
            ready = None
        else:
            book.end(*arg)
            ready = book.ready_after_release(arg[0])
        assert (ready.lease_id if ready else None) == want_ready
        assert book.num_stale == want_stale
        assert book.free_slots() == want_free
    for i, s in enumerate(book.slots):  # leak check: end whatever is left, every slot is free
        for p in (s.active, s.pending):
            if p is not None:
                book.end(i, p.lease_id, p.generation)
    assert book.free_slots() == [0, 1]
