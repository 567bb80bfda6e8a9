"""Table-driven tests of the coordinator's pure state machine.

Each case is a list of steps ``(t_ms, op, args, expect)``; the harness feeds the op to the core at
time ``t_ms`` and checks what the step must have produced: the claim reply, the handoff events,
the lease states, the slots held, the queue depth and the stale counter. Every case ends with no
lease and no queued claim left (leak check), after completing whatever is still open.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest

from services.coordinator.core import CoordinatorCore
from services.coordinator.model import (
    CoordinatorConfig, DeleteLease, Lease, PutLease, PutMeta, PutQueued, DeleteQueued,
    Publish, QueuedClaim, Reply,
)
from shared import subjects
from shared.events import (
    CancelRequest, ClaimGranted, ClaimRejected, ClaimRequest, DecodeStarted, KvFailed, KvReady,
    NodeAvailable, NodeDraining, SlotReleased, SlotTarget,
)
from shared.kvlayout import KvShape, layout_spec

LAYOUT = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8), "float32", 256)
FP8_LAYOUT = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8), "fp8_e4m3", 256)
CFG = CoordinatorConfig(transfer_timeout_ms=1000, fence_grace_ms=500, start_timeout_ms=2000,
                        release_grace_ms=300, max_queue=2, max_wait_ms=5000, retry_after_ms=250,
                        max_tick_gap_ms=100)


def hb(node="n1", free=(0,), total=None, seq=1, model="m", interval=10_000, layout=LAYOUT, proto=1,
       transports=("mooncake",)):
    total = total if total is not None else max(free, default=0) + 1
    return NodeAvailable(
        node_id=node, model=model, protocol_version=proto, total_slots=total,
        free_slots=list(free), transports=list(transports),
        endpoints={t: f"{node}:{t}" for t in transports},
        slots=[SlotTarget(slot=s, base_addr=0x1000 * (s + 1), nbytes=layout.slot_nbytes)
               for s in range(total)],
        layout=layout, heartbeat_interval_ms=interval, seq=seq, sent_at_ms=0)


class Harness:
    def __init__(self, config=CFG):
        ids = itertools.count(1)
        self.config, self.new_id = config, lambda: f"L{next(ids)}"  # a restarted core keeps numbering
        self.core = CoordinatorCore(config, new_id=self.new_id)
        self.replies: dict[str, object] = {}
        self.events: list[tuple[str, str]] = []
        self.store: dict[str, Lease] = {}
        self.queued: dict[str, QueuedClaim] = {}
        self.meta = 1
        self.last_lease: dict[str, Lease] = {}

    def lease_of(self, rid):
        return self.last_lease[rid]

    def report_args(self, rid, gen=None, lease_id=None):
        lease = self.lease_of(rid)
        return dict(request_id=rid, lease_id=lease_id or lease.lease_id,
                    generation=lease.generation if gen is None else gen,
                    node_id=lease.node_id, slot=lease.slot)

    def run(self, t, op, args):
        c = self.core
        if op == "hb":
            released = [SlotReleased(**self.report_args(rid), outcome="completed")
                        for rid in args.pop("released", ())]
            beat = hb(**args)
            if released:  # the beat a release made (as the node sends it)
                beat = msgspec.structs.replace(beat, released=[
                    msgspec.structs.replace(r, node_id=beat.node_id) for r in released])
            effects = c.on_heartbeat(beat, t)
        elif op == "drain":
            effects = c.on_draining(NodeDraining(node_id=args["node"], sent_at_ms=t), t)
        elif op == "claim":
            claim = ClaimRequest(request_id=args["rid"], model=args.get("model", "m"),
                                 num_prompt_tokens=args.get("prompt", 10), max_tokens=args.get("max", 10),
                                 wait_ms=args.get("wait", 1000), protocol_version=args.get("proto", 1),
                                 transports=args.get("transports", ["mooncake", "nixl"]),
                                 kv_cache_dtype=args.get("kv", ""), exclude_nodes=args.get("exclude", []))
            effects = c.on_claim(claim, f"inbox.{args['rid']}", t)
        elif op == "kv_ready":
            rank, ranks = args.pop("source", (0, 1))  # a tensor-parallel prefill's rank, of how many
            effects = c.on_kv_ready(KvReady(**self.report_args(**args), num_tokens=10,
                                            layout_version=1, nbytes=100, source_rank=rank, source_ranks=ranks), t)
        elif op == "kv_failed":
            effects = c.on_kv_failed(KvFailed(**self.report_args(**args), reason="boom"), t)
        elif op == "started":
            effects = c.on_decode_started(DecodeStarted(**self.report_args(**args)), t)
        elif op == "released":
            outcome = args.pop("outcome", "completed")
            effects = c.on_slot_released(SlotReleased(**self.report_args(**args), outcome=outcome), t)
        elif op == "cancel":
            effects = c.on_cancel(CancelRequest(request_id=args["rid"],
                                                is_before_prefill=args.get("before_prefill", False)), t)
        elif op == "heard":  # a node's message arrived; its handling waits behind a write
            c.on_heard(args.get("node", "n1"), t)
            effects = []
        elif op == "reconnected":
            effects = c.on_reconnected(t)
        elif op == "stop":
            effects = c.reject_queued("coordinator_stopping", t)
        elif op == "tick":
            effects = c.tick(t)
        elif op == "restart":  # a new core adopting what the shell persisted
            self.core = CoordinatorCore(self.config, new_id=self.new_id)
            self.core.restore(list(self.store.values()), list(self.queued.values()), self.meta, t)
            effects = []
        else:
            raise AssertionError(op)
        step_events, step_ended = [], []
        for e in effects:
            if isinstance(e, Reply):
                self.replies[e.reply_to.removeprefix("inbox.")] = e.event
            elif isinstance(e, Publish) and e.subject.startswith("xl.decode."):
                step_ended.append((e.subject, e.event))
            elif isinstance(e, Publish):
                assert e.subject == subjects.handoff(e.event.request_id, e.event.state), e
                step_events.append((e.event.request_id, e.event.state))
            elif isinstance(e, PutLease):
                self.last_lease[e.lease.request_id] = e.lease
                self.store[e.lease.lease_id] = Lease(**{f: getattr(e.lease, f) for f in e.lease.__struct_fields__})
            elif isinstance(e, DeleteLease):
                self.store.pop(e.lease_id, None)
            elif isinstance(e, PutQueued):
                self.queued[e.entry.claim.request_id] = e.entry
            elif isinstance(e, DeleteQueued):
                self.queued.pop(e.request_id, None)
            elif isinstance(e, PutMeta):
                self.meta = e.next_generation
        self.events += step_events
        self.check_node_told(effects, step_ended)
        return step_events

    @staticmethod
    def check_node_told(effects, step_ended):
        """Every terminal event of a lease also goes to the lease's node, on its own subject."""
        terminal = [e.event for e in effects if isinstance(e, Publish) and e.event.lease_id
                    and e.event.state in ("completed", "failed", "cancelled")
                    and not e.subject.startswith("xl.decode.")]
        assert step_ended == [(subjects.decode_lease_ended(ev.node_id), ev) for ev in terminal]

    def check(self, expect, step_events):
        c = self.core
        for key, want in expect.items():
            if key == "reply":
                for rid, spec in want.items():
                    got = self.replies.get(rid)
                    if spec is None:
                        assert got is None, (rid, got)
                    elif spec[0] == "granted":
                        assert isinstance(got, ClaimGranted), (rid, got)
                        assert (got.node_id, got.target.slot.slot, got.generation) == spec[1:], got
                        assert got.target.slot.base_addr == 0x1000 * (spec[2] + 1)
                    else:
                        assert isinstance(got, ClaimRejected), (rid, got)
                        assert (got.reason, got.retry_after_ms) == spec[1:], got
            elif key == "events":
                assert step_events == want
            elif key == "state":
                for rid, state in want.items():
                    lease = c.live_lease(rid) or next(
                        (l for l in c.leases.values() if l.request_id == rid), None)
                    assert (lease.state if lease else None) == state, (rid, lease)
            elif key == "held":
                assert sorted((l.node_id, l.slot) for l in c.leases.values()) == sorted(want)
            elif key == "queue":
                assert [q.claim.request_id for q in c.queue] == want
            elif key == "stale":
                assert c.counters["stale_ignored"] == want
            elif key == "free":
                assert c.num_free_slots() == want
            elif key == "nodes":
                assert sorted(c.nodes) == want
            elif key == "stall":
                assert c.last_stall_ms == want
            else:
                raise AssertionError(key)

    def assert_no_leak(self):
        assert self.core.leases == {} and self.core.queue == []
        assert self.store == {} and self.queued == {}  # nothing left in the persisted state


