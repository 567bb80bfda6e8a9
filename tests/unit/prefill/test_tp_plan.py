"""Tensor parallelism on the prefill side, table by table: which decode ranks a prefill rank writes
and how (whole segments, per token, or packed into scratch first), how many prefill ranks announce
a hand-off, which layouts pair, which splits are refused, and staging slots shared by ranks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from services.prefill.parallel import split_refusal, staging_ranks, stages
from services.prefill.scheduler import ExpressScheduler
from services.prefill.sender import layout_mismatch, plan_rank_writes, source_ranks
from services.prefill.staging import (
    FREE, RESERVED, SENDING, RankSlotStates, SlotStates, StagingPool, rank_path, read_stats,
)
from shared.events import KvLayoutSpec, RankTarget, SlotTarget, TransferTarget
from shared.kvlayout import KvShape, layout_spec, staged_layout, tp_write_ops

GQA = KvShape(kind="gqa", num_layers=2, num_kv_heads=4, head_dim=2)
MLA = KvShape(kind="mla", num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2)
MAX, N = 8, 5  # slot capacity, tokens written
STAGING, SCRATCH = 1 << 20, 1 << 24  # a staging slot's and its scratch area's (fake) addresses


def target(shape: KvShape, d: int, max_tokens: int = MAX, layouts: list[KvLayoutSpec] | None = None) -> TransferTarget:
    """A node of ``d`` ranks; rank r's slot at (r + 1) << 28."""
    layouts = layouts or [layout_spec(shape, "float32", max_tokens, d, r) for r in range(d)]
    ranks = [RankTarget(tp_rank=r, endpoint=f"rank{r}", layout=layouts[r],
                        slot=SlotTarget(slot=2, base_addr=(r + 1) << 28, nbytes=layouts[r].slot_nbytes))
             for r in range(d)]
    return TransferTarget(node_id="n", transport="mooncake", endpoint=ranks[0].endpoint, slot=ranks[0].slot,
                          layout=ranks[0].layout, ranks=ranks[1:])


def plan(shape: KvShape, p: int, w: int, d: int):
    ours = layout_spec(shape, "float32", MAX, p, w)
    asked = []

    def scratch() -> int:
        asked.append(1)
        return SCRATCH

    writes, reason = plan_rank_writes(ours, STAGING, target(shape, d), N, scratch)
    assert reason == ""
    return ours, writes, bool(asked)


# kind, prefill TP, writer rank, decode TP -> per rank written: (rank, staged, ops); prefill ranks announcing
PLAN_CASES = [
    ("gqa", 1, 0, 1, [(0, False, 4)], 1),
    ("gqa", 1, 0, 2, [(0, True, 4), (1, True, 4)], 1),
    ("gqa", 1, 0, 4, [(r, True, 4) for r in range(4)], 1),
    ("gqa", 2, 0, 1, [(0, False, 4 * N)], 2),  # half of each token row: per token
    ("gqa", 2, 1, 1, [(0, False, 4 * N)], 2),
    ("gqa", 2, 0, 2, [(0, False, 4)], 2),  # the same heads: rank 1 holds none of ours
    ("gqa", 2, 1, 2, [(1, False, 4)], 2),
    ("gqa", 2, 1, 4, [(2, True, 4), (3, True, 4)], 2),
    ("gqa", 4, 3, 2, [(1, False, 4 * N)], 4),
    ("mla", 1, 0, 2, [(0, False, 2), (1, False, 2)], 1),
    ("mla", 2, 0, 2, [(0, False, 2), (1, False, 2)], 1),  # rank 0 writes the latent to every rank
    ("mla", 2, 1, 2, [], 1),  # the others write nothing
    ("mla", 2, 1, 1, [], 1),
]


@pytest.mark.parametrize("kind,p,w,d,want,announcing", PLAN_CASES)
def test_rank_plan(kind, p, w, d, want, announcing):
    shape = GQA if kind == "gqa" else MLA
    ours, writes, asked_scratch = plan(shape, p, w, d)
    assert [(x.rank.tp_rank, x.staged is not None, len(x.ops)) for x in writes] == want
    assert asked_scratch == any(staged for _, staged, _ in want)  # scratch only where packed
    assert source_ranks(ours, target(shape, d)) == announcing
    for x in writes:
        if x.staged is None:
            assert all(STAGING <= local < STAGING + ours.slot_nbytes for local, _, _ in x.ops)
        else:  # each reader's packed image in its own part of the slot-sized scratch area
            assert x.staged == staged_layout(ours, x.rank.layout)
            assert x.scratch_offset + x.staged.slot_nbytes <= ours.slot_nbytes
            assert x.ops == tp_write_ops(x.staged, SCRATCH + x.scratch_offset, x.rank.layout,
                                         x.rank.slot.base_addr, N)
    offsets = sorted((x.scratch_offset, x.scratch_offset + x.staged.slot_nbytes) for x in writes if x.staged)
    assert all(a[1] <= b[0] for a, b in zip(offsets, offsets[1:]))


