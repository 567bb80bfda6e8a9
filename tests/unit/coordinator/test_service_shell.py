"""The coordinator's I/O shell (service.py) around its core: what it writes, sends and acknowledges
when leadership or the state store fails under it.

The core is the real one; the bus and the state store are small in-memory neighbours (what was
published, what the store holds), so each case can take the lease away or fail a write at an exact
point. The end-to-end behaviour over a real NATS cluster is tests/integration/test_nats_cluster.py.
"""

from __future__ import annotations

import msgspec
import pytest
from opentelemetry import context as otel_context

from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.core import CoordinatorCore
from services.coordinator.model import DeleteLease, Lease, PutLease, PutMeta
from services.coordinator.service import CoordinatorService, mono_ms
from shared import subjects
from shared.bus import BusError
from shared.events import ClaimGranted, ClaimRequest, DecodeStarted, HandoffEvent, KvReady, SlotReleased
from tests.unit.coordinator.test_core import CFG, hb


class Bus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def publish(self, subject, event, replay=False) -> None:
        self.sent.append((subject, event))

    def states(self, request_id: str) -> list[str]:
        return [e.state for s, e in self.sent if isinstance(e, HandoffEvent) and e.request_id == request_id
                and s == subjects.handoff(request_id, e.state)]


class Store:
    """Leases by id, as the bucket holds them; ``fail``: the next write raises (retries ran out)."""

    def __init__(self) -> None:
        self.leases: dict[str, bytes] = {}
        self.next_generation = 1
        self.fail = False

    async def write(self, effects) -> None:
        if self.fail:
            raise TimeoutError("nats: timeout")
        for e in effects:
            if isinstance(e, PutLease):
                self.leases[e.lease.lease_id] = msgspec.json.encode(e.lease)
            elif isinstance(e, DeleteLease):
                self.leases.pop(e.lease_id, None)
            elif isinstance(e, PutMeta):
                self.next_generation = e.next_generation

    def stored(self) -> list[Lease]:
        return [msgspec.json.decode(raw, type=Lease) for raw in self.leases.values()]


def leader(store: Store, bus: Bus, core: CoordinatorCore | None = None) -> CoordinatorService:
    """A service that has just won the leader key; ``core``: one restored from ``store``."""
    svc = CoordinatorService(bus, core or CoordinatorCore(CFG), CoordinatorServiceConfig())
    svc.store = store
    svc.leadership.won(1, mono_ms())
    svc.is_serving = True
    return svc


async def report(svc: CoordinatorService, event) -> list[bool] | None:
    """One report through the inbox's batch path: per report applied (then acknowledged), or None
    (nothing acknowledged: the stream delivers it again, to the next leader)."""
    handler = svc._inbox_handlers[type(event)]
    return await svc._apply_many([(handler, (event,), otel_context.Context(), "coordinator.test",
                                   event.request_id)])


async def decoding(svc: CoordinatorService, bus: Bus, rid: str = "r1") -> ClaimGranted:
    """A request granted slot 0 of node n1, its KV in and its decode started."""
    assert await svc._apply(svc.core.on_heartbeat, hb(free=(0,)))
    claim = ClaimRequest(request_id=rid, model="m", num_prompt_tokens=8, max_tokens=4, wait_ms=0,
                         protocol_version=1, transports=["mooncake"])
    assert await svc._apply(svc.core.on_claim, claim, f"inbox.{rid}")
    grant = next(e for s, e in bus.sent if s == f"inbox.{rid}")
    assert isinstance(grant, ClaimGranted), grant
    ids = dict(request_id=rid, lease_id=grant.lease_id, generation=grant.generation, node_id="n1", slot=0)
    assert await report(svc, KvReady(**ids, num_tokens=8, layout_version=1, nbytes=0)) == [True]
    assert await report(svc, DecodeStarted(**ids)) == [True]
    assert bus.states(rid) == ["claimed", "kv_ready", "decoding"]
    return grant


def released(grant: ClaimGranted) -> SlotReleased:
    return SlotReleased(request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
                        node_id="n1", slot=0, outcome="completed")


