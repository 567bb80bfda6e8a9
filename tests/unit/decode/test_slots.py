"""Table-driven tests of the decode node's slot lifecycle (services/decode/slots.py).

Each case is a list of steps ``(op, args, expect)``; the harness feeds the op to the core (a fake
engine performs the engine work it hands out) and checks the step's effects, shown compactly, and
the node's free slots, engine slots and stale counter. Every case ends with no lease left: the
harness cancels whatever is open, runs the engine work, and checks that every slot is free, the
engine holds nothing, and every lease that arrived was forgotten exactly once.
"""

from __future__ import annotations

import pytest

from services.decode.effects import (
    Finished, Forget, Heartbeat, Publish, ReleaseEngine, StartEngine, StopEngine,
)
from services.decode.slots import SlotCore
from shared import subjects
from shared.events import (
    CancelRequest, DecodeStart, DecodeStarted, HandoffEvent, KvFailed, KvReady, RequestFailed,
    RequestFinished, SamplingParams, SlotReleased, SpecStats, TokenLogprobs, TokensGenerated,
)

NODE = "n1"


def start(gen, slot=0, rid=None, lease=None, max_tokens=3, prompt=4, already=0):
    return DecodeStart(request_id=rid or f"r{gen}", lease_id=lease or f"L{gen}", generation=gen,
                       slot=slot, first_token_id=1, num_prompt_tokens=prompt,
                       num_tokens_already_sent=already, sampling=SamplingParams(max_tokens=max_tokens))


def kv(gen, slot=0, rid=None, lease=None, tokens=4, layout=1, node=NODE, source=(0, 1)):
    return KvReady(request_id=rid or f"r{gen}", lease_id=lease or f"L{gen}", generation=gen,
                   node_id=node, slot=slot, num_tokens=tokens, layout_version=layout, nbytes=1,
                   source_rank=source[0], source_ranks=source[1])


def kv_failed(gen, slot=0):
    return KvFailed(request_id=f"r{gen}", lease_id=f"L{gen}", generation=gen, node_id=NODE,
                    slot=slot, reason="boom")


def ended(gen, state, slot=0, node=NODE, reason="why"):
    return HandoffEvent(request_id=f"r{gen}", state=state, at_ms=0, lease_id=f"L{gen}",
                        generation=gen, node_id=node, slot=slot, reason=reason)


def show(e):
    """An effect in a few words (Finished and Forget are checked by the leak check)."""
    if isinstance(e, Heartbeat):  # a beat a release made carries it, as the report that follows
        return "hb" if e.released is None else ("hb", e.released.lease_id, e.released.outcome, e.released.reason)
    if isinstance(e, ReleaseEngine):
        return ("release_engine", e.slot)
    ev = e.event
    if isinstance(ev, DecodeStarted):
        assert e.subject == subjects.COORD_REPORT
        return ("decode_started", ev.lease_id)
    if isinstance(ev, SlotReleased):
        assert e.subject == subjects.COORD_REPORT and ev.node_id == NODE
        return ("released", ev.lease_id, ev.outcome, ev.reason)
    assert e.subject == subjects.req_tokens(ev.request_id)
    if isinstance(ev, TokensGenerated):
        if ev.logprobs:
            assert len(ev.logprobs) == len(ev.token_ids)
            return ("tokens", ev.index, ev.token_ids, [(lp.logprob, lp.rank, lp.top_ids) for lp in ev.logprobs])
        return ("tokens", ev.index, ev.token_ids)
    if isinstance(ev, RequestFinished):
        return ("finished", ev.finish_reason, ev.usage.completion_tokens, ev.spec.num_steps)
    assert isinstance(ev, RequestFailed)
    return ("failed", ev.reason) if ev.retryable else ("failed_for_good", ev.reason)


