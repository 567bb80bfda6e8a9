"""The decode node's receiving side: transport registration of slot buffers, and the bookkeeping
that pairs each lease's two halves (``DecodeStart`` from the router, ``KvReady`` from the sender).

Contract:
- ``Receiver(transport, buffers)`` registers every slot buffer once, at start, and advertises
  ``endpoint``, ``metadata_b64`` and ``slot_targets()``; ``close()`` unregisters.
- ``SlotBook`` (pure, no I/O) holds, per slot, the halves of the newest lease generation seen.
  A lease is ready when both halves of the same (lease id, generation) are present, in either
  order. Halves of an older generation than the slot's floor are stale: ignored and counted
  (``num_stale``). A newer generation supersedes older pending halves. Ending a lease (released,
  cancelled, failed) raises the slot's floor past its generation, so late halves are stale too.
- A slot is busy (not advertised free) from its first half until the lease ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.events import DecodeStart, KvReady, SlotTarget


@dataclass
class Pending:
    """The halves of one lease generation on one slot."""

    lease_id: str
    generation: int
    request_id: str
    start: DecodeStart | None = None
    kv: KvReady | None = None

    @property
    def is_ready(self) -> bool:
        return self.start is not None and self.kv is not None


@dataclass
class SlotState:
    floor: int = 0  # generations below this are stale
    pending: Pending | None = None
    active: Pending | None = None  # decoding


@dataclass
class SlotBook:
    """Pairs DecodeStart and KvReady per slot and lease generation (see module docstring)."""

    num_slots: int
    slots: list[SlotState] = field(default_factory=list)
    num_stale: int = 0
    ended: deque = field(default_factory=lambda: deque(maxlen=4096))  # lease ids already ended

    def __post_init__(self) -> None:
        self.slots = [SlotState() for _ in range(self.num_slots)]

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.pending is None and s.active is None]

    def find(self, request_id: str) -> tuple[int, Pending] | None:
        """The slot and lease of a request that is pending or active here."""
        for i, s in enumerate(self.slots):
            for p in (s.active, s.pending):
                if p is not None and p.request_id == request_id:
                    return i, p
        return None

    def find_lease(self, lease_id: str) -> tuple[int, Pending] | None:
        for i, s in enumerate(self.slots):
            for p in (s.active, s.pending):
                if p is not None and p.lease_id == lease_id:
                    return i, p
        return None

    def add(self, slot: int, half: DecodeStart | KvReady) -> tuple[Pending | None, list[Pending]]:
        """Record one half; returns (the lease now ready to start or None, leases superseded)."""
        if not 0 <= slot < self.num_slots:
            self.num_stale += 1
            return None, []
        s = self.slots[slot]
        if half.generation < s.floor or half.lease_id in self.ended:
            self.num_stale += 1
            return None, []
        if s.active is not None and s.active.lease_id == half.lease_id:
            self.num_stale += 1  # a duplicate of what already started
            return None, []
        superseded: list[Pending] = []
        p = s.pending
        if p is not None and (p.lease_id, p.generation) != (half.lease_id, half.generation):
            if half.generation < p.generation:
                self.num_stale += 1
                return None, []
            superseded.append(p)
            self.ended.append(p.lease_id)
            p = None
        if p is None:
            p = s.pending = Pending(half.lease_id, half.generation, half.request_id)
        if isinstance(half, DecodeStart):
            p.start = half
        else:
            p.kv = half
        if p.is_ready and s.active is None:
            return p, superseded
        return None, superseded

    def activate(self, slot: int) -> Pending:
        """Move the slot's ready lease to active (decoding)."""
        s = self.slots[slot]
        assert s.pending is not None and s.pending.is_ready
        s.active, s.pending = s.pending, None
        return s.active

    def end(self, slot: int, lease_id: str, generation: int) -> Pending | None:
        """The lease ended (any reason): forget it, raise the floor; returns what was held."""
        s = self.slots[slot]
        s.floor = max(s.floor, generation + 1)
        self.ended.append(lease_id)
        held = None
        if s.active is not None and s.active.lease_id == lease_id:
            held, s.active = s.active, None
        if s.pending is not None and s.pending.lease_id == lease_id:
            held, s.pending = s.pending, None
        return held

    def ready_after_release(self, slot: int) -> Pending | None:
        """A pending lease that became startable because the slot's active lease ended."""
        s = self.slots[slot]
        if s.active is None and s.pending is not None and s.pending.is_ready:
            return s.pending
        return None


class Receiver:
    """Registers each slot's receive buffer with the transport once and advertises it."""

    def __init__(self, transport, buffers: list[tuple[int, int]]) -> None:
        self.transport = transport
        self.buffers = buffers  # (addr, nbytes) per slot
        for addr, nbytes in buffers:
            transport.register(addr, nbytes)

    @property
    def name(self) -> str:
        return self.transport.name

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    @property
    def metadata_b64(self) -> str:
        return self.transport.metadata_b64

    def slot_targets(self) -> list[SlotTarget]:
        return [SlotTarget(slot=i, base_addr=a, nbytes=n) for i, (a, n) in enumerate(self.buffers)]

    def close(self) -> None:
        for addr, _ in self.buffers:
            try:
                self.transport.unregister(addr)
            except Exception:
                pass
        self.transport.close()
