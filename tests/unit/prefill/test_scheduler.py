"""The scheduler side's bookkeeping: claims, chunked prefill, preemption, slot reservation."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.prefill.scheduler import ExpressScheduler
from shared import subjects
from shared.events import KvLayoutSpec, PrefillToken, SamplingParams, SlotTarget, StructuredOutput, TransferTarget
from shared.handoff import Handoff, HandoffStatus, parse_request, parse_status, request_params


class FakeSlots:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self.counts: dict[str, int] = {}

    def reserve(self):
        return self.free.pop(0) if self.free else None

    def count(self, counter, n=1):
        self.counts[counter] = self.counts.get(counter, 0) + n


LAYOUT = KvLayoutSpec(layout_version=1, kind="gqa", dtype="float32", num_layers=1, max_tokens=8,
                      slot_nbytes=64, segments=[])
TARGET = TransferTarget(node_id="n1", transport="mooncake", endpoint="127.0.0.1:1",
                        slot=SlotTarget(slot=0, base_addr=4096, nbytes=64), layout=LAYOUT)


def params(rid="r") -> dict:
    return request_params(Handoff(request_id=rid, lease_id="l", generation=1, target=TARGET, traceparent="tp"))


def test_unmarked_requests_leave_no_state():
    sched = ExpressScheduler(FakeSlots(2), max_tokens=100)
    for p in (None, {}, {"do_remote_decode": True}):
        sched.on_alloc("x", p, 10)
    assert sched.on_step([("x", ([1],), 0)], [], {"x": 10}) == []
    assert sched.on_finished("x") is None
    assert sched.num_claims == 0 and sched.slots.counts == {}


# steps: list of (new or cached, block ids, num_computed, num_scheduled, resumed)
CHUNK_CASES = [
    ("one step", 10, [("new", [[1, 2]], 0, 10, False)], 0, [1, 2]),
    ("chunked", 10, [("new", [[1]], 0, 4, False), ("cached", [[2]], 4, 4, False),
                     ("cached", None, 8, 2, False)], 2, [1, 2]),
    ("prefix hit", 10, [("new", [[7, 8]], 8, 2, False)], 0, [7, 8]),
    ("preempted and resumed", 10, [("new", [[1]], 0, 4, False), ("cached", [[5, 6]], 0, 10, True)],
     1, [5, 6]),
]


@pytest.mark.parametrize("name,num_prompt,steps,save_step,blocks", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_save_emitted_once_when_prompt_fully_computed(name, num_prompt, steps, save_step, blocks):
    sched = ExpressScheduler(FakeSlots(2), max_tokens=100)
    sched.on_alloc("r", params(), num_prompt)
    for i, (kind, ids, computed, scheduled, resumed) in enumerate(steps):
        ids = tuple(ids) if ids is not None else None
        if kind == "new":
            saves = sched.on_step([("r", ids, computed)], [], {"r": scheduled})
        else:
            saves = sched.on_step([], [("r", ids, computed, resumed)], {"r": scheduled})
        if i == save_step:
            assert len(saves) == 1
            s = saves[0]
            assert (s.block_ids, s.num_tokens, s.staging_slot, s.fail_reason) == ([blocks], num_prompt, 0, "")
        else:
            assert saves == []
    assert sched.on_step([], [("r", None, num_prompt, False)], {"r": 1}) == []  # decode steps: nothing
    status = parse_status(sched.on_finished("r"))
    assert status == HandoffStatus(request_id="r", handed_off=True, num_tokens=num_prompt, staging_slot=0)


FAIL_CASES = [
    # slots, max_tokens, prompt, reason
    (0, 100, 10, "no free staging slot"),
    (2, 8, 10, "exceeds the staging slot size"),
]


@pytest.mark.parametrize("num_slots,max_tokens,num_prompt,reason", FAIL_CASES)
def test_not_handed_off_is_reported_never_blocked(num_slots, max_tokens, num_prompt, reason):
    slots = FakeSlots(num_slots)
    sched = ExpressScheduler(slots, max_tokens=max_tokens)
    sched.on_alloc("r", params(), num_prompt)
    (save,) = sched.on_step([("r", ([1],), 0)], [], {"r": num_prompt})
    assert save.staging_slot == -1 and reason in save.fail_reason
    status = parse_status(sched.on_finished("r"))
    assert status.handed_off is False and reason in status.reason
    assert slots.counts == {"claimed": 1, "not_handed_off": 1}


def test_two_requests_get_two_slots():
    sched = ExpressScheduler(FakeSlots(2), max_tokens=100)
    sched.on_alloc("a", params("a"), 5)
    sched.on_alloc("b", params("b"), 5)
    saves = sched.on_step([("a", ([1],), 0), ("b", ([2],), 0)], [], {"a": 5, "b": 5})
    assert sorted(s.staging_slot for s in saves) == [0, 1]


def test_finished_before_prompt_computed_reports_failure_next_step():
    sched = ExpressScheduler(FakeSlots(1), max_tokens=100)
    sched.on_alloc("r", params(), 50)
    sched.on_step([("r", ([1],), 0)], [], {"r": 16})
    status = parse_status(sched.on_finished("r"))
    assert status.handed_off is False and "before its prompt" in status.reason
    (failure,) = sched.on_step([], [], {})
    assert failure.fail_reason and failure.handoff.request_id == "r"
    assert sched.slots.free == [0]


def test_invalid_params_are_reported_not_raised():
    sched = ExpressScheduler(FakeSlots(1), max_tokens=100)
    sched.on_alloc("r", {"expresslane": {"request_id": "r"}}, 5)  # malformed on purpose
    assert sched.on_step([("r", ([1],), 0)], [], {"r": 5}) == []  # nothing to stage, nowhere to send
    status = parse_status(sched.on_finished("r"))
    assert status.handed_off is False and "invalid expresslane" in status.reason


def test_params_round_trip_through_json():
    p = params()
    again = msgspec.json.decode(msgspec.json.encode(p))
    assert again == p


# ---------------------------------------------------------------- the prefill starts the decode

START = SamplingParams(max_tokens=7, temperature=0.7, seed=3, min_tokens=2)
PROMPT = [5, 6, 7, 8]

# name, handoff start, slots, vLLM's finish reason, output ids, published (kinds), DecodeStart's prompt ids
FIRST_TOKEN_CASES = [
    ("no start asked: nothing", None, 1, "length", [9], [], None),
    ("length, KV staged: token, then start", START, 1, "length", [9], ["PrefillToken", "DecodeStart"], None),
    ("stop on the first token: token only", START, 1, "stop", [9], ["PrefillToken"], None),
    ("KV not staged: token only (KV-failed follows)", START, 0, "length", [9], ["PrefillToken"], None),
    ("aborted: nothing", START, 1, "abort", [9], [], None),
    ("no token (aborted early): nothing", START, 1, "length", [], [], None),
    ("nothing left for the node: token only", msgspec.structs.replace(START, max_tokens=0), 1, "length", [9],
     ["PrefillToken"], None),
    ("repetition penalty: the start carries the prompt", msgspec.structs.replace(START, repetition_penalty=1.2),
     1, "length", [9], ["PrefillToken", "DecodeStart"], PROMPT),
]


@pytest.mark.parametrize("name,start,num_slots,finish,output,kinds,start_prompt", FIRST_TOKEN_CASES,
                         ids=[c[0] for c in FIRST_TOKEN_CASES])
def test_first_token_publishes_token_then_start(name, start, num_slots, finish, output, kinds, start_prompt):
    slots = FakeSlots(num_slots)
    sched = ExpressScheduler(slots, max_tokens=100)
    handoff = Handoff(request_id="leg", lease_id="L", generation=2, target=TARGET, traceparent="tp", start=start)
    sched.on_alloc("vllm-id", request_params(handoff), len(PROMPT))
    sched.on_step([("vllm-id", ([1],), 0)], [], {"vllm-id": len(PROMPT)})
    out = sched.on_first_token("vllm-id", output, finish, PROMPT)
    assert [type(e).__name__ for _, e, _ in out] == kinds
    assert all(tp == "tp" for _, _, tp in out)
    if kinds:
        subject, token, _ = out[0]
        assert subject == subjects.req_tokens("leg")
        assert token == PrefillToken(request_id="leg", token_id=9, finish_reason=finish, prompt_token_ids=PROMPT)
    if "DecodeStart" in kinds:
        subject, ds, _ = out[1]
        assert subject == subjects.decode_start("n1")
        assert (ds.request_id, ds.lease_id, ds.generation, ds.slot, ds.first_token_id, ds.num_prompt_tokens,
                ds.migration, ds.num_tokens_already_sent) == ("leg", "L", 2, 0, 9, len(PROMPT), 0, 0)
        assert ds.sampling == msgspec.structs.replace(start, prompt_token_ids=start_prompt)
        assert slots.counts.get("decode_started") == 1
    else:
        assert "decode_started" not in slots.counts
    # the request's status for vLLM's response is unchanged by it
    assert parse_status(sched.on_finished("vllm-id")).handed_off is (num_slots > 0)


GRAMMAR = StructuredOutput(kind="regex", regex="a")
# the start's grammar, and the DecodeStart's: a reasoning gate's verdict on PROMPT ([5, 6, 7, 8]) filled in where unknown
GATE_CASES = [
    ("no gate: unchanged", GRAMMAR, GRAMMAR),
    ("end token last: ended", msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=6, reasoning_end_token_id=8),
     msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=6, reasoning_end_token_id=8, reasoning_ended=True)),
    ("start token last: reasoning", msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=8,
                                                             reasoning_end_token_id=6),
     msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=8, reasoning_end_token_id=6, reasoning_ended=False)),
    ("decided by an earlier leg: kept", msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=6,
                                                                 reasoning_end_token_id=8, reasoning_ended=False),
     msgspec.structs.replace(GRAMMAR, reasoning_start_token_id=6, reasoning_end_token_id=8, reasoning_ended=False)),
]


@pytest.mark.parametrize("name,structured,want", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_the_start_decides_a_reasoning_gate_from_the_prompt(name, structured, want):
    sched = ExpressScheduler(FakeSlots(1), max_tokens=100)
    start = msgspec.structs.replace(START, structured=structured)
    handoff = Handoff(request_id="leg", lease_id="L", generation=2, target=TARGET, traceparent="tp", start=start)
    sched.on_alloc("vllm-id", request_params(handoff), len(PROMPT))
    sched.on_step([("vllm-id", ([1],), 0)], [], {"vllm-id": len(PROMPT)})
    _, ds, _ = sched.on_first_token("vllm-id", [9], "length", PROMPT)[1]
    assert ds.sampling == msgspec.structs.replace(start, structured=want)


def test_start_survives_vllms_json_round_trip():
    """kv_transfer_params travel as JSON through vLLM: logit_bias keys come back as strings."""
    start = msgspec.structs.replace(START, logit_bias={11: -2.5}, bad_words_token_ids=[[1, 2]])
    p = request_params(Handoff(request_id="r", lease_id="l", generation=1, target=TARGET, start=start))
    again = json.loads(json.dumps(p))
    assert parse_request(again).start == start
