"""The transfer coordinator's state machine: pure, no NATS, no clock (``now_ms`` is passed in).

Contract:
- Nodes register through ``NodeAvailable`` heartbeats; a node missing ``heartbeat_misses``
  beats is dead, and so is a node whose heartbeat ``seq`` goes backwards (it restarted): every
  live lease on it fails; leases whose writer may still be live keep fencing their slot.
- Missed beats count only while the coordinator listens. ``on_heard`` records that a node's
  message arrived as soon as it does (its handling may wait behind a state write). Two ticks
  further apart than ``max_tick_gap_ms`` mean the coordinator itself was not listening in between
  (blocked on NATS, or cut off from it): a node not heard from since the earlier tick may have
  beaten unheard, so its deadline moves back by the time beyond ``max_tick_gap_ms``. A node heard
  during the gap keeps its own deadline (it was listened to). The first tick after ``restore``
  only sets the mark.
- A claim is granted a lease (lease id, generation, slot, expiry) on a free slot of a compatible
  node: same model, protocol version, layout version, a transport both sides speak, and room for
  prompt + max_tokens. A slot is free when the node's last heartbeat lists it free and no lease
  (live or fencing) holds it. Generations grow monotonically across restarts: they are persisted
  in blocks of ``generation_block`` (``PutMeta``), so a restart may skip numbers, never reuse one.
- No free slot: the claim waits in a bounded FIFO queue until its deadline; the next free slot goes
  to the oldest waiting claim it fits (gated dispatch). Queue full, deadline passed, or no node
  that could ever serve it: ``ClaimRejected`` with ``retry_after_ms``.
- Rejection reasons (``ClaimRejected.reason``): capacity, worth a retry after ``retry_after_ms``:
  ``no_free_slot`` (wait_ms 0), ``queue_full``, ``deadline``, ``coordinator_stopping``; no express
  node can serve this claim at all (use the standard lane): ``no_compatible_node``,
  ``kv_cache_dtype`` (nodes serve the model, but none keeps KV in the dtype of the prefill's vLLM:
  run both with one ``--kv-cache-dtype``), ``protocol_version``; others: ``already_claimed`` (a live lease has this request id),
  ``cancelled`` (cancelled while waiting), ``invalid_request_id`` (not letters, digits, - and _).
- Handoff states: claimed -> kv_ready -> decoding -> completed | failed | cancelled, each published
  as a ``HandoffEvent`` on ``xl.handoff.<request_id>.<state>``; queued and rejected likewise. A
  lease's terminal event also goes to its node, on ``xl.decode.<node>.ended``.
- Early release: a heartbeat may carry the ``SlotReleased`` that made the node beat; for a lease
  of that node in state ``decoding`` it is applied at once (the slot goes to a waiting claim
  without the report stream's round trips), and the same report, when it comes, changes nothing.
  Any other lease waits for the report, which stays the record (docs/design/slot-release.md).
- Fencing: a lease whose KV-ready has not arrived fails at the transfer deadline but keeps its slot
  until the transfer deadline + grace (a writer may still be live) unless KvReady/KvFailed shows the
  writer stopped. An ended lease also keeps its slot until the node reports ``SlotReleased`` (or
  ``release_grace_ms`` passed and the node's heartbeat lists the slot free).
- Start and outages: for two default heartbeat intervals after ``restore`` (start), a claim with
  no compatible node waits instead of being rejected (nodes have not announced themselves yet);
  if none has appeared when the warm-up ends (or the claim's deadline comes first), it is rejected
  ``no_compatible_node``, as is a waiting claim whose last compatible node died or drained;
  ``on_reconnected`` counts every node as seen (beats missed while we were cut off prove nothing).
- Standby (services.coordinator.leadership): ``observe_node`` keeps the node registry warm while
  another coordinator leads; ``drop_state`` forgets everything but the nodes when leadership ends,
  and ``restore`` adopts the bucket's state when it begins.
- Messages naming an unknown lease, an old generation, or a lease already ended are ignored for
  state and counted in ``counters["stale_ignored"]`` (fencing bookkeeping still learns from them).
"""

from __future__ import annotations

import uuid
from collections import Counter

from msgspec.structs import replace