class Harness:
    def __init__(self, num_slots=2):
        self.core = SlotCore(node_id=NODE, num_slots=num_slots, layout_version=1)
        self.engine: dict[int, str] = {}  # slot -> lease id the fake engine holds
        self.held: set[str] = set()  # every lease id the core held at some point
        self.starting: list[tuple[int, str]] = []  # handed to the engine, not yet reported
        self.forgotten: list[str] = []
        self.finished: list[Finished] = []
        self.now_s = 0.0

    def run(self, op, arg):
        c = self.core
        self.now_s += 1.0
        if op in ("started", "start_failed", "start_refused") and arg in self.starting:
            self.starting.remove(arg)
        if op in ("start", "kv", "kv_failed", "kv_rejected", "cancel", "ended", "stop_all"):
            effects = {"start": c.on_start, "kv": c.on_kv_ready, "kv_failed": c.on_kv_failed,
                       "kv_rejected": lambda msg: c.on_kv_rejected(msg, "checksum"),
                       "cancel": lambda rid: c.on_cancel(CancelRequest(request_id=rid, reason="client")),
                       "ended": c.on_lease_ended,
                       "stop_all": lambda why: c.stop_all("failed", why)}[op](arg)
            assert not any(isinstance(e, ReleaseEngine) for e in effects)  # never mid-step
        elif op == "take":
            return self.take()
        elif op == "started":
            effects = c.on_engine_started(arg[0], arg[1], self.now_s)
        elif op == "start_failed":
            effects = c.on_engine_failed(arg[0], arg[1], "start_failed: bad", self.now_s)
        elif op == "start_refused":  # an engine error no node gets past (a grammar that does not compile)
            effects = c.on_engine_failed(arg[0], arg[1], "invalid_grammar: bad", self.now_s, retryable=False)
        elif op == "stopped":
            effects = c.on_engine_stopped(arg[0], arg[1], SpecStats(num_steps=7), self.now_s)
        elif op == "output":  # (slot, token ids, finish reason[, logprobs])
            spec = SpecStats(num_steps=5) if arg[2] else None
            effects = c.on_output(arg[0], arg[1], arg[2], spec, self.now_s, *arg[3:])
        elif op == "emit_failed":
            effects = c.on_emit_failed(*arg)
        else:
            raise AssertionError(op)
        return self.perform(effects)

    def note_held(self):
        self.held |= {l.lease_id for s in self.core.slots for l in (s.current, s.waiting) if l}

    def take(self):
        shown = []
        for work in self.core.take_engine_work():
            if isinstance(work, StartEngine):
                assert work.slot not in self.engine, "started a slot the engine holds"
                self.engine[work.slot] = work.lease_id
                self.starting.append((work.slot, work.lease_id))
                shown.append(("start", work.slot, work.lease_id))
            else:
                assert isinstance(work, StopEngine) and self.engine.get(work.slot) == work.lease_id
                shown.append(("stop", work.slot, work.lease_id))
        assert not self.core.has_engine_work  # each piece of work is handed out once
        return shown

    def perform(self, effects):
        self.note_held()
        shown = []
        for e in effects:
            if isinstance(e, Forget):
                self.forgotten.append(e.lease_id)
            elif isinstance(e, Finished):
                self.finished.append(e)
            else:
                if isinstance(e, ReleaseEngine):
                    assert e.slot in self.engine
                    del self.engine[e.slot]
                shown.append(show(e))
        return shown

    def check(self, expect, shown):
        c = self.core
        for key, want in expect.items():
            if key == "effects" or key == "work":
                assert shown == want
            elif key == "free":
                assert c.free_slots() == want
            elif key == "engine":
                assert c.engine_slots() == want
            elif key == "stale":
                assert c.num_stale == want
            elif key == "counter":
                assert all(c.counters[k] == v for k, v in want.items()), c.counters
            else:
                raise AssertionError(key)

    def end_everything(self):
        """Cancel whatever is open and let the engine stop it: nothing may be left behind."""
        for lease in [l for s in self.core.slots for l in (s.current, s.waiting) if l is not None]:
            self.run("cancel", lease.request_id)
        for slot, lease_id in self.starting:  # the engine finishes what it was handed
            self.perform(self.core.on_engine_started(slot, lease_id, self.now_s))
        for _ in range(3):
            for work in self.core.take_engine_work():
                if isinstance(work, StartEngine):
                    self.engine[work.slot] = work.lease_id
                    self.perform(self.core.on_engine_started(work.slot, work.lease_id, self.now_s))
                else:
                    self.perform(self.core.on_engine_stopped(work.slot, work.lease_id, SpecStats(), 0))
        assert self.core.is_idle and self.core.free_slots() == list(range(self.core.num_slots))
        assert self.core.engine_slots() == [] and self.engine == {}
        assert sorted(self.forgotten) == sorted(self.held)  # each lease once, none kept


