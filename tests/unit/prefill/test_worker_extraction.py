"""With the KV cache in host memory the worker stages a step's requests on its extraction thread:
``wait_for_save`` returns while the copies run, and ``wait_extracted`` (what the connector calls
when vLLM binds the next step's metadata, before that step's forward) returns only after they have
read the cache; one step's extraction at a time, in step order. Where vLLM's scheduler shares the
process, it waits for the same before planning the next step (``extraction_done``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from services.prefill import worker as worker_mod
from services.prefill.worker import ExpressWorker

WAIT_S = 10.0


def _worker(record: list, gate: threading.Event) -> ExpressWorker:
    w = ExpressWorker.__new__(ExpressWorker)  # only the parts wait_for_save's dispatch uses
    w.stages = True
    w._extractor = ThreadPoolExecutor(1, "test-extract")
    w._extracting = None

    def save(saves):
        record.append(("start", saves))
        assert gate.wait(WAIT_S)
        record.append(("done", saves))

    w._save = save
    return w


def test_extraction_runs_beside_the_step_and_before_the_next_forward():
    record, gate = [], threading.Event()
    w = _worker(record, gate)
    try:
        w.wait_for_save(["step-1"])  # returns with the copies still running (the gate is shut)
        assert ("done", ["step-1"]) not in record
        waited = threading.Event()
        t = threading.Thread(target=lambda: (w.wait_extracted(), waited.set()))
        t.start()
        assert not waited.wait(0.05) and ("done", ["step-1"]) not in record
        gate.set()
        assert waited.wait(WAIT_S)
        assert record == [("start", ["step-1"]), ("done", ["step-1"])]
        t.join()
        w.wait_extracted()  # nothing pending: returns at once
    finally:
        gate.set()
        w._extractor.shutdown(wait=True)


def test_steps_are_extracted_one_at_a_time_in_order():
    record, gate = [], threading.Event()
    gate.set()
    w = _worker(record, gate)
    try:
        for i in range(5):
            w.wait_for_save([f"step-{i}"])
        w.wait_extracted()
        assert record == [(what, [f"step-{i}"]) for i in range(5) for what in ("start", "done")]
    finally:
        w._extractor.shutdown(wait=True)


def test_a_failed_extraction_is_logged_not_raised_into_the_step(caplog):
    w = ExpressWorker.__new__(ExpressWorker)
    w.stages, w._extracting = True, None
    w._extractor = ThreadPoolExecutor(1, "test-extract")

    def boom(saves):
        raise RuntimeError("copy failed")

    w._save = boom
    try:
        w.wait_for_save(["step-1"])
        w.wait_extracted()
        assert "extraction thread failed" in caplog.text
    finally:
        w._extractor.shutdown(wait=True)


def test_the_scheduler_here_waits_for_the_copy_before_planning_the_next_step(monkeypatch):
    record, gate = [], threading.Event()
    w = _worker(record, gate)
    w.engine_id = "engine-here"
    monkeypatch.setitem(worker_mod._workers_here, w.engine_id, w)
    try:
        w.wait_for_save(["step-1"])
        done = threading.Event()
        t = threading.Thread(target=lambda: (worker_mod.extraction_done(w.engine_id), done.set()))
        t.start()
        assert not done.wait(0.05) and ("done", ["step-1"]) not in record
        gate.set()
        assert done.wait(WAIT_S) and record == [("start", ["step-1"]), ("done", ["step-1"])]
        t.join()
        worker_mod.extraction_done("no-such-engine")  # another process's worker: nothing to wait for
    finally:
        gate.set()
        w._extractor.shutdown(wait=True)


def test_one_save_that_fails_to_hand_off_neither_stops_the_others_nor_reaches_the_step(tmp_path):
    """The sender refuses the first request's job (a device error fencing its copies): that slot is
    freed once and a KvFailed queued for it; the second request is staged and sent as usual."""
    from opentelemetry import trace

    from services.prefill.scheduler import SaveRequest
    from services.prefill.staging import FREE, RESERVED, SENDING, SlotStates
    from shared.events import SlotTarget, TransferTarget
    from shared.handoff import Handoff
    from shared.kvlayout import KvShape, layout_spec

    spec = layout_spec(KvShape(kind="gqa", num_layers=1, num_kv_heads=1, head_dim=4), "float32", 8)

    class Sender:
        jobs = []

        def submit(self, job) -> None:
            if job.staging_slot == 0:
                raise RuntimeError("cudaEventRecord failed")
            self.jobs.append(job)

    w = ExpressWorker.__new__(ExpressWorker)
    w.states = SlotStates(str(tmp_path / "states"), 2, create=True)
    w.sender, w.tracer, w.tp_rank, w.refusal = Sender(), trace.NoOpTracer(), 0, ""
    w._stage = lambda save: 0.1
    saves = []
    for slot in (0, 1):
        w.states.set(slot, RESERVED)
        target = TransferTarget(node_id="d1", transport="mooncake", endpoint="e", layout=spec,
                                slot=SlotTarget(slot=0, base_addr=0, nbytes=spec.slot_nbytes))
        saves.append(SaveRequest(f"r{slot}", Handoff(request_id=f"r{slot}", lease_id=f"L{slot}", generation=1,
                                                     target=target), [[0]], 4, staging_slot=slot))
    w._save(saves)  # raises nothing
    assert w.states.snapshot() == [FREE, SENDING]
    failed, sent = w.sender.jobs
    assert (failed.handoff.request_id, failed.staging_slot) == ("r0", -1) and "cudaEventRecord" in failed.fail_reason
    assert (sent.handoff.request_id, sent.staging_slot, sent.fail_reason) == ("r1", 1, "")
