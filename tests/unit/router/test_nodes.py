"""Node table: liveness from heartbeats, draining, capacity per model."""

from __future__ import annotations

import pytest

from shared.events import KvLayoutSpec, NodeAvailable, NodeDraining
from services.router.nodes import NodeTable
from shared.models import serves


def hb(node="n0", model="/m/tiny-llama", seq=1, max_tokens=512, interval_ms=500, sent=0):
    layout = KvLayoutSpec(layout_version=1, kind="gqa", dtype="float32", num_layers=2,
                          max_tokens=max_tokens, slot_nbytes=1, segments=[])
    return NodeAvailable(node_id=node, model=model, protocol_version=1, total_slots=2,
                         free_slots=[0, 1], transports=["mooncake"], endpoints={}, slots=[],
                         layout=layout, heartbeat_interval_ms=interval_ms, seq=seq, sent_at_ms=sent)


ALIASES = {"tiny-llama", "/m/tiny-llama"}

CASES = [
    # (events as (event, at_s), now_s, expected capacity)
    ([], 0.0, None),
    ([(hb(), 0.0)], 1.0, 512),
    ([(hb(), 0.0)], 1.6, None),  # 3 intervals of 0.5 s passed
    ([(hb(), 0.0), (hb(seq=2), 1.0)], 2.0, 512),
    ([(hb(), 0.0), (NodeDraining(node_id="n0", sent_at_ms=1), 0.1)], 0.2, None),
    ([(hb(), 0.0), (NodeDraining(node_id="n0", sent_at_ms=1), 0.1), (hb(seq=2), 0.2)], 0.3, 512),
    ([(hb(model="other"), 0.0)], 0.1, None),
    ([(hb(), 0.0), (hb(node="n1", max_tokens=1024), 0.0)], 0.1, 1024),
    ([(hb(seq=5), 0.0), (hb(seq=4, sent=-1), 1.0)], 1.6, None),  # stale heartbeat does not refresh
]


@pytest.mark.parametrize("events,now,capacity", CASES)
def test_capacity(events, now, capacity):
    table = NodeTable()
    for event, at in events:
        table.observe(event, at)
    assert table.slot_capacity(ALIASES, now) == capacity


@pytest.mark.parametrize("events,now,smallest", [
    ([], 0.0, None),
    ([(hb(), 0.0), (hb(node="n1", max_tokens=1024), 0.0)], 0.1, 512),
    ([(hb(), 0.0), (hb(node="n1", max_tokens=1024), 0.0), (NodeDraining(node_id="n0", sent_at_ms=1), 0.1)],
     0.2, 1024),  # a draining node takes no claim: it does not bound them
    ([(hb(), 0.0), (hb(node="n1", max_tokens=1024, model="other"), 0.0)], 0.1, 512),
])
def test_smallest_slot_of_the_live_nodes(events, now, smallest):
    table = NodeTable()
    for event, at in events:
        table.observe(event, at)
    assert table.smallest_slot_capacity(ALIASES, now) == smallest


@pytest.mark.parametrize("node_model,ok", [
    ("tiny-llama", True), ("/m/tiny-llama", True), ("/other/dir/tiny-llama/", True), ("llama", False),
])
def test_serves(node_model, ok):
    assert serves(node_model, ALIASES) is ok


def test_forget_stale():
    table = NodeTable()
    table.observe(hb(), 0.0)
    table.forget_stale(now_s=1000.0)
    assert table.live(1000.0) == []


def _target(endpoint="127.0.0.1:1", base_addr=4096, node="n0"):
    from shared.events import SlotTarget, TransferTarget
    return TransferTarget(node_id=node, transport="mooncake", endpoint=endpoint,
                          slot=SlotTarget(slot=1, base_addr=base_addr, nbytes=8), layout=hb().layout)


def _beat(endpoint="127.0.0.1:1", base_addr=4096, seq=1):
    import msgspec

    from shared.events import SlotTarget
    return msgspec.structs.replace(hb(seq=seq), endpoints={"mooncake": endpoint}, slots=[
        SlotTarget(slot=0, base_addr=0, nbytes=8), SlotTarget(slot=1, base_addr=base_addr, nbytes=8)])


# (heartbeat or None, now_s, target) -> still served there
SERVES_CASES = [
    (_beat(), 0.1, _target(), True),
    (None, 0.1, _target(), False),                                   # never heard of
    (_beat(), 10.0, _target(), False),                               # no longer live
    (_beat(endpoint="127.0.0.1:2", seq=2), 0.1, _target(), False),   # restarted: new endpoint
    (_beat(base_addr=8192, seq=2), 0.1, _target(), False),           # restarted: new buffer
    (_beat(), 0.1, _target(node="n1"), False),
]


@pytest.mark.parametrize("beat,now_s,target,served", SERVES_CASES)
def test_serves_target(beat, now_s, target, served):
    t = NodeTable()
    if beat is not None:
        t.observe(beat, 0.0)
    assert t.serves_target(target, now_s) is served


def test_describe_shows_each_node_live_or_not_with_its_last_endpoints():
    t = NodeTable()
    t.observe(_beat(), 0.0)
    t.observe(hb(node="n1", interval_ms=100), 0.0)
    assert t.describe(0.1) == {"n0": {"live": True, "model": "/m/tiny-llama", "endpoints": {"mooncake": "127.0.0.1:1"}},
                               "n1": {"live": True, "model": "/m/tiny-llama", "endpoints": {}}}
    t.observe(_beat(endpoint="127.0.0.1:2", seq=1), 1.0)  # n0's process restarted: another endpoint, seq anew
    assert t.describe(1.1) == {"n0": {"live": True, "model": "/m/tiny-llama", "endpoints": {"mooncake": "127.0.0.1:2"}},
                               "n1": {"live": False, "model": "/m/tiny-llama", "endpoints": {}}}
