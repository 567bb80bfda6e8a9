"""Records, configuration and effects of the transfer coordinator's pure core.

The core (services.coordinator.core) consumes wire messages and the current time and returns a list
of effects; the service shell performs them in order. Nothing here does I/O.

Persisted records (msgspec Structs, stored as JSON in the JetStream KV bucket by the shell):
- ``Lease``: one decode slot leased to one request; it stays in the table after the handoff ends
  until no writer can still be live on the slot and the node has let go of it (fencing).
- ``QueuedClaim``: a claim waiting for a free slot, with the NATS reply subject to answer on.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shared.events import ClaimRequest, Event, HandoffState, NodeAvailable


@dataclass(frozen=True)
class CoordinatorConfig:
    """Timeouts and bounds of the coordinator (all durations in milliseconds)."""

    heartbeat_misses: int = 3  # a node is dead after this many missed heartbeats
    # ticks further apart than this: the coordinator itself was not listening (see core.tick)
    max_tick_gap_ms: int = 500
    default_heartbeat_interval_ms: int = 1000  # for nodes known only from restored leases
    transfer_timeout_ms: int = 30_000  # claimed -> kv_ready must happen within this
    fence_grace_ms: int = 5_000  # after the transfer timeout, a writer may still be live this long
    start_timeout_ms: int = 30_000  # kv_ready -> decoding must happen within this
    release_grace_ms: int = 3_000  # after a handoff ends, how long to wait for the node's release
    max_queue: int = 64  # waiting claims
    max_wait_ms: int = 30_000  # upper bound on a claim's own wait_ms
    retry_after_ms: int = 500  # advice in rejections
    generation_block: int = 1024  # lease generations reserved per persisted write

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            floor = 0 if name in ("max_queue", "max_wait_ms", "fence_grace_ms") else 1
            if value < floor:
                raise ValueError(f"coordinator setting {name} must be >= {floor}, got {value}")


class Lease(msgspec.Struct, kw_only=True):
    """One slot of one node, leased to one request."""

    lease_id: str
    generation: int
    request_id: str
    node_id: str
    slot: int
    transport: str
    state: HandoffState = "claimed"
    claimed_at_ms: int  # when the claim arrived (queue wait included in latency)
    granted_at_ms: int
    transfer_deadline_ms: int  # KV-ready must arrive before this
    fence_until_ms: int  # no writer can be live after this
    kv_ready_at_ms: int = 0
    decoding_at_ms: int = 0
    ended_at_ms: int = 0  # when the handoff reached a terminal state
    is_writer_done: bool = False  # KvReady or KvFailed seen: the sender stopped writing
    # A tensor-parallel prefill's ranks that announced their KvReady so far (the writer is done
    # when every one of KvReady.source_ranks has, or at its first KvFailed)
    kv_ready_ranks: list[int] = []
    is_node_released: bool = False  # SlotReleased seen: the node stopped using the slot
    reason: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.state in ("completed", "failed", "cancelled")


class QueuedClaim(msgspec.Struct, kw_only=True):
    """A claim waiting for a slot (gated dispatch)."""

    claim: ClaimRequest
    reply_to: str
    enqueued_at_ms: int
    deadline_ms: int


@dataclass
class Node:
    """What the coordinator knows of one decode node (rebuilt from heartbeats, not persisted)."""

    node_id: str
    info: NodeAvailable | None  # None: known only from restored leases, no heartbeat yet
    last_seen_ms: int
    interval_ms: int
    is_draining: bool = False


# ---------------------------------------------------------------- effects


@dataclass(frozen=True)
class Reply:
    """Answer a claim on its NATS reply subject."""

    reply_to: str
    event: Event


@dataclass(frozen=True)
class Publish:
    subject: str
    event: Event


@dataclass(frozen=True)
class PutLease:
    lease: Lease


@dataclass(frozen=True)
class DeleteLease:
    lease_id: str


@dataclass(frozen=True)
class PutQueued:
    entry: QueuedClaim


@dataclass(frozen=True)
class DeleteQueued:
    request_id: str


@dataclass(frozen=True)
class PutMeta:
    next_generation: int


@dataclass(frozen=True)
class Observe:
    """A latency sample for a histogram: queue_wait, transfer, handoff (claim -> decoding)."""

    metric: str
    value_s: float


Effect = Reply | Publish | PutLease | DeleteLease | PutQueued | DeleteQueued | PutMeta | Observe
