"""The decode node's I/O shell around its slot core (server.py): an engine call that raises while the node works
through a batch of starts and stops ends that lease's phase in the core, so no slot is left 'starting' or
'stopping' for good. The engine is a small neighbour that raises where told; the core is the real one."""

from __future__ import annotations

import types

import pytest

from services.decode.config import DecodeConfig
from services.decode.effects import Heartbeat, Publish
from services.decode.engine.options import EngineConfig
from services.decode.server import DecodeNode
from shared.events import CancelRequest, RequestFailed, RequestFinished, SpecStats, SlotReleased
from tests.unit.decode.test_slots import NODE, kv, start


class Engine:
    layout = types.SimpleNamespace(layout_version=1)
    device = types.SimpleNamespace(type="cpu")
    model_name, num_spec = "m", 0

    def __init__(self, broken: str) -> None:
        self.broken, self.slots = broken, {}

    def inject(self, slot, num_tokens):
        self.slots[slot] = num_tokens

    def start(self, slot, first_token_id, sampling):
        pass

    def slot_fast_path_reason(self, slot):  # asked after a start succeeded, outside its try
        if self.broken == "after_start":
            raise RuntimeError("status lookup failed")
        return "cpu"

    def cancel(self, slot):
        if self.broken == "cancel":
            raise RuntimeError("cancel failed")
        self.slots.pop(slot, None)

    def spec_stats(self, slot):
        return SpecStats()


def node_for(engine: Engine) -> tuple[DecodeNode, list]:
    config = DecodeConfig(model="m", node_id=NODE, engine=EngineConfig(num_slots=2))
    node = DecodeNode(engine, receiver=None, bus=None, config=config)
    applied: list = []

    async def apply(effects):
        applied.extend(effects)
        return True
    node._apply = apply
    return node, applied


def outcome(applied) -> list:
    return [(type(e.event).__name__, e.event.outcome if isinstance(e.event, SlotReleased) else
             getattr(e.event, "retryable", None)) for e in applied
            if isinstance(e, Publish) and isinstance(e.event, (RequestFailed, RequestFinished, SlotReleased))]


async def run_work(node: DecodeNode, applied: list) -> None:
    for work in node.core.take_engine_work():
        await node._apply(await node._engine_work(work))


@pytest.mark.parametrize("broken,steps,want", [
    # the start worked but what follows raised: the lease fails (retryable), its slot is released
    ("after_start", ["start"], [("RequestFailed", True), ("SlotReleased", "failed")]),
    # the engine's cancel raised: the lease ends cancelled all the same, its slot is released
    ("cancel", ["start", "cancel"], [("RequestFinished", None), ("SlotReleased", "cancelled")]),
])
async def test_engine_work_that_raises_ends_the_lease_and_frees_its_slot(broken, steps, want):
    node, applied = node_for(Engine(broken if broken != "cancel" else ""))
    node.core.on_kv_ready(kv(1))
    node.core.on_start(start(1, max_tokens=50))
    await run_work(node, applied)
    if "cancel" in steps:
        node.engine.broken = "cancel"
        applied.clear()
        await node._apply(node.core.on_cancel(CancelRequest(request_id="r1", reason="client_disconnected")))
        await run_work(node, applied)
    assert outcome(applied) == want
    assert node.core.free_slots() == [0, 1] and not node.core.has_engine_work
    assert any(isinstance(e, Heartbeat) for e in applied)  # the free slot is announced