def decoding(gen=1, slot=0, **kw):
    """Steps that bring lease ``gen`` to decoding on ``slot``."""
    return [("start", start(gen, slot=slot, **kw), {}), ("kv", kv(gen, slot=slot), {}),
            ("take", None, {"work": [("start", slot, f"L{gen}")]}),
            ("started", (slot, f"L{gen}"), {"effects": [("decode_started", f"L{gen}")]})]


def released(gen, outcome="completed", reason=""):
    return [("hb", f"L{gen}", outcome, reason), ("released", f"L{gen}", outcome, reason)]


CASES = {
    # ---- pairing the two halves
    "start_then_kv_decodes_to_the_end": [
        ("start", start(1), {"effects": ["hb"], "free": [1]}),
        ("kv", kv(1), {"effects": [], "engine": []}),
        ("take", None, {"work": [("start", 0, "L1")], "engine": [0]}),
        ("started", (0, "L1"), {"effects": [("decode_started", "L1")]}),
        ("output", (0, [7, 8], None), {"effects": [("tokens", 1, [7, 8])]}),
        ("output", (0, [9], "length"), {"effects": [
            ("tokens", 3, [9]), ("finished", "length", 4, 5), ("release_engine", 0), *released(1)],
            "free": [0, 1], "engine": [], "counter": {"tokens_generated": 3, "finished.length": 1}}),
    ],
    "tp_prefill_kv_is_ready_when_every_rank_announced": [
        ("kv", kv(1, source=(1, 2)), {"effects": ["hb"], "free": [1]}),
        ("start", start(1), {"effects": [], "engine": []}),
        ("kv", kv(1, source=(1, 2)), {"effects": [], "engine": [], "stale": 1}),  # a duplicate
        ("kv", kv(1, source=(0, 2)), {"effects": [], "engine": []}),
        ("take", None, {"work": [("start", 0, "L1")], "engine": [0]}),
    ],
    "tp_prefill_rank_failure_ends_a_half_announced_lease": [
        ("start", start(1), {"effects": ["hb"]}),
        ("kv", kv(1, source=(0, 2)), {"engine": []}),
        ("kv_failed", kv_failed(1), {"effects": [*released(1, "failed", "transfer_failed: boom")], "free": [0, 1]}),
    ],
    "logprobs_ride_with_their_tokens": [
        *decoding(1),
        ("output", (0, [7, 8], None, [TokenLogprobs(-0.5, 1, [7], [-0.5]), TokenLogprobs(-2.0, 3, [9], [-0.1])]),
         {"effects": [("tokens", 1, [7, 8], [(-0.5, 1, [7]), (-2.0, 3, [9])])]}),
        ("output", (0, [9], "stop", []), {"effects": [
            ("tokens", 3, [9]), ("finished", "stop", 4, 5), ("release_engine", 0), *released(1)]}),
    ],
    "a_grammar_that_does_not_compile_fails_for_good": [
        ("start", start(1), {}), ("kv", kv(1), {}),
        ("take", None, {"work": [("start", 0, "L1")]}),
        ("start_refused", (0, "L1"), {"effects": [
            ("failed_for_good", "invalid_grammar: bad"), ("release_engine", 0),
            *released(1, "failed", "invalid_grammar: bad")], "free": [0, 1], "engine": []}),
    ],
    "kv_before_start": [
        ("kv", kv(1), {"effects": ["hb"], "free": [1]}),
        ("take", None, {"work": []}),
        ("start", start(1), {"effects": []}),
        ("take", None, {"work": [("start", 0, "L1")]}),
    ],
    "slots_pair_independently": [
        ("kv", kv(1, slot=1), {"free": [0]}),
        ("start", start(2), {"free": []}),
        ("start", start(1, slot=1), {}),
        ("take", None, {"work": [("start", 1, "L1")]}),
    ],
    "tokens_already_sent_continue_the_index_and_skip_the_size_check": [
        ("start", start(1, already=2, prompt=9), {}), ("kv", kv(1, tokens=6), {}),
        ("take", None, {"work": [("start", 0, "L1")]}),
        ("started", (0, "L1"), {}),
        ("output", (0, [5], "stop"), {"effects": [
            ("tokens", 3, [5]), ("finished", "stop", 4, 5), ("release_engine", 0), *released(1)]}),
    ],
    # ---- stale and duplicate halves
    "older_generation_is_stale": [
        ("start", start(5), {}), ("kv", kv(4), {"stale": 1, "effects": []}),
        ("kv", kv(5), {"stale": 1}), ("take", None, {"work": [("start", 0, "L5")]}),
    ],
    "newer_generation_supersedes_waiting_halves": [
        ("start", start(1), {}),
        ("kv", kv(2), {"effects": [], "stale": 0}),
        ("start", start(2), {}), ("kv", kv(1), {"stale": 1}),
        ("take", None, {"work": [("start", 0, "L2")]}),
    ],
    "duplicate_halves_are_stale": [
        ("start", start(1), {}), ("start", start(1), {"stale": 1, "effects": []}),
        ("kv", kv(1), {}), ("kv", kv(1), {"stale": 2}),
        *decoding(1)[2:],
        ("start", start(1), {"stale": 3, "effects": []}),
        ("output", (0, [], "stop"), {}),
        ("kv", kv(1), {"stale": 4, "effects": []}), ("start", start(1), {"stale": 5}),
    ],
    "bad_slot_is_stale": [("kv", kv(1, slot=9), {"stale": 1, "free": [0, 1]})],
    "kv_for_another_node_is_ignored": [("kv", kv(1, node="n2"), {"effects": [], "free": [0, 1]})],
    # ---- leases that cannot start
    "kv_size_disagreeing_with_prompt_fails_without_the_engine": [
        ("start", start(1, prompt=8), {}),
        ("kv", kv(1, tokens=7), {"effects": [
            ("failed", "start_failed: the KV holds 7 tokens but the prompt has 8"),
            *released(1, "failed", "start_failed: the KV holds 7 tokens but the prompt has 8")],
            "free": [0, 1]}),
        ("take", None, {"work": []}),
    ],
    "engine_start_failure_fails_the_request": [
        ("start", start(1), {}), ("kv", kv(1), {}), ("take", None, {}),
        ("start_failed", (0, "L1"), {"effects": [
            ("failed", "start_failed: bad"), ("release_engine", 0),
            *released(1, "failed", "start_failed: bad")], "engine": [], "free": [0, 1]}),
    ],
    "layout_mismatch_fails_the_lease": [
        ("start", start(1), {}),
        ("kv", kv(1, layout=2), {"effects": released(1, "failed", "layout version 2"),
                                 "counter": {"kv_layout_mismatch": 1}}),
    ],
    "kv_failed_before_start_releases_and_makes_start_stale": [
        ("kv_failed", kv_failed(1), {"effects": released(1, "failed", "transfer_failed: boom")}),
        ("start", start(1), {"stale": 1, "free": [0, 1]}),
    ],
    # ---- KV integrity: the shell found the KV's checksums wrong (server.py verifies)
    "checksum_mismatch_after_start_fails_the_waiting_lease_and_frees_the_slot": [
        ("start", start(1), {"free": [1]}),
        ("kv_rejected", kv(1), {"effects": released(1, "failed", "checksum"), "free": [0, 1],
                                "counter": {"kv_rejected.checksum": 1}}),
        ("take", None, {"work": []}),
        ("kv", kv(1), {"stale": 1, "free": [0, 1]}),  # a late duplicate is never injected
    ],
    "checksum_mismatch_before_start_makes_start_stale": [
        ("kv_rejected", kv(1), {"effects": released(1, "failed", "checksum"), "free": [0, 1]}),
        ("start", start(1), {"stale": 1, "free": [0, 1]}),
        ("take", None, {"work": []}),
    ],
    "checksum_mismatch_leaves_the_decoding_lease_of_another_slot_alone": [
        ("start", start(1), {}), ("kv", kv(1), {}), ("take", None, {}), ("started", (0, "L1"), {}),
        ("start", start(2, slot=1), {}),
        ("kv_rejected", kv(2, slot=1), {"effects": released(2, "failed", "checksum"),
                                        "free": [1], "engine": [0]}),
    ],
    "checksum_mismatch_for_another_node_is_not_ours": [
        ("kv_rejected", kv(1, node="n2"), {"effects": [], "free": [0, 1]}),
    ],
    "max_tokens_zero_finishes_at_start": [
        ("start", start(1, max_tokens=0), {}), ("kv", kv(1), {}), ("take", None, {}),
        ("started", (0, "L1"), {"effects": [
            ("decode_started", "L1"), ("finished", "length", 1, 0), ("release_engine", 0),
            *released(1)]}),
    ],
    # ---- cancels
    "cancel_waiting_lease": [
        ("start", start(1), {}),
        ("cancel", "r1", {"effects": released(1, "cancelled", "client"), "free": [0, 1]}),
        ("kv", kv(1), {"stale": 1}),
    ],
    "cancel_after_kv_ready_before_the_engine_takes_it": [
        ("start", start(1), {}), ("kv", kv(1), {}),
        ("cancel", "r1", {"effects": released(1, "cancelled", "client")}),
        ("take", None, {"work": []}),
    ],
    "cancel_during_inject_stops_before_any_step": [
        ("start", start(1), {}), ("kv", kv(1), {}),
        ("take", None, {"work": [("start", 0, "L1")]}),
        ("cancel", "r1", {"effects": [], "engine": [0]}),
        ("started", (0, "L1"), {"effects": []}),  # no DecodeStarted for a lease already ended
        ("take", None, {"work": [("stop", 0, "L1")]}),
        ("stopped", (0, "L1"), {"effects": [
            ("finished", "cancelled", 1, 7), ("release_engine", 0),
            *released(1, "cancelled", "client")], "free": [0, 1]}),
    ],
    "cancel_decoding_stops_at_the_step_boundary": [
        *decoding(1),
        ("cancel", "r1", {"effects": []}),
        ("output", (0, [4], None), {"effects": [("tokens", 1, [4])]}),  # the step already running
        ("take", None, {"work": [("stop", 0, "L1")]}),
        ("output", (0, [5], None), {"effects": []}),  # nothing after the stop is handed out
        ("stopped", (0, "L1"), {"effects": [
            ("finished", "cancelled", 2, 7), ("release_engine", 0),
            *released(1, "cancelled", "client")]}),
        ("take", None, {"work": []}),
    ],
    "finish_wins_over_a_stop_not_yet_taken": [
        *decoding(1),
        ("cancel", "r1", {}),
        ("output", (0, [4], "stop"), {"effects": [
            ("tokens", 1, [4]), ("finished", "stop", 2, 5), ("release_engine", 0), *released(1)]}),
        ("take", None, {"work": []}),
    ],
    "cancel_of_unknown_request_is_ignored": [("cancel", "ghost", {"effects": []})],
    # ---- lease ends from the coordinator
    "lease_end_failed_while_decoding_is_not_told_to_the_router": [
        *decoding(1),
        ("ended", ended(1, "failed"), {"effects": []}),
        ("take", None, {"work": [("stop", 0, "L1")]}),
        ("stopped", (0, "L1"), {"effects": [("release_engine", 0), *released(1, "failed", "why")]}),
    ],
    "lease_end_cancelled_while_decoding_is_told": [
        *decoding(1),
        ("ended", ended(1, "cancelled"), {}), ("take", None, {}),
        ("stopped", (0, "L1"), {"effects": [
            ("finished", "cancelled", 1, 7), ("release_engine", 0), *released(1, "cancelled", "why")]}),
    ],
    "lease_end_while_waiting": [
        ("kv", kv(1), {}),
        ("ended", ended(1, "failed"), {"effects": released(1, "failed", "why"), "free": [0, 1]}),
        ("start", start(1), {"stale": 1}),
    ],
    "lease_end_after_finish_is_ignored": [
        *decoding(1),
        ("output", (0, [2], "stop"), {}),
        ("ended", ended(1, "completed"), {"effects": []}),
        ("ended", ended(1, "failed"), {"effects": []}),
        ("ended", ended(1, "cancelled"), {"effects": [], "free": [0, 1]}),
    ],
    "lease_end_of_unknown_lease_is_reported_released": [
        ("ended", ended(3, "failed"), {"effects": released(3, "failed", "why")}),
        ("ended", ended(3, "failed"), {"effects": []}),  # a duplicate
        ("kv", kv(3), {"stale": 1}), ("kv", kv(2), {"stale": 2}),
    ],
    "lease_end_for_another_node_or_bad_slot_is_ignored": [
        ("ended", ended(1, "failed", node="n2"), {"effects": []}),
        ("ended", ended(1, "failed", slot=9), {"effects": []}),
    ],
    # ---- several leases on one slot, the engine, the node
    "next_lease_waits_for_the_current_to_end": [
        *decoding(1),
        ("kv", kv(2), {"effects": []}), ("start", start(2), {"effects": []}),
        ("take", None, {"work": []}),
        ("output", (0, [3], "stop"), {"effects": [
            ("tokens", 1, [3]), ("finished", "stop", 2, 5), ("release_engine", 0), *released(1)],
            "free": [1]}),
        ("take", None, {"work": [("start", 0, "L2")]}),
    ],
    "stale_engine_reports_are_ignored": [
        *decoding(1),
        ("started", (0, "L1"), {"effects": [], "counter": {"engine_report_ignored": 1}}),
        ("stopped", (0, "L9"), {"effects": []}),
        ("output", (1, [3], None), {"effects": []}),
    ],
    "stop_all_fails_every_decoding_lease_for_the_router": [
        *decoding(1, slot=0), *decoding(2, slot=1),
        ("start", start(3, slot=0), {}),
        ("stop_all", "node_stopping", {"effects": []}),
        ("take", None, {"work": [("stop", 0, "L1"), ("stop", 1, "L2")]}),
        ("stopped", (0, "L1"), {"effects": [
            ("failed", "node_stopping"), ("release_engine", 0), *released(1, "failed", "node_stopping")]}),
        ("stopped", (1, "L2"), {"engine": [], "free": [1]}),
    ],
    "emit_failure_stops_that_request_only": [
        *decoding(1, slot=0), *decoding(2, slot=1),
        ("emit_failed", (0, "L1"), {}),
        ("take", None, {"work": [("stop", 0, "L1")]}),
        ("stopped", (0, "L1"), {"effects": [("release_engine", 0), *released(1, "failed", "emit_failed")],
                                "engine": [1]}),
    ],
    "request_id_no_subject_can_carry_gets_no_terminal_event": [
        ("start", start(1, rid="r.1"), {}), ("kv", kv(1, rid="r.1"), {}), ("take", None, {}),
        ("started", (0, "L1"), {}),
        ("output", (0, [], "stop"), {"effects": [("release_engine", 0), *released(1)]}),
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_slot_core(name):
    h = Harness()
    for op, arg, expect in CASES[name]:
        h.check(expect, h.run(op, arg))
    h.end_everything()


def test_a_started_lease_is_finished_once_with_its_numbers():
    h = Harness(num_slots=1)
    for op, arg, _ in decoding(1):
        h.run(op, arg)
    h.run("output", (0, [4, 5], "length"))
    assert [(f.lease_id, f.outcome, f.finish_reason, f.num_completion_tokens) for f in h.finished] == [
        ("L1", "completed", "length", 3)]
    assert h.finished[0].decode_ms == 1000.0  # started at t=4 s, finished at t=5 s
    h.end_everything()


# ---------------------------------------------------------------- which path decoded a request

@pytest.mark.parametrize("steps,reason,want", [
    (["fast", "fast"], None, ("fast", None)),
    (["reference"], "sampling: 17-token bad word", ("reference", "sampling: 17-token bad word")),
    (["fast", "reference", "fast"], None, ("mixed", None)),  # a slot joined that the fast path refused
    ([], None, ("none", None)),  # cancelled before its first step
])
def test_decode_paths(steps, reason, want):
    from services.decode.metrics import DecodePaths

    paths = DecodePaths()
    paths.start("L1", reason)
    for p in steps:
        paths.step("L1", p)
    paths.step("unknown", "fast")  # a lease that never started here: ignored
    assert paths.end("L1") == want
    assert paths.end("L1") == ("none", None) and not paths.counts and not paths.reasons


# ---------------------------------------------------------------- fault injection: stall after N tokens

@pytest.mark.parametrize("after,migration,outputs,want", [
    (0, 0, [[4, 5, 6]], False),        # off
    (3, 0, [[4]], False),              # 2 completion tokens (the prefill's first + 1)
    (3, 0, [[4], [5]], True),          # 3: the first leg stalls here
    (3, 1, [[4], [5], [6]], False),    # a migrated leg never stalls
])
def test_fault_stall_due(after, migration, outputs, want):
    h = Harness(num_slots=1)
    for op, arg, _ in decoding(1, max_tokens=10):
        if op == "start":
            arg = DecodeStart(**{**{f: getattr(arg, f) for f in arg.__struct_fields__}, "migration": migration})
        h.run(op, arg)
    for token_ids in outputs:
        h.run("output", (0, token_ids, None))
    assert h.core.fault_stall_due(after) is want
    h.end_everything()


def test_fail_all_ends_every_lease_without_the_engine():
    """A dead tensor-parallel rank: decoding, ready and half-arrived leases all end at once, the
    router told (retryable) where it knows the request, the coordinator told of every slot."""
    h = Harness(num_slots=3)
    for op, arg, _ in decoding(1):  # slot 0 decoding
        h.run(op, arg)
    h.run("start", start(2, slot=1))  # slot 1: both halves, not yet taken by the engine
    h.run("kv", kv(2, slot=1))
    h.run("kv", kv(3, slot=2, source=(0, 2)))  # slot 2: one rank's KV of two, no start yet
    effects = h.core.fail_all("node_failed: rank 1 exited", h.now_s + 1)
    assert not any(isinstance(e, (ReleaseEngine, StartEngine)) for e in effects)
    shown = [show(e) for e in effects if not isinstance(e, (Finished, Forget))]
    why = "node_failed: rank 1 exited"
    assert [s for s in shown if s[0] == "failed"] == [("failed", why), ("failed", why)]
    assert sorted(s[1] for s in shown if s[0] == "released") == ["L1", "L2", "L3"]
    assert h.core.is_idle and h.core.fail_all(why, h.now_s + 2) == []
