"""The decode node's slot lifecycle: pure, no NATS, no engine, no clock (``now_s`` is passed in).

Contract:
- A slot holds at most one lease for the engine (``current``) and at most one lease still
  collecting its halves (``waiting``). A lease is ready when both halves of the same (lease id,
  generation) are here, ``DecodeStart`` and ``KvReady``, in either order; from a tensor-parallel
  prefill, a ``KvReady`` from each of its ``source_ranks`` (each rank wrote its share).
- Phases of a slot's current lease: ready (the engine has not seen it) -> starting (handed to the
  engine: inject + start) -> decoding -> stopping (handed to the engine to cancel) -> ended.
- Engine work is never decided while a step runs: the shell takes it between steps
  (``take_engine_work``) and reports the results (``on_engine_started``, ``on_engine_failed``,
  ``on_engine_stopped``, ``on_output``). Only those inputs return ``ReleaseEngine``.
- Stale halves are ignored and counted (``num_stale``): a generation below the slot's floor, a
  lease already ended, a duplicate of a half already here. A newer generation supersedes older
  waiting halves. Ending a lease raises its slot's floor past its generation.
- Ending a lease (KvFailed, a layout mismatch, CancelRequest, a coordinator lease end): a waiting
  or ready lease ends at once; one in the engine stops before the next step, then ends with its
  terminal event on ``xl.req.<id>.tokens`` when the end is to be told (``notify``: cancels,
  start failures, node stopping, engine errors). Every end republishes availability, then
  reports ``SlotReleased`` to the coordinator; a lease unknown here is reported released too.
- A KvReady the shell found wrong (``on_kv_rejected``: its segment checksums do not match the
  receive buffer, or the node requires checksums and it has none) ends its lease as failed with
  that reason, as a KvFailed would; the router migrates the request.
- Coordinator lease ends (``HandoffEvent`` on ``xl.decode.<node>.ended``): failed and cancelled
  end the lease here (only a cancel is told to the router: it migrates failures itself);
  completed, or a lease already ended, changes nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from services.decode.effects import (
    Effect, EngineWork, Finished, Forget, Heartbeat, Publish, ReleaseEngine, StartEngine, StopEngine,
)
from shared import subjects
from shared.events import (
    CancelRequest, DecodeStart, DecodeStarted, HandoffEvent, KvFailed, KvReady, RequestFailed,
    RequestFinished, SlotReleased, SpecStats, TokensGenerated, Usage,
)

NUM_ENDED_REMEMBERED = 4096  # lease ids kept to recognise late halves and duplicate ends


@dataclass(frozen=True)
class Stop:
    """Why a lease ends: outcome (completed | failed | cancelled), reason, whether to tell the router,
    and (failed) whether another node may succeed (``RequestFailed.retryable``)."""

    outcome: str
    reason: str
    notify: bool
    retryable: bool = True


@dataclass
class Lease:
    """One lease generation on one slot, as this node knows it."""

    lease_id: str
    generation: int
    request_id: str
    slot: int
    start: DecodeStart | None = None
    kv: KvReady | None = None  # the last KvReady (of a tensor-parallel prefill: every rank's, in kv_ranks)
    kv_ranks: set[int] = field(default_factory=set)  # prefill ranks whose KvReady is here
    phase: str = "waiting"  # waiting | ready | starting | decoding | stopping
    stop: Stop | None = None  # asked to end while in the engine
    next_index: int = 0  # completion index of the next token to emit
    num_completion_tokens: int = 0
    started_at_s: float = 0.0

    @property
    def has_kv(self) -> bool:
        """Every writing prefill rank announced its KV (one KvReady, or one per source rank)."""
        return self.kv is not None and len(self.kv_ranks) >= self.kv.source_ranks

    @property
    def is_ready(self) -> bool:
        return self.start is not None and self.has_kv


@dataclass
class Slot:
    floor: int = 0  # generations below this are stale
    current: Lease | None = None  # ready, in the engine, or stopping
    waiting: Lease | None = None  # halves of the next lease

    @property
    def is_free(self) -> bool:
        return self.current is None and self.waiting is None


@dataclass
class SlotCore:
    """Every slot's lease lifecycle; every input returns the effects to perform (module docstring)."""

    node_id: str
    num_slots: int
    layout_version: int
    slots: list[Slot] = field(default_factory=list)
    num_stale: int = 0
    counters: Counter = field(default_factory=Counter)
    ended: dict[str, None] = field(default_factory=dict)  # lease ids, oldest first

    def __post_init__(self) -> None:
        self.slots = [Slot() for _ in range(self.num_slots)]

    # ------------------------------------------------------------ inspection

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.is_free]

    def engine_slots(self) -> list[int]:
        """Slots whose lease the engine holds (starting, decoding or stopping)."""
        return [i for i, s in enumerate(self.slots)
                if s.current is not None and s.current.phase in ("starting", "decoding", "stopping")]

    def lease(self, lease_id: str) -> Lease | None:
        """The lease with this id if the node holds it (waiting, ready, or in the engine)."""
        return next((lease for lease in self._leases() if lease.lease_id == lease_id), None)

    @property
    def is_idle(self) -> bool:
        return all(s.is_free for s in self.slots)

    @property
    def is_decoding(self) -> bool:
        """Whether an engine step has work."""
        return any(s.current is not None and s.current.phase == "decoding" for s in self.slots)

    def fault_stall_due(self, after_tokens: int) -> bool:
        """FAULT INJECTION (``--fault-stall-after-tokens``): whether a request's first leg has
        reached ``after_tokens`` completion tokens (0: never)."""
        return after_tokens > 0 and any(
            s.current is not None and s.current.start is not None
            and s.current.start.migration == 0 and s.current.num_completion_tokens >= after_tokens
            for s in self.slots)

    @property
    def has_engine_work(self) -> bool:
        return any(self._work_for(s) for s in self.slots)

    # ------------------------------------------------------------ bus inputs

    def on_start(self, msg: DecodeStart) -> list[Effect]:
        return self._add_half(msg)

    def on_kv(self, msg: KvReady | KvFailed) -> list[Effect]:
        return self.on_kv_ready(msg) if isinstance(msg, KvReady) else self.on_kv_failed(msg)

    def on_kv_ready(self, msg: KvReady) -> list[Effect]:
        if msg.node_id != self.node_id:
            return []
        if msg.layout_version != self.layout_version:
            self.counters["kv_layout_mismatch"] += 1
            return self._end_lease(msg.slot, msg.lease_id, msg.generation, msg.request_id,
                                   Stop("failed", f"layout version {msg.layout_version}", False))
        return self._add_half(msg)

    def on_kv_failed(self, msg: KvFailed) -> list[Effect]:
        if msg.node_id != self.node_id:
            return []
        return self._end_lease(msg.slot, msg.lease_id, msg.generation, msg.request_id,
                               Stop("failed", f"transfer_failed: {msg.reason}", False))

    def on_kv_rejected(self, msg: KvReady, reason: str) -> list[Effect]:
        """The shell checked the KV this KvReady announces and found it wrong (``reason``)."""
        if msg.node_id != self.node_id:
            return []
        self.counters[f"kv_rejected.{reason}"] += 1
        return self._end_lease(msg.slot, msg.lease_id, msg.generation, msg.request_id,
                               Stop("failed", reason, False))

    def on_cancel(self, msg: CancelRequest) -> list[Effect]:
        for lease in self._leases():
            if lease.request_id == msg.request_id:
                return self._end_lease(lease.slot, lease.lease_id, lease.generation,
                                       lease.request_id, Stop("cancelled", msg.reason, True))
        return []

    def on_lease_ended(self, ev: HandoffEvent) -> list[Effect]:
        """The coordinator ended a lease of this node (it may have ended here already)."""
        if ev.node_id != self.node_id or ev.state not in ("failed", "cancelled"):
            return []
        stop = Stop(ev.state, ev.reason, notify=ev.state == "cancelled")
        return self._end_lease(ev.slot, ev.lease_id, ev.generation, ev.request_id, stop)

    def stop_all(self, outcome: str, reason: str) -> list[Effect]:
        """Stop every lease in the engine before the next step, telling the router (drain, engine
        errors); ready leases the engine has not seen are left alone."""
        for i in self.engine_slots():
            self._ask_stop(self.slots[i].current, Stop(outcome, reason, True))
        return []

    def fail_all(self, reason: str, now_s: float) -> list[Effect]:
        """The engine is gone (a tensor-parallel rank died): end every lease now, each told to the
        router as a retryable failure (it migrates them) and released to the coordinator, with no
        engine work (nothing is asked of the engine, no ``ReleaseEngine``)."""
        effects: list[Effect] = []
        stop = Stop("failed", reason, True)
        for s in self.slots:
            for lease in (s.current, s.waiting):
                if lease is None:
                    continue
                if lease.lease_id in self.ended:
                    continue  # ended above (a waiting lease promoted as its slot freed)
                if lease.start is not None:  # the router knows it: a terminal event it migrates on
                    done = self._finish(lease, stop, "cancelled", SpecStats(), now_s)
                else:
                    done = self._release(lease.slot, lease.lease_id, lease.generation, lease.request_id, stop)
                effects += [e for e in done if not isinstance(e, (ReleaseEngine, StartEngine))]
        return effects

    # ------------------------------------------------------------ engine inputs

    def take_engine_work(self) -> list[EngineWork]:
        """Starts and stops to perform before the next step (each handed out once)."""
        work: list[EngineWork] = []
        for i, s in enumerate(self.slots):
            lease = s.current
            kind = self._work_for(s)
            if kind == "start":
                lease.phase = "starting"
                work.append(StartEngine(i, lease.lease_id, lease.request_id, lease.kv.num_tokens,
                                        lease.start.first_token_id, lease.start.sampling,
                                        lease.start.migration))
            elif kind == "stop":
                lease.phase = "stopping"
                work.append(StopEngine(i, lease.lease_id))
        return work

    def on_engine_started(self, slot: int, lease_id: str, now_s: float) -> list[Effect]:
        lease = self._engine_lease(slot, lease_id, "starting")
        if lease is None:
            return []
        lease.phase, lease.started_at_s = "decoding", now_s
        lease.next_index = lease.num_completion_tokens = 1 + lease.start.num_tokens_already_sent
        if lease.stop is not None:  # ended while the engine took it: stopped before any step
            return []
        effects: list[Effect] = [Publish(subjects.COORD_REPORT, DecodeStarted(
            request_id=lease.request_id, lease_id=lease.lease_id, generation=lease.generation,
            node_id=self.node_id, slot=slot), lease.lease_id)]
        if lease.start.sampling.max_tokens <= 0:
            effects += self._finish(lease, Stop("completed", "", True), "length", SpecStats(), now_s)
        return effects

    def on_engine_failed(self, slot: int, lease_id: str, reason: str, now_s: float,
                         retryable: bool = True) -> list[Effect]:
        """The engine could not start the lease (bad sizes or parameters): the request fails;
        ``retryable=False`` when no node can serve it (a grammar that does not compile)."""
        lease = self._engine_lease(slot, lease_id, "starting")
        if lease is None:
            return []
        lease.started_at_s = now_s
        return self._finish(lease, Stop("failed", reason, True, retryable), "cancelled", SpecStats(), now_s)

    def on_engine_stopped(self, slot: int, lease_id: str, spec: SpecStats, now_s: float) -> list[Effect]:
        lease = self._engine_lease(slot, lease_id, "stopping")
        if lease is None:
            return []
        return self._finish(lease, lease.stop, "cancelled", spec, now_s)

    def on_output(self, slot: int, token_ids: list[int], finish_reason: str | None,
                  spec: SpecStats | None, now_s: float, logprobs: list | None = None) -> list[Effect]:
        """One engine step's tokens for a slot; ``spec`` is needed when it finished; ``logprobs``:
        one TokenLogprobs per token when the request asked for them."""
        lease = self.slots[slot].current if 0 <= slot < self.num_slots else None
        if lease is None or lease.phase != "decoding":
            return []
        effects: list[Effect] = []
        if token_ids:
            effects.append(Publish(subjects.req_tokens(lease.request_id), TokensGenerated(
                request_id=lease.request_id, index=lease.next_index, token_ids=list(token_ids),
                logprobs=list(logprobs or [])), lease.lease_id))
            lease.next_index += len(token_ids)
            lease.num_completion_tokens += len(token_ids)
            self.counters["tokens_generated"] += len(token_ids)
        if finish_reason is not None:
            effects += self._finish(lease, Stop("completed", "", True), finish_reason,
                                    spec or SpecStats(), now_s)
        return effects

    def on_emit_failed(self, slot: int, lease_id: str) -> list[Effect]:
        """Publishing a slot's output failed: that request stops, the others go on."""
        lease = self.slots[slot].current
        if lease is not None and lease.lease_id == lease_id:
            self._ask_stop(lease, Stop("failed", "emit_failed", False))
        return []

    # ------------------------------------------------------------ transitions

    def _leases(self):
        for s in self.slots:
            yield from (lease for lease in (s.current, s.waiting) if lease is not None)

    @staticmethod
    def _work_for(s: Slot) -> str | None:
        lease = s.current
        if lease is None:
            return None
        if lease.phase == "ready":
            return "start"
        if lease.phase == "decoding" and lease.stop is not None:
            return "stop"
        return None

    def _engine_lease(self, slot: int, lease_id: str, phase: str) -> Lease | None:
        lease = self.slots[slot].current if 0 <= slot < self.num_slots else None
        if lease is None or lease.lease_id != lease_id or lease.phase != phase:
            self.counters["engine_report_ignored"] += 1
            return None
        return lease

    def _stale(self) -> list[Effect]:
        self.num_stale += 1
        return []

    def _add_half(self, half: DecodeStart | KvReady) -> list[Effect]:
        if not 0 <= half.slot < self.num_slots:
            return self._stale()
        s = self.slots[half.slot]
        if half.generation < s.floor or half.lease_id in self.ended:
            return self._stale()
        if s.current is not None and s.current.lease_id == half.lease_id:
            return self._stale()  # a duplicate of a lease that is complete already
        was_free = s.is_free
        effects: list[Effect] = []
        w = s.waiting
        if w is not None and (w.lease_id, w.generation) != (half.lease_id, half.generation):
            if half.generation < w.generation:
                return self._stale()
            self._remember_ended(w.lease_id)  # superseded by a newer generation
            effects.append(Forget(w.lease_id))
            w = s.waiting = None
        if w is None:
            w = s.waiting = Lease(half.lease_id, half.generation, half.request_id, half.slot)
        if isinstance(half, DecodeStart):
            if w.start is not None:
                return effects + self._stale()
            w.start = half
        else:
            if half.source_rank in w.kv_ranks:
                return effects + self._stale()
            w.kv = half
            w.kv_ranks.add(half.source_rank)
        if was_free:
            effects.append(Heartbeat())  # the slot just became busy
        return effects + self._promote(s)

    def _promote(self, s: Slot) -> list[Effect]:
        """The waiting lease becomes current when it is complete and the slot has room."""
        lease = s.waiting
        if s.current is not None or lease is None or not lease.is_ready:
            return []
        s.current, s.waiting, lease.phase = lease, None, "ready"
        start, kv = lease.start, lease.kv
        if start.num_tokens_already_sent == 0 and kv.num_tokens != start.num_prompt_tokens:
            reason = (f"start_failed: the KV holds {kv.num_tokens} tokens but the prompt has "
                      f"{start.num_prompt_tokens}")
            return self._finish(lease, Stop("failed", reason, True), "cancelled", SpecStats(), 0.0)
        return []

    def _ask_stop(self, lease: Lease, stop: Stop) -> None:
        if lease.stop is None:  # the first reason to stop stands
            lease.stop = stop

    def _end_lease(self, slot: int, lease_id: str, generation: int, request_id: str,
                   stop: Stop) -> list[Effect]:
        """End a lease that is waiting, ready, in the engine, or unknown here."""
        if not 0 <= slot < self.num_slots or lease_id in self.ended:
            return []
        s = self.slots[slot]
        lease = s.current if s.current is not None and s.current.lease_id == lease_id else None
        if lease is not None and lease.phase != "ready":
            self._ask_stop(lease, stop)  # in the engine: stopped before the next step
            return []
        return self._release(slot, lease_id, generation, request_id, stop)

    def _finish(self, lease: Lease, stop: Stop, finish_reason: str, spec: SpecStats,
                now_s: float) -> list[Effect]:
        """End a lease the engine held (or was handed): terminal event, engine slot, release."""
        effects: list[Effect] = []
        subject = _tokens_subject(lease.request_id) if stop.notify else None
        decode_ms = (now_s - lease.started_at_s) * 1000 if lease.phase != "ready" else 0.0
        if subject is not None and stop.outcome == "failed":
            effects.append(Publish(subject, RequestFailed(
                request_id=lease.request_id, reason=stop.reason, retryable=stop.retryable), lease.lease_id))
        elif subject is not None:
            effects.append(Publish(subject, RequestFinished(
                request_id=lease.request_id, finish_reason=finish_reason,
                usage=Usage(prompt_tokens=lease.start.num_prompt_tokens,
                            completion_tokens=lease.num_completion_tokens),
                spec=spec, decode_ms=decode_ms), lease.lease_id))
        if lease.phase != "ready":
            effects.append(ReleaseEngine(lease.slot))
        effects.append(Finished(lease.slot, lease.lease_id, lease.request_id, stop.outcome,
                                stop.reason, finish_reason, lease.num_completion_tokens, decode_ms))
        kind = finish_reason if stop.outcome == "completed" else stop.outcome
        self.counters[f"finished.{kind}"] += 1
        return effects + self._release(lease.slot, lease.lease_id, lease.generation,
                                       lease.request_id, stop)

    def _release(self, slot: int, lease_id: str, generation: int, request_id: str,
                 stop: Stop) -> list[Effect]:
        """Forget the lease, raise the floor, tell everyone the slot is free, start what waits."""
        s = self.slots[slot]
        s.floor = max(s.floor, generation + 1)
        self._remember_ended(lease_id)
        was_held = False
        if s.current is not None and s.current.lease_id == lease_id:
            s.current, was_held = None, True
        if s.waiting is not None and s.waiting.lease_id == lease_id:
            s.waiting, was_held = None, True
        self.counters[f"released.{stop.outcome}"] += 1
        released = SlotReleased(request_id=request_id, lease_id=lease_id, generation=generation,
                                node_id=self.node_id, slot=slot, outcome=stop.outcome, reason=stop.reason)
        effects: list[Effect] = [
            # availability first, carrying the release: the coordinator frees the slot on it
            # without the report stream's round trips; the report is the record
            Heartbeat(released),
            Publish(subjects.COORD_REPORT, released, lease_id),
        ]
        if was_held:
            effects.append(Forget(lease_id))
        return effects + self._promote(s)

    def _remember_ended(self, lease_id: str) -> None:
        self.ended[lease_id] = None
        while len(self.ended) > NUM_ENDED_REMEMBERED:
            del self.ended[next(iter(self.ended))]


def _tokens_subject(request_id: str) -> str | None:
    try:
        return subjects.req_tokens(request_id)
    except ValueError:  # no subject can carry it: nobody to tell
        return None