@pytest.mark.parametrize("failure", ["lease_ran_out", "state_write_failed"])
async def test_a_release_applied_only_in_memory_leaves_its_report_for_the_next_leader(failure):
    """The node's heartbeat carries its slot release, and the report follows on the stream. When the
    heartbeat's effects cannot be made (the leader lease ran out while a write waited on a cluster
    electing a new stream leader; or the write's retries ran out), the core has still marked the
    release as applied: its report must not be acknowledged as a no-op then, or the lease stays
    'decoding' in the store for ever. The next leader, restored from the store, completes it."""
    bus, store = Bus(), Store()
    svc = leader(store, bus)
    grant = await decoding(svc, bus)
    if failure == "lease_ran_out":
        svc.leadership.valid_until_ms = 0
    else:
        store.fail = True
    beat = msgspec.structs.replace(hb(free=(0,), seq=2), released=[released(grant)])
    assert not await svc._apply(svc.core.on_heartbeat, beat)
    assert svc.leadership.role == "standby"
    reason = "lease_expired" if failure == "lease_ran_out" else failure
    assert dict(svc.leadership.counters) == {"won": 1, f"lost.{reason}": 1}
    store.fail = False
    assert await report(svc, released(grant)) is None  # unacknowledged
    assert bus.states("r1") == ["claimed", "kv_ready", "decoding"]
    [lease] = store.stored()
    assert (lease.request_id, lease.state) == ("r1", "decoding")

    # The next leader (this process again, or a standby) restores the store and gets the report.
    core = CoordinatorCore(CFG)
    core.restore(store.stored(), [], store.next_generation, 0)
    svc = leader(store, bus, core)
    assert await report(svc, released(grant)) == [True]
    assert bus.states("r1") == ["claimed", "kv_ready", "decoding", "completed"]
    assert store.stored() == [] and svc.core.leases == {}  # the slot is free again


async def test_once_stepped_down_no_input_is_taken_and_a_late_lease_alone_refuses_only_writes():
    """The lease only late (its renewal may still prove nobody took over): an input with nothing to write
    passes, one with effects is refused and steps down. From then on even an input with nothing to write
    (a repeated report, a quiet tick) is not taken, so its report is not acknowledged, and nothing is sent."""
    bus, store = Bus(), Store()
    svc = leader(store, bus)
    grant = await decoding(svc, bus)
    sent = len(bus.sent)
    started = DecodeStarted(request_id="r1", lease_id=grant.lease_id, generation=grant.generation,
                            node_id="n1", slot=0)
    svc.leadership.valid_until_ms = 0
    assert await report(svc, started) == [True]  # a repeat: nothing to write, nothing changed
    assert svc.leadership.role == "leader"
    claim = ClaimRequest(request_id="r2", model="m", num_prompt_tokens=8, max_tokens=4, wait_ms=0,
                         protocol_version=1, transports=["mooncake"])
    assert not await svc._apply(svc.core.on_claim, claim, "inbox.r2")  # a write: refused, stepped down
    assert svc.leadership.role == "standby"
    assert await report(svc, started) is None
    assert not await svc._apply(svc.core.tick)
    assert len(bus.sent) == sent


async def test_a_message_that_cannot_be_sent_does_not_stop_the_rest():
    """The state is written, then replies and events go out in order; one the bus refuses (BusError: the
    connection down, its buffer full) is logged and the others still go."""

    class RefusingBus(Bus):
        async def publish(self, subject, event, replay=False) -> None:
            if subject.startswith("inbox."):
                raise BusError("could not publish on inbox.r1: OutboundBufferLimitError()")
            await super().publish(subject, event, replay)

    bus, store = RefusingBus(), Store()
    svc = leader(store, bus)
    assert await svc._apply(svc.core.on_heartbeat, hb(free=(0,)))
    claim = ClaimRequest(request_id="r1", model="m", num_prompt_tokens=8, max_tokens=4, wait_ms=0,
                         protocol_version=1, transports=["mooncake"])
    assert await svc._apply(svc.core.on_claim, claim, "inbox.r1")
    assert bus.states("r1") == ["claimed"]  # the grant's reply was refused; the event after it went out
    assert [lease.state for lease in store.stored()] == ["claimed"]