def finish(rid, t, outcome="completed"):
    """Steps that take a granted request through to a released slot."""
    return [(t, "kv_ready", {"rid": rid}, {}), (t, "started", {"rid": rid}, {}),
            (t, "released", {"rid": rid, "outcome": outcome}, {"state": {rid: None}})]


def decoding(rid, t):
    """Steps that take a claim to decoding (no transfer or start deadline left to run out)."""
    return [(t, "claim", {"rid": rid}, {}), (t, "kv_ready", {"rid": rid}, {}),
            (t, "started", {"rid": rid}, {"state": {rid: "decoding"}})]


G = "granted"
CASES = {
    "grant_first_free_slot": [
        (0, "hb", {"free": (0, 1)}, {"free": 2}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 0, 1)}, "events": [("r1", "claimed")],
                                     "held": [("n1", 0)], "free": 1}),
        (2, "kv_ready", {"rid": "r1"}, {"events": [("r1", "kv_ready")], "state": {"r1": "kv_ready"}}),
        (3, "started", {"rid": "r1"}, {"events": [("r1", "decoding")]}),
        (4, "released", {"rid": "r1"}, {"events": [("r1", "completed")], "held": [], "free": 2}),
    ],
    "grant_spreads_to_node_with_most_free": [
        (0, "hb", {"node": "a", "free": (0,)}, {}),
        (0, "hb", {"node": "b", "free": (0, 1)}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "b", 0, 1)}}),
        (1, "claim", {"rid": "r2"}, {"reply": {"r2": (G, "a", 0, 2)}}),
        *finish("r1", 2), *finish("r2", 2),
    ],
    "slot_busy_on_node_is_not_leased": [
        (0, "hb", {"free": (1,), "total": 2}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 1, 1)}}),
        *finish("r1", 2),
    ],
    "retried_claim_gets_same_lease": [
        (0, "hb", {"free": (0, 1)}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 0, 1)}}),
        (2, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 0, 1)}, "events": [], "held": [("n1", 0)]}),
        *finish("r1", 3),
    ],
    "queue_then_grant_on_release": [
        (0, "hb", {"free": (0,)}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 0, 1)}}),
        (2, "claim", {"rid": "r2"}, {"reply": {"r2": None}, "events": [("r2", "queued")], "queue": ["r2"]}),
        (3, "kv_ready", {"rid": "r1"}, {"queue": ["r2"]}),
        (4, "started", {"rid": "r1"}, {"queue": ["r2"]}),
        (5, "released", {"rid": "r1"}, {"reply": {"r2": (G, "n1", 0, 2)}, "queue": [],
                                        "events": [("r1", "completed"), ("r2", "claimed")]}),
        *finish("r2", 6),
    ],
    "heartbeat_release_grants_the_waiting_claim_and_the_report_changes_nothing": [
        (0, "hb", {"free": (0,)}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": (G, "n1", 0, 1)}}),
        (2, "claim", {"rid": "r2"}, {"queue": ["r2"]}),
        (3, "kv_ready", {"rid": "r1"}, {}),
        (4, "started", {"rid": "r1"}, {"queue": ["r2"]}),
        (5, "hb", {"free": (0,), "released": ["r1"]}, {
            "reply": {"r2": (G, "n1", 0, 2)}, "queue": [], "held": [("n1", 0)],
            "events": [("r1", "completed"), ("r2", "claimed")]}),
        (6, "released", {"rid": "r1"}, {"events": [], "stale": 0, "held": [("n1", 0)],
                                        "state": {"r2": "claimed"}}),
        *finish("r2", 7),
    ],
    "heartbeat_release_before_decoding_waits_for_the_report": [
        (0, "hb", {"free": (0,)}, {}),
        (1, "claim", {"rid": "r1"}, {}),
        (2, "claim", {"rid": "r2"}, {"queue": ["r2"]}),
        (3, "kv_ready", {"rid": "r1"}, {}),
        # the node's DecodeStarted is still in the report stream: its order is kept
        (4, "hb", {"free": (0,), "released": ["r1"]}, {"events": [], "queue": ["r2"],
                                                        "state": {"r1": "kv_ready"}}),
        (5, "started", {"rid": "r1"}, {"events": [("r1", "decoding")]}),
        (6, "released", {"rid": "r1"}, {"events": [("r1", "completed"), ("r2", "claimed")],
                                        "reply": {"r2": (G, "n1", 0, 2)}}),
        *finish("r2", 7),
    ],
    "heartbeat_release_of_another_nodes_lease_is_ignored": [
        (0, "hb", {"node": "a", "free": (0,)}, {}),
        (0, "hb", {"node": "b", "free": (0,)}, {}),
        *decoding("r1", 1),
        (2, "hb", {"node": "b", "free": (0,), "released": ["r1"]}, {"events": [], "held": [("a", 0)]}),
        (3, "released", {"rid": "r1"}, {"events": [("r1", "completed")]}),
    ],
    "gated_dispatch_oldest_first": [
        (0, "hb", {"free": (0,)}, {}),
        (1, "claim", {"rid": "r1"}, {}),
        (2, "claim", {"rid": "r2"}, {}),
        (3, "claim", {"rid": "r3"}, {"queue": ["r2", "r3"]}),
        *finish("r1", 4)[:2],
        (5, "released", {"rid": "r1"}, {"reply": {"r2": (G, "n1", 0, 2), "r3": None}, "queue": ["r3"]}),
        *finish("r2", 6)[:2],
        (7, "released", {"rid": "r2"}, {"reply": {"r3": (G, "n1", 0, 3)}, "queue": []}),
        *finish("r3", 8),
    ],
    "queue_deadline_rejects_with_retry_after": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2", "wait": 50}, {"queue": ["r2"]}),
        (49, "tick", {}, {"queue": ["r2"], "reply": {"r2": None}}),
        (50, "tick", {}, {"queue": [], "reply": {"r2": ("rejected", "deadline", 250)},
                          "events": [("r2", "rejected")]}),
        *finish("r1", 60),
    ],
    "queue_full_rejects": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (0, "claim", {"rid": "r3"}, {"queue": ["r2", "r3"]}),
        (0, "claim", {"rid": "r4"}, {"reply": {"r4": ("rejected", "queue_full", 250)}, "queue": ["r2", "r3"]}),
        (1, "cancel", {"rid": "r2"}, {"reply": {"r2": ("rejected", "cancelled", 0)}, "queue": ["r3"]}),
        (2, "cancel", {"rid": "r3"}, {"queue": []}),
        *finish("r1", 3),
    ],
    "no_wait_rejects_at_once": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2", "wait": 0}, {"reply": {"r2": ("rejected", "no_free_slot", 250)}}),
        *finish("r1", 1),
    ],
    "incompatible_nodes_reject": [
        (0, "hb", {"node": "other_model", "model": "x"}, {}),
        (0, "hb", {"node": "old_layout", "layout": msgspec.structs.replace(LAYOUT, layout_version=0)}, {}),
        (0, "hb", {"node": "nixl_only", "transports": ("nixl",), "model": "y"}, {}),
        (0, "hb", {"node": "old_proto", "proto": 0, "model": "z"}, {}),
        (1, "claim", {"rid": "r1"}, {"reply": {"r1": ("rejected", "no_compatible_node", 250)}}),
        (1, "claim", {"rid": "r2", "model": "y", "transports": ["mooncake"]},
         {"reply": {"r2": ("rejected", "no_compatible_node", 250)}}),
        (1, "claim", {"rid": "r3", "model": "z"}, {"reply": {"r3": ("rejected", "no_compatible_node", 250)}}),
        (1, "claim", {"rid": "r4", "model": "x", "prompt": 250}, {"reply": {"r4": ("rejected", "no_compatible_node", 250)}}),
        (1, "claim", {"rid": "r5", "model": "x", "proto": 2}, {"reply": {"r5": ("rejected", "protocol_version", 0)}}),
        (1, "claim", {"rid": "r.7"}, {"reply": {"r.7": ("rejected", "invalid_request_id", 0)}, "events": []}),
        (1, "claim", {"rid": "r6", "model": "y", "transports": ["nixl"]}, {"reply": {"r6": (G, "nixl_only", 0, 1)}}),
        *finish("r6", 2),
    ],
    # the prefill's vLLM --kv-cache-dtype picks nodes whose slots keep KV in that dtype
    "kv_cache_dtype_pairs_only_matching_nodes": [
        (0, "hb", {"node": "plain"}, {}),
        (0, "hb", {"node": "fp8", "layout": FP8_LAYOUT}, {}),
        (1, "claim", {"rid": "r1", "kv": "fp8"}, {"reply": {"r1": (G, "fp8", 0, 1)}}),
        (1, "claim", {"rid": "r2", "kv": "auto"}, {"reply": {"r2": (G, "plain", 0, 2)}}),
        (1, "claim", {"rid": "r3", "kv": "fp8_e5m2"}, {"reply": {"r3": ("rejected", "kv_cache_dtype", 250)}}),
        (1, "claim", {"rid": "r4", "kv": "fp8_e5m2", "model": "x"},
         {"reply": {"r4": ("rejected", "no_compatible_node", 250)}}),
        *finish("r1", 2), *finish("r2", 2),
    ],
    # a migration's claim is never paired with a node where the request's earlier leg failed, even
    # while that node still counts as live and its slot is free again
    "claim_excludes_nodes_where_the_request_failed": [
        (0, "hb", {"node": "a"}, {}),
        (0, "hb", {"node": "b"}, {}),
        (1, "claim", {"rid": "r1", "exclude": ["a"]}, {"reply": {"r1": (G, "b", 0, 1)}}),
        (1, "claim", {"rid": "r2", "exclude": ["a", "b"]},
         {"reply": {"r2": ("rejected", "no_compatible_node", 250)}}),
        *finish("r1", 2),
    ],
    "lease_timeout_keeps_slot_fenced_for_grace": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "claim", {"rid": "r2", "wait": 5000}, {"queue": ["r2"]}),
        (999, "tick", {}, {"state": {"r1": "claimed"}}),
        (1000, "tick", {}, {"events": [("r1", "failed")], "state": {"r1": "failed"}, "held": [("n1", 0)]}),
        (1001, "released", {"rid": "r1", "outcome": "failed"}, {"held": [("n1", 0)], "queue": ["r2"]}),
        (1499, "tick", {}, {"held": [("n1", 0)], "reply": {"r2": None}}),
        (1500, "tick", {}, {"reply": {"r2": (G, "n1", 0, 2)}, "events": [("r2", "claimed")]}),
        *finish("r2", 1600),
    ],
    "late_kv_ready_ends_fence_early_and_counts_stale": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1000, "tick", {}, {"state": {"r1": "failed"}}),
        (1100, "kv_ready", {"rid": "r1"}, {"stale": 1, "events": [], "state": {"r1": "failed"}}),
        (1101, "released", {"rid": "r1", "outcome": "failed"}, {"held": []}),
    ],
    "ended_lease_waits_for_release_grace": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (10, "kv_ready", {"rid": "r1"}, {}),
        (20, "cancel", {"rid": "r1"}, {"events": [("r1", "cancelled")], "held": [("n1", 0)]}),
        (319, "tick", {}, {"held": [("n1", 0)]}),
        (320, "tick", {}, {"held": []}),
    ],
    "start_timeout_fails": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (10, "kv_ready", {"rid": "r1"}, {}),
        (2010, "tick", {}, {"events": [("r1", "failed")]}),
        (2011, "released", {"rid": "r1", "outcome": "failed"}, {"held": []}),
    ],
    "stale_generation_ignored_and_counted": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "kv_ready", {"rid": "r1", "gen": 7}, {"stale": 1, "state": {"r1": "claimed"}, "events": []}),
        (2, "started", {"rid": "r1", "lease_id": "nope"}, {"stale": 2, "state": {"r1": "claimed"}}),
        (3, "released", {"rid": "r1", "gen": 0}, {"stale": 3, "held": [("n1", 0)]}),
        *finish("r1", 4),
        (5, "released", {"rid": "r1"}, {"stale": 4}),  # a duplicate for a deleted lease: unknown, stale
    ],
    "kv_failed_fails_lease": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (5, "kv_failed", {"rid": "r1"}, {"events": [("r1", "failed")], "held": [("n1", 0)]}),
        (6, "released", {"rid": "r1", "outcome": "failed"}, {"held": []}),
    ],
    "node_death_fails_leases_after_three_missed_beats": [
        (0, "hb", {"free": (0, 1), "interval": 100}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (5, "kv_ready", {"rid": "r2"}, {}),
        (6, "started", {"rid": "r2"}, {}),
        (300, "tick", {}, {"events": [], "held": [("n1", 0), ("n1", 1)]}),
        # r2's writer is done: its slot is forgotten; r1's writer may be live: slot 0 stays fenced
        (301, "tick", {}, {"events": [("r1", "failed"), ("r2", "failed")], "held": [("n1", 0)], "free": 0}),
        (302, "claim", {"rid": "r3"}, {"reply": {"r3": ("rejected", "no_compatible_node", 250)}}),
        (1000, "hb", {"free": (0, 1), "seq": 2}, {"free": 1}),  # it was only paused
        (1001, "claim", {"rid": "r4"}, {"reply": {"r4": (G, "n1", 1, 3)}}),
        (1499, "tick", {}, {"held": [("n1", 0), ("n1", 1)]}),
        (1500, "tick", {}, {"held": [("n1", 1)], "free": 1}),
        *finish("r4", 1501),
    ],
    # Liveness counts only time the coordinator listened (interval 100, 3 misses: 300 ms of
    # silence; ticks more than 100 ms apart mean the coordinator itself was not listening).
    "stalled_coordinator_does_not_take_a_silent_node_for_dead": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        *decoding("r1", 0),
        (50, "tick", {}, {"stall": 0}),
        # blocked 1000 ms (a state write waited on NATS): 900 ms of it were not listening
        (1050, "tick", {}, {"stall": 900, "events": [], "state": {"r1": "decoding"}, "nodes": ["n1"]}),
        (1100, "tick", {}, {"stall": 0, "events": []}),
        # 300 ms of listening since its last beat: 50 before the stall, 100 of the gap, 150 after
        (1150, "tick", {}, {"events": []}),
        (1201, "tick", {}, {"events": [("r1", "failed")], "nodes": []}),
    ],
    "node_heard_during_a_stall_keeps_its_own_deadline": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        *decoding("r1", 0),
        (50, "tick", {}, {}),
        (800, "heard", {}, {}),  # its beat arrived while the coordinator's handling was blocked
        (1050, "tick", {}, {"stall": 900, "events": [], "nodes": ["n1"]}),
        (1100, "tick", {}, {"events": []}),
        (1101, "tick", {}, {"events": [("r1", "failed")], "nodes": []}),  # silent 300 ms since 800
    ],
    "node_that_dies_during_a_stall_is_found_dead_when_the_stall_ends": [
        (0, "hb", {"node": "a", "free": (0,), "interval": 100}, {}),
        (0, "hb", {"node": "b", "free": (0,), "interval": 100}, {}),
        *decoding("r1", 0),  # on a
        *decoding("r2", 0),  # on b
        (50, "tick", {}, {}),
        (60, "heard", {"node": "a"}, {}),  # a's last beat, inside the stall; then it dies
        (900, "heard", {"node": "b"}, {}),
        (1050, "tick", {}, {"stall": 900, "nodes": ["b"], "events": [("r1", "failed")]}),
        (1060, "released", {"rid": "r2"}, {"state": {"r2": None}}),
    ],
    "gaps_up_to_max_tick_gap_count_as_listening": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        *decoding("r1", 0),
        (100, "tick", {}, {"stall": 0}),
        (200, "tick", {}, {"stall": 0}),
        (300, "tick", {}, {"stall": 0, "events": []}),
        (301, "tick", {}, {"events": [("r1", "failed")]}),
    ],
    "a_stall_after_restore_counts_from_the_first_tick": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        *decoding("r1", 0),
        (10, "restart", {}, {}),  # the node counts as seen at restore; no tick yet: no mark
        (20, "hb", {"free": (), "interval": 100}, {}),
        (200, "tick", {}, {"stall": 0, "events": []}),  # the first tick only sets the mark
        (1200, "tick", {}, {"stall": 900, "events": []}),
        (1220, "tick", {}, {"stall": 0, "events": []}),
        (1221, "tick", {}, {"events": [("r1", "failed")]}),  # listened 180 + 100 of the gap + 21
    ],
    "reconnect_grants_nodes_fresh_heartbeat_grace": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (5, "kv_ready", {"rid": "r1"}, {}),
        (250, "reconnected", {}, {}),  # the coordinator itself was cut off from 0 to 250
        (550, "tick", {}, {"events": [], "state": {"r1": "kv_ready"}}),
        (551, "tick", {}, {"events": [("r1", "failed")]}),
    ],
    "node_restart_fails_leases": [
        (0, "hb", {"free": (0, 1), "seq": 5}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (1, "kv_ready", {"rid": "r2"}, {}),
        (10, "hb", {"free": (0, 1), "seq": 0}, {"events": [("r1", "failed"), ("r2", "failed")],
                                                "held": [("n1", 0)], "free": 1}),
    ],
    "draining_node_gets_no_new_lease": [
        (0, "hb", {"free": (0, 1)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "drain", {"node": "n1"}, {"free": 0}),
        (2, "claim", {"rid": "r2"}, {"reply": {"r2": ("rejected", "no_compatible_node", 250)}}),
        *finish("r1", 3),
        (1000, "tick", {}, {}),  # the drained node stops beating and is forgotten, no event
    ],
    "cancel_queued": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (1, "cancel", {"rid": "r2"}, {"events": [("r2", "cancelled")], "queue": [],
                                      "reply": {"r2": ("rejected", "cancelled", 0)}}),
        *finish("r1", 2),
    ],
    "cancel_claimed_fences_until_writer_done": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "cancel", {"rid": "r1"}, {"events": [("r1", "cancelled")], "held": [("n1", 0)]}),
        (2, "released", {"rid": "r1", "outcome": "cancelled"}, {"held": [("n1", 0)]}),
        (3, "kv_ready", {"rid": "r1"}, {"events": [], "held": [], "stale": 1}),
    ],
    # The router gave up while claiming (its client left): no prefill will ever write into the
    # slot, so once the node lets go of it the slot is free again, no fence to wait out.
    "cancel_before_prefill_frees_slot_without_fence": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2", "wait": 5000}, {"queue": ["r2"]}),
        (1, "cancel", {"rid": "r1", "before_prefill": True},
         {"events": [("r1", "cancelled")], "held": [("n1", 0)]}),
        (2, "released", {"rid": "r1", "outcome": "cancelled"},
         {"held": [("n1", 0)], "reply": {"r2": (G, "n1", 0, 2)}, "queue": []}),
        *finish("r2", 3),
    ],
    "cancel_claimed_without_writer_news_waits_out_fence": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "cancel", {"rid": "r1"}, {}),
        (2, "released", {"rid": "r1", "outcome": "cancelled"}, {}),
        (1000, "tick", {}, {"events": [], "held": [("n1", 0)]}),  # already ended: no second event
        (1499, "tick", {}, {"held": [("n1", 0)]}),
        (1500, "tick", {}, {"held": []}),
    ],
    "cancel_kv_ready": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "kv_ready", {"rid": "r1"}, {}),
        (2, "cancel", {"rid": "r1"}, {"events": [("r1", "cancelled")], "held": [("n1", 0)]}),
        (3, "released", {"rid": "r1", "outcome": "cancelled"}, {"held": []}),
    ],
    "cancel_decoding": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (1, "kv_ready", {"rid": "r1"}, {}),
        (2, "started", {"rid": "r1"}, {}),
        (3, "cancel", {"rid": "r1"}, {"events": [("r1", "cancelled")], "state": {"r1": "cancelled"}}),
        (4, "released", {"rid": "r1", "outcome": "cancelled"}, {"held": [], "events": []}),
    ],
    "cancel_after_completion_and_unknown_is_ignored": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        *finish("r1", 1),
        (2, "cancel", {"rid": "r1"}, {"events": []}),
        (2, "cancel", {"rid": "ghost"}, {"events": []}),
    ],
    "stop_rejects_waiting_claims_keeps_leases": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (1, "stop", {}, {"reply": {"r2": ("rejected", "coordinator_stopping", 250)}, "queue": [],
                         "held": [("n1", 0)], "events": [("r2", "rejected")]}),
        *finish("r1", 2),
    ],
    "restart_resumes_leases_and_queue": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2"}, {}),
        (10, "kv_ready", {"rid": "r1"}, {}),
        (20, "restart", {}, {"state": {"r1": "kv_ready"}, "queue": ["r2"], "held": [("n1", 0)], "free": 0}),
        (30, "hb", {"free": (0,)}, {"free": 0}),
        (40, "started", {"rid": "r1"}, {"state": {"r1": "decoding"}}),
        # generations never repeat: the restarted core starts past the persisted block
        (50, "released", {"rid": "r1"}, {"reply": {"r2": (G, "n1", 0, 2 + 1024)}}),
        *finish("r2", 60),
    ],
    "claims_wait_while_nodes_announce_themselves_after_start": [
        (0, "restart", {}, {}),
        (1, "claim", {"rid": "r1"}, {"events": [("r1", "queued")], "queue": ["r1"]}),
        (500, "hb", {"free": (0,)}, {"reply": {"r1": (G, "n1", 0, 1)}, "queue": []}),
        *finish("r1", 600),
        (2001, "claim", {"rid": "r2", "model": "other"},
         {"reply": {"r2": ("rejected", "no_compatible_node", 250)}}),
    ],
    # A claim for a model no node serves, arriving while a new coordinator waits for nodes to
    # announce themselves, waits out the warm-up and then gets the answer it would have got later.
    "claim_for_unserved_model_during_warmup_is_rejected_when_warmup_ends": [
        (0, "restart", {}, {}),
        (1, "claim", {"rid": "r1", "model": "other", "wait": 5000},
         {"events": [("r1", "queued")], "queue": ["r1"]}),
        (500, "hb", {"free": (0,)}, {"reply": {"r1": None}, "queue": ["r1"]}),
        (1999, "tick", {}, {"reply": {"r1": None}, "queue": ["r1"]}),
        (2000, "tick", {}, {"reply": {"r1": ("rejected", "no_compatible_node", 250)}, "queue": [],
                            "events": [("r1", "rejected")]}),
    ],
    "claim_during_warmup_whose_deadline_comes_first_says_no_compatible_node": [
        (0, "restart", {}, {}),
        (1, "claim", {"rid": "r1", "wait": 300}, {"queue": ["r1"]}),
        (300, "tick", {}, {"reply": {"r1": None}}),
        (301, "tick", {}, {"reply": {"r1": ("rejected", "no_compatible_node", 250)}, "queue": []}),
    ],
    "claim_during_warmup_for_a_busy_node_times_out_as_deadline": [
        (0, "restart", {}, {}),
        (1, "hb", {"free": ()}, {}),
        (2, "claim", {"rid": "r1", "wait": 300}, {"queue": ["r1"]}),
        (302, "tick", {}, {"reply": {"r1": ("rejected", "deadline", 250)}, "queue": []}),
    ],
    "waiting_claim_whose_last_node_dies_is_rejected_at_once": [
        (0, "hb", {"free": (0,), "interval": 100}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (0, "claim", {"rid": "r2", "wait": 5000}, {"queue": ["r2"]}),
        (301, "tick", {}, {"events": [("r1", "failed"), ("r2", "rejected")], "queue": [],
                           "reply": {"r2": ("rejected", "no_compatible_node", 250)}}),
    ],
    "tp_prefill_writer_is_done_when_every_rank_announced": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (2, "kv_ready", {"rid": "r1", "source": (1, 2)}, {"events": [], "state": {"r1": "claimed"}}),
        (3, "kv_ready", {"rid": "r1", "source": (1, 2)}, {"events": [], "state": {"r1": "claimed"}}),
        (4, "kv_ready", {"rid": "r1", "source": (0, 2)}, {"events": [("r1", "kv_ready")], "state": {"r1": "kv_ready"}}),
        *finish("r1", 5)[1:],
    ],
    "tp_prefill_rank_failing_ends_the_lease_though_another_announced": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        (2, "kv_ready", {"rid": "r1", "source": (0, 2)}, {"events": [], "state": {"r1": "claimed"}}),
        (3, "kv_failed", {"rid": "r1"}, {"events": [("r1", "failed")], "state": {"r1": "failed"}}),
        (4, "released", {"rid": "r1", "outcome": "failed"}, {"state": {"r1": None}}),
    ],
    "restart_fails_leases_of_node_that_never_returns": [
        (0, "hb", {"free": (0,)}, {}),
        (0, "claim", {"rid": "r1"}, {}),
        *finish("r1", 5)[:2],
        (10, "restart", {}, {"state": {"r1": "decoding"}}),
        (3010, "tick", {}, {"events": [], "held": [("n1", 0)]}),
        (3011, "tick", {}, {"events": [("r1", "failed")], "held": []}),
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_core(name):
    h = Harness()
    for t, op, args, expect in CASES[name]:
        step_events = h.run(t, op, dict(args))
        h.check(expect, step_events)
    h.run(10**7, "tick", {})
    h.assert_no_leak()


def test_grant_on_a_tensor_parallel_node_names_every_rank_buffer():
    from shared.events import RankEndpoints

    h = Harness()
    rank1 = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8), "float32", 256, 2, 1)
    info = hb(free=(0, 1), layout=layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8),
                                              "float32", 256, 2, 0))
    info.ranks = [RankEndpoints(tp_rank=1, endpoints={"mooncake": "n1-r1:mooncake"}, layout=rank1,
                                slots=[SlotTarget(slot=s, base_addr=0x9000 + s, nbytes=rank1.slot_nbytes)
                                       for s in range(2)])]
    h.core.on_heartbeat(info, 0)
    h.run(1, "claim", {"rid": "r1"})
    h.run(2, "claim", {"rid": "r2"})
    for rid in ("r1", "r2"):
        target = h.replies[rid].target
        ranks = target.rank_targets()
        assert [(r.tp_rank, r.endpoint, r.layout.kv_head_start) for r in ranks] == [
            (0, "n1:mooncake", 0), (1, "n1-r1:mooncake", 1)]
        assert ranks[1].slot.base_addr == 0x9000 + target.slot.slot  # the same slot on each rank


def test_config_validation_names_the_setting():
    with pytest.raises(ValueError, match="transfer_timeout_ms"):
        CoordinatorConfig(transfer_timeout_ms=0).validate()


def test_terminal_event_of_a_lease_goes_to_its_node():
    h = Harness()
    h.run(0, "hb", {"free": (0,)})
    h.run(1, "claim", {"rid": "r1"})
    effects = h.core.on_cancel(CancelRequest(request_id="r1", reason="client"), 2)
    ended = [e for e in effects if isinstance(e, Publish) and e.subject == "xl.decode.n1.ended"]
    assert [(e.event.request_id, e.event.state, e.event.slot, e.event.reason) for e in ended] == [
        ("r1", "cancelled", 0, "client")]
