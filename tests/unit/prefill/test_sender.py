"""The background sender with checksums on: the sums in KvReady are those of the bytes that landed
in the decode slot; with fault injection, the landed bytes no longer match them (the decode node's
check, shared.kvchecksum.verify, catches it). A memory-copy transport stands in for Mooncake."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from services.prefill.sender import Sender, SendJob
from services.prefill.staging import FREE, SENDING, SlotStates, StagingPool
from shared.events import KvReady, SlotTarget, TransferTarget
from shared.handoff import Handoff
from shared.kvchecksum import CHECKSUM_ALGO, host_reader, verify
from shared.kvlayout import KvShape, layout_spec, write_ranges

SPEC = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=4), "float32", 16)
NUM_TOKENS = 6


class MemcpyTransport:
    name = "mooncake"

    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        for local, remote, nbytes in ops:
            ctypes.memmove(remote, local, nbytes)


class Publisher:
    def __init__(self) -> None:
        self.events = []

    def publish(self, subject, event, traceparent="") -> bool:
        self.events.append(event)
        return True


class CopiesInFlight(StagingPool):
    """Staging whose copies (queued on a GPU stream in production) finish only when ``done`` is set."""

    def __init__(self) -> None:
        super().__init__(SPEC, 1)
        self.done = threading.Event()
        self.fenced: list[int] = []

    def fence(self, slot: int) -> None:
        self.fenced.append(slot)

    def wait_staged(self, slot: int) -> None:
        assert self.done.wait(30), "the staging copies never finished"


class RecordingTransport(MemcpyTransport):
    def __init__(self) -> None:
        self.writes = []

    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        self.writes.append(ops)
        super().write(endpoint, ops, nixl_metadata_b64, timeout_s)


def send(tmp_path, num_requests: int, pool=None, transport=None, on_submit=None,
         **sender_kw) -> tuple[list[KvReady], list[np.ndarray]]:
    """Stage random KV and send it into fresh decode slots; the KvReady events and the slots."""
    states = SlotStates(str(tmp_path / "states"), 1, create=True)
    pool = pool or StagingPool(SPEC, 1)
    publisher = Publisher()
    sender = Sender({"mooncake": transport or MemcpyTransport()}, pool, states, publisher, 5.0,
                    num_threads=1, **sender_kw)
    slots = []
    rng = np.random.default_rng(0)
    try:
        for i in range(num_requests):
            pool.slot_bytes(0)[:] = rng.integers(0, 256, SPEC.slot_nbytes, dtype=np.uint8)
            slots.append(np.zeros(SPEC.slot_nbytes, dtype=np.uint8))
            target = TransferTarget(node_id="d1", transport="mooncake", endpoint="e", layout=SPEC,
                                    slot=SlotTarget(slot=0, base_addr=slots[-1].ctypes.data,
                                                    nbytes=SPEC.slot_nbytes))
            states.set(0, SENDING)
            sender.submit(SendJob(Handoff(request_id=f"r{i}", lease_id=f"L{i}", generation=1,
                                          target=target), 0, NUM_TOKENS))
            if on_submit is not None:
                on_submit()
            deadline = time.monotonic() + 30
            while len(publisher.events) <= i:  # one staging slot: each job ends before the next
                assert time.monotonic() < deadline, "the sender never published"
                time.sleep(0.001)
    finally:
        sender.close()
    assert states.snapshot() == [FREE]  # no staging slot left behind
    return publisher.events, slots


def landed_ok(event: KvReady, slot: np.ndarray) -> bool:
    return verify(host_reader(slot), write_ranges(SPEC, event.num_tokens), event.kv_checksums,
                  event.kv_checksum_algo) == ""


def test_checksums_are_off_by_default(tmp_path):
    (event,), _ = send(tmp_path, 1)
    assert isinstance(event, KvReady) and event.kv_checksums == [] and event.kv_checksum_algo == ""


@pytest.mark.parametrize("num_checksum_threads", [1, 3])
def test_sums_match_the_bytes_that_landed(tmp_path, num_checksum_threads):
    (event,), (slot,) = send(tmp_path, 1, checksum=True, num_checksum_threads=num_checksum_threads)
    assert isinstance(event, KvReady) and event.kv_checksum_algo == CHECKSUM_ALGO
    assert len(event.kv_checksums) == len(SPEC.segments) and event.checksum_ms >= 0
    assert landed_ok(event, slot)


def test_fault_injection_corrupts_every_nth_transfer_after_summing(tmp_path):
    events, slots = send(tmp_path, 4, checksum=True, fault_flip_every=2)
    assert [landed_ok(e, s) for e, s in zip(events, slots)] == [True, False, True, False]


def test_a_slot_is_written_only_after_its_staging_copies_finish(tmp_path):
    pool, transport = CopiesInFlight(), RecordingTransport()

    def copies_land() -> None:
        assert pool.fenced == [0]  # marked on the submitting (extracting) thread
        assert transport.writes == []  # the sender waits for the copies
        pool.done.set()

    (event,), (slot,) = send(tmp_path, 1, pool=pool, transport=transport, on_submit=copies_land)
    assert isinstance(event, KvReady) and len(transport.writes) == 1
    assert np.array_equal(slot[: SPEC.segments[0].bytes_per_token * NUM_TOKENS],
                          pool.slot_bytes(0)[: SPEC.segments[0].bytes_per_token * NUM_TOKENS])


class BrokenBinding(MemcpyTransport):
    """A transport whose binding raises something other than TransferError (a device error, a
    binding's own exception type)."""

    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        raise ValueError("cudaErrorIllegalAddress")


def test_an_unexpected_error_in_the_write_is_one_kv_failed_and_the_slot_freed(tmp_path):
    from shared.events import KvFailed

    (event,), _ = send(tmp_path, 1, transport=BrokenBinding())  # send() asserts the slot is FREE
    assert isinstance(event, KvFailed) and "ValueError: cudaErrorIllegalAddress" in event.reason


def send_one(sender: Sender, states: SlotStates, publisher: Publisher) -> None:
    """Staging slot 0 (SENDING) handed to the sender for request r0; returns once it published."""
    target = TransferTarget(node_id="d1", transport="mooncake", endpoint="e", layout=SPEC,
                            slot=SlotTarget(slot=0, base_addr=0, nbytes=SPEC.slot_nbytes))
    states.set(0, SENDING)
    sender.submit(SendJob(Handoff(request_id="r0", lease_id="L0", generation=1, target=target), 0, NUM_TOKENS))
    deadline = time.monotonic() + 30
    while not publisher.events:
        assert time.monotonic() < deadline, "the sender never published"
        time.sleep(0.001)


class ReservingPublisher(Publisher):
    """The slot is taken again by the next request before the KvFailed leaves, then the publish fails."""

    def __init__(self, states: SlotStates) -> None:
        super().__init__()
        self.states = states

    def publish(self, subject, event, traceparent="") -> bool:
        self.states.set(0, SENDING)  # the scheduler reserved the freed slot for another request
        self.events.append(event)
        raise RuntimeError("encoder bug")


def test_a_failure_after_the_slot_was_freed_never_frees_it_again(tmp_path):
    states = SlotStates(str(tmp_path / "states"), 1, create=True)
    pool, publisher = StagingPool(SPEC, 1), ReservingPublisher(states)
    sender = Sender({"mooncake": BrokenBinding()}, pool, states, publisher, 5.0, num_threads=1)
    try:
        send_one(sender, states, publisher)
    finally:
        sender.close()  # joins the thread: its error handling is done
    assert states.snapshot() == [SENDING]  # the other request's reservation stands


class GaveUpInFlight(MemcpyTransport):
    """A write that gives up (its deadline) with parts still in flight, which end once ``stops`` is
    set (never, unset): the sender must not reuse the slot, nor say so, before they have."""

    def __init__(self, stops: bool) -> None:
        self.stops = threading.Event()
        if stops:
            threading.Timer(0.05, self.stops.set).start()
        self.settle_calls = []

    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        from shared.transport import TransferError

        def settle(timeout_s: float) -> bool:
            self.settle_calls.append(timeout_s)
            return self.stops.wait(timeout_s)

        raise TransferError("did not complete within 0.1 s", settle=settle)


@pytest.mark.parametrize("stops, state_after", [(True, FREE), (False, SENDING)])
def test_a_write_that_gave_up_in_flight_frees_its_slot_only_once_it_stopped(tmp_path, stops, state_after):
    from shared.events import KvFailed

    states = SlotStates(str(tmp_path / "states"), 1, create=True)
    publisher, transport = Publisher(), GaveUpInFlight(stops)
    sender = Sender({"mooncake": transport}, StagingPool(SPEC, 1), states, publisher, 5.0, num_threads=1,
                    settle_timeout_s=0.5)
    try:
        send_one(sender, states, publisher)
        # KvFailed only after the settle: the slot is already in its final state when it is out
        (event,) = publisher.events
        assert isinstance(event, KvFailed) and "did not complete" in event.reason
        assert states.snapshot() == [state_after] and transport.settle_calls == [0.5]
    finally:
        sender.close()
    from services.prefill.staging import read_stats
    assert read_stats(str(tmp_path / "states"))["staging_slot_quarantined"] == (0 if stops else 1)