def test_a_decode_node_that_does_not_describe_its_heads_is_written_whole_at_tp_1():
    """An older node's layout names no heads (kv_heads 0): one rank each side pairs as before."""
    ours = layout_spec(GQA, "float32", MAX)
    old = KvLayoutSpec(**{f: getattr(ours, f) for f in ours.__struct_fields__
                          if f not in ("kv_heads", "kv_heads_total", "kv_head_start")})
    writes, reason = plan_rank_writes(ours, STAGING, target(GQA, 1, layouts=[old]), N, lambda: SCRATCH)
    assert reason == "" and len(writes) == 1 and len(writes[0].ops) == 4
    assert "too old" in plan_rank_writes(layout_spec(GQA, "float32", MAX, 2, 0), STAGING,
                                         target(GQA, 1, layouts=[old]), N, lambda: SCRATCH)[1]


OTHER = KvShape(kind="gqa", num_layers=2, num_kv_heads=8, head_dim=2)
WIDE = KvShape(kind="gqa", num_layers=2, num_kv_heads=4, head_dim=4)
# our split (of GQA), their layout -> the reason's words ("" pairs)
MISMATCH_CASES = [
    ("the same model split otherwise", (1, 0), layout_spec(GQA, "float32", 16, 2, 1), ""),
    ("the same model split finer", (2, 1), layout_spec(GQA, "float32", 16, 4, 0), ""),
    ("another head count, as many bytes a token", (1, 0), layout_spec(OTHER, "float32", 16, 2, 0), "different model"),
    ("another head size, as many bytes a token", (1, 0), layout_spec(WIDE, "float32", 16, 2, 0), "segment sizes"),
    ("another dtype", (2, 0), layout_spec(GQA, "bfloat16", 16, 2, 0), "dtype"),
    ("a slot too small", (2, 0), layout_spec(GQA, "float32", 4, 2, 0), "does not fit"),
]