from shared import subjects
from shared.events import (
    PROTOCOL_VERSION,
    CancelRequest,
    ClaimGranted,
    ClaimRejected,
    ClaimRequest,
    DecodeStarted,
    HandoffEvent,
    KvFailed,
    KvReady,
    NodeAvailable,
    NodeDraining,
    SlotReleased,
    RankTarget,
    TransferTarget,
)
from services.coordinator.model import (
    CoordinatorConfig,
    DeleteLease,
    DeleteQueued,
    Effect,
    Lease,
    Node,
    Observe,
    Publish,
    PutLease,
    PutMeta,
    PutQueued,
    QueuedClaim,
    Reply,
)
from services.coordinator.registry import NodeRegistry


RELEASED_EARLY_REMEMBERED = 1024  # early releases whose report has not come yet


class CoordinatorCore:
    """Leases, queue and node registry; every input method returns the effects to perform."""

    def __init__(self, config: CoordinatorConfig | None = None, new_id=None) -> None:
        self.config = config or CoordinatorConfig()
        self.config.validate()
        self._new_id = new_id or (lambda: uuid.uuid4().hex[:16])
        self.registry = NodeRegistry(self.config)
        self.leases: dict[str, Lease] = {}  # lease_id -> lease (live or fencing)
        self.queue: list[QueuedClaim] = []  # oldest first
        self.next_generation = 1
        self.reserved_generation = 1  # generations below this are persisted as used (PutMeta)
        self.warmup_until_ms = 0  # see restore()
        self.last_tick_ms: int | None = None  # None: no tick since restore (see tick())
        self.last_stall_ms = 0  # what the last tick allowed for the coordinator not listening
        self.counters: Counter[str] = Counter()
        self.released_early: dict[str, None] = {}  # lease ids freed on a heartbeat, report pending

    # ------------------------------------------------------------ restore / inspection

    def restore(self, leases: list[Lease], queued: list[QueuedClaim], next_generation: int,
                now_ms: int) -> None:
        """Adopt persisted state (at start); nodes named by leases count as seen ``now_ms``."""
        # Until every live node has had time to beat, "no node" proves nothing: claims wait.
        self.warmup_until_ms = now_ms + 2 * self.config.default_heartbeat_interval_ms
        self.last_tick_ms = None  # a standby listened to heartbeats: its idle time is no stall
        self.leases = {lease.lease_id: lease for lease in leases}
        self.queue = sorted(queued, key=lambda q: q.enqueued_at_ms)
        top = max((lease.generation for lease in leases), default=0)
        self.next_generation = max(next_generation, top + 1, 1)
        self.reserved_generation = self.next_generation
        for lease in leases:
            self.registry.remember(lease.node_id, now_ms)

    def drop_state(self) -> None:
        """Leadership lost: forget leases, waiting claims and generations (the bucket and the next
        leader own them); keep what heartbeats taught about nodes."""
        self.leases, self.queue, self.released_early = {}, [], {}
        self.next_generation = self.reserved_generation = 1
        self.warmup_until_ms = 0

    def observe_node(self, msg: NodeAvailable | NodeDraining, now_ms: int) -> None:
        """A standby learns the nodes from their heartbeats (so it can grant as soon as it leads),
        and acts on nothing: it holds no lease to fail."""
        if isinstance(msg, NodeAvailable):
            self.registry.heartbeat(msg, now_ms)
        else:
            self.registry.draining(msg, now_ms)

    @property
    def nodes(self) -> dict[str, Node]:
        return self.registry.nodes

    def live_lease(self, request_id: str) -> Lease | None:
        """The request's lease that has not ended, if any."""
        for lease in self.leases.values():
            if lease.request_id == request_id and not lease.is_terminal:
                return lease
        return None

    def free_slots(self, node_id: str) -> list[int]:
        """Slots of the node that could be leased now (heartbeat says free, no lease holds them)."""
        held = {l.slot for l in self.leases.values() if l.node_id == node_id}
        return self.registry.free_slots(node_id, held)

    def num_free_slots(self) -> int:
        return sum(len(self.free_slots(n)) for n in self.nodes)

    # ------------------------------------------------------------ nodes

    def on_heartbeat(self, hb: NodeAvailable, now_ms: int) -> list[Effect]:
        effects: list[Effect] = []
        if hb.node_id not in self.nodes:
            self.counters["nodes_joined"] += 1
        if self.registry.heartbeat(hb, now_ms):
            effects += self._fail_node_leases(hb.node_id, "node_restarted", now_ms)
        for msg in hb.released:
            effects += self._release_early(msg, hb.node_id, now_ms)
        return effects + self._sweep_and_dispatch(now_ms)

    def _release_early(self, msg: SlotReleased, node_id: str, now_ms: int) -> list[Effect]:
        """A release the node's heartbeat carries: applied now for a decoding lease of that node
        (its writer is done, its earlier reports are in); anything else waits for the report."""
        lease = self.leases.get(msg.lease_id)
        if (lease is None or msg.node_id != node_id or lease.state != "decoding"
                or (lease.generation, lease.node_id, lease.slot) != (msg.generation, msg.node_id, msg.slot)):
            return []
        self.released_early[msg.lease_id] = None
        while len(self.released_early) > RELEASED_EARLY_REMEMBERED:
            del self.released_early[next(iter(self.released_early))]
        self.counters["slots_released_early"] += 1
        lease.is_node_released = True
        return self._end(lease, msg.outcome, msg.reason, now_ms) + [PutLease(lease)]

    def on_heard(self, node_id: str, now_ms: int) -> None:
        """A message of the node arrived now: proof of life, even while its handling (a heartbeat
        through ``on_heartbeat``) waits behind a state write."""
        self.registry.touch(node_id, now_ms)

    def on_reconnected(self, now_ms: int) -> list[Effect]:
        """The coordinator was cut off from the bus: heartbeats it missed prove nothing, so every
        node counts as seen now."""
        self.registry.touch_all(now_ms)
        return []

    def on_draining(self, msg: NodeDraining, now_ms: int) -> list[Effect]:
        self.registry.draining(msg, now_ms)
        return []

    def _fail_node_leases(self, node_id: str, reason: str, now_ms: int) -> list[Effect]:
        """The node is gone: fail its live leases. A lease whose writer may still be live keeps
        fencing its slot (the node may come back, e.g. after a long pause) until the deadline."""
        effects: list[Effect] = []
        for lease in [l for l in self.leases.values() if l.node_id == node_id]:
            if not lease.is_terminal:
                effects += self._end(lease, "failed", reason, now_ms)
            if lease.is_writer_done or now_ms >= lease.fence_until_ms:
                del self.leases[lease.lease_id]
                effects.append(DeleteLease(lease.lease_id))
            else:
                lease.is_node_released = True
                effects.append(PutLease(lease))
        self.counters[f"nodes_lost.{reason}"] += 1
        return effects

    # ------------------------------------------------------------ claims

    def on_claim(self, claim: ClaimRequest, reply_to: str, now_ms: int) -> list[Effect]:
        self.counters["claims"] += 1
        if not _is_token(claim.request_id):  # it names subjects and state keys
            self.counters["claims_rejected.invalid_request_id"] += 1
            return [Reply(reply_to, ClaimRejected(request_id=claim.request_id,
                                                  reason="invalid_request_id"))]
        if claim.protocol_version != PROTOCOL_VERSION:
            return self._reject(claim, reply_to, "protocol_version", now_ms, retry=False)
        existing = self.live_lease(claim.request_id)
        if existing is not None:  # a retried claim: answer with the same lease
            if existing.state == "claimed" and self.nodes[existing.node_id].info is not None:
                return [Reply(reply_to, self._granted(existing))]
            return self._reject(claim, reply_to, "already_claimed", now_ms, retry=False)
        for i, entry in enumerate(self.queue):
            if entry.claim.request_id == claim.request_id:  # a retried queued claim
                self.queue[i] = QueuedClaim(claim=claim, reply_to=reply_to,
                                            enqueued_at_ms=entry.enqueued_at_ms,
                                            deadline_ms=entry.deadline_ms)
                return [PutQueued(self.queue[i])]
        if not self._is_warming_up(now_ms) and not self._has_compatible_node(claim):
            return self._reject(claim, reply_to, self._no_node_reason(claim), now_ms)
        pick = self._pick_slot(claim)
        if pick is not None:
            return self._grant(claim, reply_to, pick, now_ms, now_ms)
        wait_ms = min(max(claim.wait_ms, 0), self.config.max_wait_ms)
        if wait_ms == 0 or len(self.queue) >= self.config.max_queue:
            reason = "no_free_slot" if wait_ms == 0 else "queue_full"
            return self._reject(claim, reply_to, reason, now_ms)
        entry = QueuedClaim(claim=claim, reply_to=reply_to, enqueued_at_ms=now_ms,
                            deadline_ms=now_ms + wait_ms)
        self.queue.append(entry)
        self.counters["claims_queued"] += 1
        return [PutQueued(entry), self._event(claim.request_id, "queued", now_ms)]

    def _is_warming_up(self, now_ms: int) -> bool:
        """Just started: nodes that are alive may not have beaten yet, so "no node" proves nothing."""
        return now_ms < self.warmup_until_ms

    def _has_compatible_node(self, claim: ClaimRequest) -> bool:
        return any(self.registry.transport_for(n, claim) for n in self.nodes.values())

    def _no_node_reason(self, claim: ClaimRequest) -> str:
        """``kv_cache_dtype`` where nodes would serve the claim but keep KV in another dtype than
        the prefill's vLLM (start them with its --kv-cache-dtype), else ``no_compatible_node``."""
        if claim.kv_cache_dtype and self._has_compatible_node(replace(claim, kv_cache_dtype="")):
            return "kv_cache_dtype"
        return "no_compatible_node"

    def _pick_slot(self, claim: ClaimRequest) -> tuple[str, int, str] | None:
        """(node, slot, transport) on the compatible node with the most free slots."""
        best: tuple[int, str, int, str] | None = None
        for node_id, node in sorted(self.nodes.items()):
            transport = self.registry.transport_for(node, claim)
            free = self.free_slots(node_id) if transport else []
            if free and (best is None or len(free) > best[0]):
                best = (len(free), node_id, free[0], transport)
        return None if best is None else (best[1], best[2], best[3])

    def _grant(self, claim: ClaimRequest, reply_to: str, pick: tuple[str, int, str],
               claimed_at_ms: int, now_ms: int) -> list[Effect]:
        node_id, slot, transport = pick
        cfg = self.config
        lease = Lease(
            lease_id=self._new_id(), generation=self.next_generation,
            request_id=claim.request_id, node_id=node_id, slot=slot, transport=transport,
            claimed_at_ms=claimed_at_ms, granted_at_ms=now_ms,
            transfer_deadline_ms=now_ms + cfg.transfer_timeout_ms,
            fence_until_ms=now_ms + cfg.transfer_timeout_ms + cfg.fence_grace_ms,
        )
        self.next_generation += 1
        self.leases[lease.lease_id] = lease
        self.counters["claims_granted"] += 1
        effects: list[Effect] = []
        if self.next_generation > self.reserved_generation:
            # Persist a block of generations at once, not one write per grant.
            self.reserved_generation = self.next_generation + cfg.generation_block
            effects.append(PutMeta(self.reserved_generation))
        return effects + [
            PutLease(lease),
            Reply(reply_to, self._granted(lease)),
            self._event(claim.request_id, "claimed", now_ms, lease),
            Observe("queue_wait", (now_ms - claimed_at_ms) / 1000),
        ]

    def _granted(self, lease: Lease) -> ClaimGranted:
        info = self.nodes[lease.node_id].info
        assert info is not None
        slot = next(s for s in info.slots if s.slot == lease.slot)
        target = TransferTarget(
            node_id=lease.node_id, transport=lease.transport,
            endpoint=info.endpoints[lease.transport], slot=slot, layout=info.layout,
            nixl_metadata_b64=info.nixl_metadata_b64 if lease.transport == "nixl" else "",
            ranks=[RankTarget(tp_rank=r.tp_rank, endpoint=r.endpoints[lease.transport], layout=r.layout,
                              slot=next(s for s in r.slots if s.slot == lease.slot),
                              nixl_metadata_b64=r.nixl_metadata_b64 if lease.transport == "nixl" else "")
                   for r in info.ranks],
        )
        return ClaimGranted(request_id=lease.request_id, lease_id=lease.lease_id,
                            generation=lease.generation, node_id=lease.node_id,
                            expires_at_ms=lease.transfer_deadline_ms, target=target)

    def _reject(self, claim: ClaimRequest, reply_to: str, reason: str, now_ms: int,
                retry: bool = True) -> list[Effect]:
        self.counters[f"claims_rejected.{reason}"] += 1
        retry_after = self.config.retry_after_ms if retry else 0
        rejected = ClaimRejected(request_id=claim.request_id, reason=reason,
                                 retry_after_ms=retry_after)
        event = self._event(claim.request_id, "rejected", now_ms, reason=reason)
        return [Reply(reply_to, rejected), event]

    # ------------------------------------------------------------ transfer and decode reports

    def _current(self, lease_id: str, generation: int, node_id: str, slot: int) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or (lease.generation, lease.node_id, lease.slot) != (generation, node_id, slot):
            self.counters["stale_ignored"] += 1
            return None
        return lease

    def on_kv_ready(self, msg: KvReady, now_ms: int) -> list[Effect]:
        lease = self._current(msg.lease_id, msg.generation, msg.node_id, msg.slot)
        if lease is None:
            return []
        if msg.source_ranks > 1:  # a tensor-parallel prefill: every rank writes its share
            if msg.source_rank not in lease.kv_ready_ranks:
                lease.kv_ready_ranks = sorted([*lease.kv_ready_ranks, msg.source_rank])
            if len(lease.kv_ready_ranks) < msg.source_ranks:
                return [PutLease(lease)]  # others may still be writing
        lease.is_writer_done = True
        if lease.state != "claimed":
            if lease.is_terminal:
                self.counters["stale_ignored"] += 1
            return [PutLease(lease)] + self._sweep_and_dispatch(now_ms)
        lease.state, lease.kv_ready_at_ms = "kv_ready", now_ms
        return [PutLease(lease), self._event(lease.request_id, "kv_ready", now_ms, lease),
                Observe("transfer", (now_ms - lease.granted_at_ms) / 1000)]

    def on_kv_failed(self, msg: KvFailed, now_ms: int) -> list[Effect]:
        lease = self._current(msg.lease_id, msg.generation, msg.node_id, msg.slot)
        if lease is None:
            return []
        lease.is_writer_done = True
        effects: list[Effect] = []
        if lease.is_terminal:
            self.counters["stale_ignored"] += 1
        else:
            effects += self._end(lease, "failed", f"transfer_failed: {msg.reason}", now_ms)
        return effects + [PutLease(lease)] + self._sweep_and_dispatch(now_ms)

    def on_decode_started(self, msg: DecodeStarted, now_ms: int) -> list[Effect]:
        lease = self._current(msg.lease_id, msg.generation, msg.node_id, msg.slot)
        if lease is None:
            return []
        if lease.state not in ("claimed", "kv_ready"):
            self.counters["stale_ignored"] += 1
            return []
        # The node starts only after KV-ready, so the writer is done even if we missed KvReady.
        lease.is_writer_done = True
        lease.state, lease.decoding_at_ms = "decoding", now_ms
        return [PutLease(lease), self._event(lease.request_id, "decoding", now_ms, lease),
                Observe("handoff", (now_ms - lease.claimed_at_ms) / 1000)]

    def on_slot_released(self, msg: SlotReleased, now_ms: int) -> list[Effect]:
        if msg.lease_id in self.released_early:  # its heartbeat carried it: applied then
            del self.released_early[msg.lease_id]
            return []
        lease = self._current(msg.lease_id, msg.generation, msg.node_id, msg.slot)
        if lease is None:
            return []
        lease.is_node_released = True
        effects: list[Effect] = []
        if not lease.is_terminal:
            effects += self._end(lease, msg.outcome, msg.reason, now_ms)
        return effects + [PutLease(lease)] + self._sweep_and_dispatch(now_ms)

    def on_cancel(self, msg: CancelRequest, now_ms: int) -> list[Effect]:
        for i, entry in enumerate(self.queue):
            if entry.claim.request_id == msg.request_id:
                del self.queue[i]
                self.counters["claims_cancelled_queued"] += 1
                rejected = ClaimRejected(request_id=msg.request_id, reason="cancelled")
                return [DeleteQueued(msg.request_id), Reply(entry.reply_to, rejected),
                        self._event(msg.request_id, "cancelled", now_ms, reason=msg.reason)]
        lease = self.live_lease(msg.request_id)
        if lease is None:
            return []
        if msg.is_before_prefill and lease.state == "claimed":
            lease.is_writer_done = True  # no prefill was ever asked to write into the slot
        effects = self._end(lease, "cancelled", msg.reason, now_ms)
        return effects + [PutLease(lease)] + self._sweep_and_dispatch(now_ms)

    # ------------------------------------------------------------ time

    def tick(self, now_ms: int) -> list[Effect]:
        """Apply every deadline that passed: dead nodes, lease timeouts, queue deadlines."""
        effects: list[Effect] = []
        self._allow_for_stall(now_ms)
        for node in self.registry.expired(now_ms):
            self.registry.remove(node.node_id)
            effects += self._fail_node_leases(node.node_id, "node_dead", now_ms)
        for lease in list(self.leases.values()):
            if lease.state == "claimed" and now_ms >= lease.transfer_deadline_ms:
                effects += self._end(lease, "failed", "transfer_timeout", now_ms)
                effects.append(PutLease(lease))
            elif lease.state == "kv_ready" and (
                now_ms >= lease.kv_ready_at_ms + self.config.start_timeout_ms
            ):
                effects += self._end(lease, "failed", "start_timeout", now_ms)
                effects.append(PutLease(lease))
        # A waiting claim ends at its deadline, or as soon as no node could ever serve it (once
        # the start-up warm-up is over): the caller falls back at once instead of waiting in vain.
        is_warming_up = self._is_warming_up(now_ms)
        for entry in list(self.queue):
            has_node = self._has_compatible_node(entry.claim)
            if now_ms < entry.deadline_ms and (has_node or is_warming_up):
                continue
            self.queue.remove(entry)
            effects.append(DeleteQueued(entry.claim.request_id))
            reason = "deadline" if has_node else self._no_node_reason(entry.claim)
            effects += self._reject(entry.claim, entry.reply_to, reason, now_ms)
        return effects + self._sweep_and_dispatch(now_ms)

    def _allow_for_stall(self, now_ms: int) -> None:
        """Ticks further apart than ``max_tick_gap_ms``: the coordinator was not listening for the
        time beyond it. Nodes not heard from since the last tick get that time back (their beats
        may have come unheard); a node is dead only after ``heartbeat_misses`` intervals of the
        coordinator listening. Sets ``last_stall_ms`` (0: no stall)."""
        last, self.last_tick_ms, self.last_stall_ms = self.last_tick_ms, now_ms, 0
        if last is None:
            return
        stall_ms = now_ms - last - self.config.max_tick_gap_ms
        if stall_ms > 0:
            self.registry.postpone(last, stall_ms)
            self.last_stall_ms = stall_ms
            self.counters["coordinator_stalls"] += 1

    def reject_queued(self, reason: str, now_ms: int) -> list[Effect]:
        """Turn every waiting claim away (the coordinator is stopping); leases are kept."""
        effects: list[Effect] = []
        for entry in self.queue:
            effects.append(DeleteQueued(entry.claim.request_id))
            effects += self._reject(entry.claim, entry.reply_to, reason, now_ms)
        self.queue = []
        return effects

    def _end(self, lease: Lease, state: str, reason: str, now_ms: int) -> list[Effect]:
        lease.state, lease.reason, lease.ended_at_ms = state, reason, now_ms  # type: ignore[assignment]
        self.counters[f"lease_outcome.{state}"] += 1
        event = self._event(lease.request_id, state, now_ms, lease, reason)
        # The node holding the slot hears of it on its own subject (it frees or stops the slot).
        return [event, Publish(subjects.decode_lease_ended(lease.node_id), event.event)]

    def _is_reclaimable(self, lease: Lease, now_ms: int) -> bool:
        """No writer may be live and the node let go of the slot (or should have, long ago)."""
        if not lease.is_terminal:
            return False
        is_writer_gone = lease.is_writer_done or now_ms >= lease.fence_until_ms
        is_node_done = lease.is_node_released or (
            now_ms >= lease.ended_at_ms + self.config.release_grace_ms
        )
        return is_writer_gone and is_node_done

    def _sweep_and_dispatch(self, now_ms: int) -> list[Effect]:
        effects: list[Effect] = []
        for lease in [l for l in self.leases.values() if self._is_reclaimable(l, now_ms)]:
            del self.leases[lease.lease_id]
            effects.append(DeleteLease(lease.lease_id))
        for entry in list(self.queue):
            pick = self._pick_slot(entry.claim)
            if pick is not None:
                self.queue.remove(entry)
                effects.append(DeleteQueued(entry.claim.request_id))
                effects += self._grant(entry.claim, entry.reply_to, pick,
                                       entry.enqueued_at_ms, now_ms)
        return effects

    # ------------------------------------------------------------ events

    def _event(self, request_id: str, state: str, now_ms: int, lease: Lease | None = None,
               reason: str = "") -> Publish:
        event = HandoffEvent(request_id=request_id, state=state, at_ms=now_ms, reason=reason)  # type: ignore[arg-type]
        if lease is not None:
            event.lease_id, event.generation = lease.lease_id, lease.generation
            event.node_id, event.slot = lease.node_id, lease.slot
        return Publish(subjects.handoff(request_id, state), event)


def _is_token(value: str) -> bool:
    """Letters, digits, '-' and '_' only (a NATS subject token and a KV key)."""
    return bool(value) and all(c.isascii() and (c.isalnum() or c in "-_") for c in value)
