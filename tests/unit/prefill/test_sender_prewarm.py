"""With GPU staging, the sender writes a few bytes into the slot while the staging copies run (the
write path's cold first post is paid while the thread would only wait), then the write proper once
they have landed; what lands is the staged KV. A failed prewarm write does not decide the outcome.
Host memory stands in for the GPU staging (``on_gpu`` forced), a memory copy for the transport."""

from __future__ import annotations

import time

import numpy as np

from services.prefill.sender import PREWARM_BYTES
from shared.events import KvReady
from shared.transport import TransferError

from tests.unit.prefill.test_sender import NUM_TOKENS, SPEC, CopiesInFlight, RecordingTransport, send


class GpuStagingInFlight(CopiesInFlight):
    on_gpu = True


class PrewarmFails(RecordingTransport):
    def write(self, endpoint, ops, nixl_metadata_b64="", timeout_s=None) -> None:
        if not self.writes:  # the first write: the prewarm
            self.writes.append(ops)
            raise TransferError("receiver not reachable yet")
        super().write(endpoint, ops, nixl_metadata_b64, timeout_s)


def prewarm_nbytes() -> int:
    """The prewarm's size: PREWARM_BYTES of the first segment (all of it when that is smaller)."""
    return min(SPEC.segments[0].bytes_per_token * NUM_TOKENS, PREWARM_BYTES)


def staged_landed(pool, slot) -> bool:
    n = SPEC.segments[0].bytes_per_token * NUM_TOKENS
    return np.array_equal(slot[:n], pool.slot_bytes(0)[:n])


def test_prewarm_writes_while_the_copies_run_then_the_kv_lands(tmp_path):
    pool, transport = GpuStagingInFlight(), RecordingTransport()

    def copies_land() -> None:
        deadline = time.monotonic() + 30
        while not transport.writes:  # the prewarm write comes before the copies have landed
            assert time.monotonic() < deadline, "no prewarm write while the copies ran"
            time.sleep(0.001)
        assert len(transport.writes) == 1 and len(transport.writes[0]) == 1
        assert transport.writes[0][0][2] == prewarm_nbytes()
        pool.done.set()

    (event,), (slot,) = send(tmp_path, 1, pool=pool, transport=transport, on_submit=copies_land)
    assert isinstance(event, KvReady) and len(transport.writes) == 2
    assert len(transport.writes[1]) == len(SPEC.segments) and staged_landed(pool, slot)


def test_a_failed_prewarm_leaves_the_outcome_to_the_write(tmp_path):
    pool, transport = GpuStagingInFlight(), PrewarmFails()
    pool.done.set()
    (event,), (slot,) = send(tmp_path, 1, pool=pool, transport=transport)
    assert isinstance(event, KvReady) and len(transport.writes) == 2 and staged_landed(pool, slot)


def test_no_prewarm_with_host_staging_or_when_off(tmp_path):
    for pool, kw in ((CopiesInFlight(), {}), (GpuStagingInFlight(), {"prewarm": False})):
        transport = RecordingTransport()
        pool.done.set()
        (tmp_path / str(len(kw))).mkdir()
        (event,), _ = send(tmp_path / str(len(kw)), 1, pool=pool, transport=transport, **kw)
        assert isinstance(event, KvReady) and len(transport.writes) == 1