@pytest.mark.parametrize("name,split,theirs,reason", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_layouts_of_two_splits_pair_when_they_hold_one_models_heads(name, split, theirs, reason):
    got = layout_mismatch(layout_spec(GQA, "float32", 16, *split), theirs, 10)
    assert (reason in got) if reason else got == "", got


def test_a_rank_that_does_not_pair_fails_the_hand_off_and_is_named():
    layouts = [layout_spec(GQA, "float32", MAX, 2, 0), layout_spec(GQA, "bfloat16", MAX, 2, 1)]
    writes, reason = plan_rank_writes(layout_spec(GQA, "float32", MAX), STAGING, target(GQA, 2, layouts=layouts),
                                      N, lambda: SCRATCH)
    assert writes == [] and reason.startswith("decode rank 1: layout mismatch")


REFUSAL_CASES = [
    ("gqa", 8, 1, ""), ("gqa", 8, 2, ""), ("gqa", 8, 8, ""),
    ("gqa", 8, 3, "cannot split them evenly"), ("gqa", 2, 4, "replicates them"),
    ("mla", 0, 8, ""),  # the latent is whole on every rank
]


@pytest.mark.parametrize("kind,heads,tp,reason", REFUSAL_CASES)
def test_splits_vllm_cannot_shard_by_heads_are_refused(kind, heads, tp, reason):
    got = split_refusal(kind, heads, tp)
    assert (reason in got and f"divides {heads}" in got) if reason else got == ""


@pytest.mark.parametrize("kind,heads,tp", [("gqa", 8, 1), ("gqa", 8, 2), ("mla", 0, 1), ("mla", 0, 8)])
def test_pipeline_stages_are_refused_whatever_the_split(kind, heads, tp):
    assert split_refusal(kind, heads, tp, pp_size=1) == ""
    got = split_refusal(kind, heads, tp, pp_size=2)
    assert "--pipeline-parallel-size 2" in got and "without pipeline parallelism" in got


def test_mla_stages_on_rank_zero_only():
    assert [stages("mla", r) for r in range(3)] == [True, False, False]
    assert [stages("gqa", r) for r in range(3)] == [True] * 3
    assert (staging_ranks("gqa", 4), staging_ranks("mla", 4)) == (4, 1)


def test_a_refusing_scheduler_hands_nothing_off_and_says_why():
    from tests.unit.prefill.test_scheduler import FakeSlots, params

    slots = FakeSlots(2)
    sched = ExpressScheduler(slots, max_tokens=100, refusal=split_refusal("gqa", 2, 4))
    sched.on_alloc("r", params(), 5)
    (save,) = sched.on_step([("r", ([1],), 0)], [], {"r": 5})
    assert save.staging_slot == -1 and "replicates" in save.fail_reason and slots.free == [0, 1]


# ---------------------------------------------------------------- slot states shared by ranks

# each slot's state on each of 2 ranks -> the slot reserve takes (None: none free on both)
RESERVE_CASES = [
    ([(FREE, FREE), (FREE, FREE)], 0),
    ([(FREE, SENDING), (FREE, FREE)], 1),  # rank 1 still sends slot 0
    ([(SENDING, FREE), (FREE, FREE)], 1),
    ([(RESERVED, RESERVED), (FREE, FREE)], 1),
    ([(FREE, SENDING), (SENDING, FREE)], None),
    ([(FREE, RESERVED), (RESERVED, FREE)], None),
]


@pytest.mark.parametrize("states,want", RESERVE_CASES)
def test_a_slot_is_reserved_only_when_free_on_every_rank(tmp_path, states, want):
    path = str(tmp_path / "slots")
    sched = RankSlotStates(path, len(states), num_ranks=2, create=True)
    workers = [SlotStates(rank_path(path, r), len(states)) for r in range(2)]
    for slot, per_rank in enumerate(states):
        for worker, state in zip(workers, per_rank):
            worker.set(slot, state)
    assert sched.reserve() == want
    if want is not None:
        assert [w.get(want) for w in workers] == [RESERVED, RESERVED]


def test_a_slot_comes_back_once_the_last_rank_frees_it(tmp_path):
    path = str(tmp_path / "slots")
    sched = RankSlotStates(path, 1, num_ranks=3, create=True)
    workers = [SlotStates(rank_path(path, r), 1) for r in range(3)]
    assert sched.reserve() == 0 and sched.reserve() is None
    for r, worker in enumerate(workers):
        worker.set(0, SENDING)
    for r, worker in enumerate(workers):
        assert sched.reserve() is None and sched.snapshot() == [SENDING]
        worker.set(0, FREE)
    assert sched.snapshot() == [FREE] and sched.reserve() == 0


def test_stats_merge_the_ranks_and_forget_an_earlier_runs_larger_split(tmp_path):
    path = str(tmp_path / "slots")
    RankSlotStates(path, 2, num_ranks=4, create=True)
    assert os.path.exists(rank_path(path, 3))
    sched = RankSlotStates(path, 2, num_ranks=2, create=True)  # restarted with TP 2
    assert not os.path.exists(rank_path(path, 2)) and not os.path.exists(rank_path(path, 3))
    workers = [SlotStates(rank_path(path, r), 2) for r in range(2)]
    assert sched.reserve() == 0
    sched.count("claimed")
    workers[0].set(0, FREE)
    workers[1].set(0, SENDING)
    for w in workers:
        w.count("kv_ready")
    assert read_stats(path) == {"total": 2, "free": 1, "reserved": 0, "sending": 1, "claimed": 1,
                                "not_handed_off": 0, "kv_ready": 2, "kv_failed": 0, "decode_started": 0, "first_token_direct": 0,
                                "staging_slot_quarantined": 0}


# ---------------------------------------------------------------- packing a reader's heads


@pytest.mark.parametrize("d,reader", [(2, 1), (4, 2)])
def test_pack_heads_builds_the_readers_image(d, reader):
    ours = layout_spec(GQA, "float32", MAX)
    pool = StagingPool(ours, num_slots=2)
    pool.buffer[1].copy_(pool.buffer.new_tensor(np.random.default_rng(d).integers(0, 256, ours.slot_nbytes)))
    registered = []
    scratch = pool.scratch_addr(1, lambda addr, nbytes: registered.append((addr, nbytes)))
    assert pool.scratch_addr(0, lambda *a: registered.append(a)) == scratch - ours.slot_nbytes
    assert registered == [(pool.scratch.data_ptr(), 2 * ours.slot_nbytes)]  # once, for every slot
    staged = staged_layout(ours, layout_spec(GQA, "float32", MAX, d, reader))
    offset = 8
    pool.pack_heads(1, staged, offset, N)
    src = pool.buffer[1].numpy()
    want = np.zeros(staged.slot_nbytes, dtype=np.uint8)
    for local, remote, nbytes in tp_write_ops(ours, 0, staged, 0, N):  # the contract's own gather
        want[remote:remote + nbytes] = src[local:local + nbytes]
    got = pool.scratch[1].numpy()[offset:offset + staged.slot_nbytes]
    for seg in staged.segments:  # the first N tokens of each segment are the reader's heads
        part = slice(seg.offset_bytes, seg.offset_bytes + N * seg.bytes_per_token)
        assert np.array_equal(got[part], want[part])


# ---------------------------------------------------------------- the sender under TP


class Recorder:
    """A memory-copy transport (both sides in this process) that records (endpoint, ops)."""

    name = "mooncake"

    def __init__(self) -> None:
        self.writes: list[tuple[str, list]] = []

    def register(self, addr, nbytes) -> None:
        pass

    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        import ctypes

        self.writes.append((endpoint, ops))
        for local, remote, nbytes in ops:
            ctypes.memmove(remote, local, nbytes)


class GpuStaging(StagingPool):
    """Host memory standing in for GPU staging (the sender prewarms), its copies done at once."""

    on_gpu = True

    def fence(self, slot: int) -> None:
        pass

    def wait_staged(self, slot: int) -> None:
        pass


def send_once(tmp_path, ours, layouts, gpu=False, **sender_kw):
    """One job from a staging slot of ``ours`` into decode ranks of ``layouts``: (events, writes)."""
    import time

    from services.prefill.sender import Sender, SendJob
    from shared.handoff import Handoff
    from tests.unit.prefill.test_sender import Publisher

    states = SlotStates(str(tmp_path / "states"), 1, create=True)
    pool, transport, publisher = (GpuStaging if gpu else StagingPool)(ours, 1), Recorder(), Publisher()
    bufs = [np.zeros(lay.slot_nbytes, dtype=np.uint8) for lay in layouts]
    ranks = [RankTarget(tp_rank=r, endpoint=f"rank{r}", layout=lay,
                        slot=SlotTarget(slot=0, base_addr=b.ctypes.data, nbytes=b.size))
             for r, (lay, b) in enumerate(zip(layouts, bufs))]
    tgt = TransferTarget(node_id="n", transport="mooncake", endpoint="rank0", slot=ranks[0].slot,
                         layout=ranks[0].layout, ranks=ranks[1:])
    sender = Sender({"mooncake": transport}, pool, states, publisher, 5.0, num_threads=1, **sender_kw)
    try:
        states.set(0, SENDING)
        sender.submit(SendJob(Handoff(request_id="r", lease_id="L", generation=1, target=tgt), 0, N))
        deadline = time.monotonic() + 30
        while states.get(0) != FREE:
            assert time.monotonic() < deadline, "the sender never finished"
            time.sleep(0.001)
        time.sleep(0.05)  # the publish follows the free
    finally:
        sender.close()
    return publisher.events, transport.writes


def test_prewarm_goes_to_the_first_rank_written(tmp_path):
    """Prefill rank 1 of 2 holds the heads of decode rank 1 of 2: rank 0 is skipped, the prewarm
    and the write go to rank 1, and its KvReady says rank 1 of 2 wrote it."""
    ours = layout_spec(GQA, "float32", MAX, 2, 1)
    (event,), writes = send_once(tmp_path, ours, [layout_spec(GQA, "float32", MAX, 2, r) for r in range(2)],
                                 gpu=True)
    assert [endpoint for endpoint, _ in writes] == ["rank1", "rank1"] and len(writes[0][1]) == 1
    assert (event.source_rank, event.source_ranks, event.nbytes) == (1, 2, N * ours.slot_nbytes // MAX)


def test_no_checksums_under_tp(tmp_path):
    ours = layout_spec(GQA, "float32", MAX)
    (event,), _ = send_once(tmp_path, ours, [layout_spec(GQA, "float32", MAX, 2, r) for r in range(2)],
                            checksum=True)
    assert event.kv_checksums == [] and event.kv_checksum_algo == "" and event.nbytes == N * ours.slot_nbytes // MAX
    (event,), _ = send_once(tmp_path, ours, [layout_spec(GQA, "float32", MAX)], checksum=True)
    assert len(event.kv_checksums) == len(ours.segments)
