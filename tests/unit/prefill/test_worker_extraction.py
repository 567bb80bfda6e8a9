"""With the KV cache in host memory the worker stages a step's requests on its extraction thread:
``wait_for_save`` returns while the copies run, and ``wait_extracted`` (what the connector calls
when vLLM binds the next step's metadata, before that step's forward) returns only after they have
read the cache; one step's extraction at a time, in step order. Where vLLM's scheduler shares the
process, the copies start once it has sent the step's first tokens (``first_tokens_out``), at the
next forward, or after ``FIRST_TOKENS_WAIT_S``, whichever comes first."""

from __future__ import annotations

import itertools
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.prefill import worker as worker_mod
from services.prefill.scheduler import SaveRequest
from services.prefill.worker import ExpressWorker

WAIT_S = 10.0
_engine_ids = itertools.count()


def _step(name: str, *, reads: bool = True) -> list[SaveRequest]:
    """One step's saves: a claimed request whose blocks are copied, or (``reads`` False) one whose
    failure is only reported (no staging slot)."""
    handoff = types.SimpleNamespace(request_id=name)  # only its presence matters here
    return [SaveRequest(name, handoff, [[0]], 16, staging_slot=0 if reads else -1,
                        fail_reason="" if reads else "no staging slot free")]


class _Counts:
    """The staging counters' stand-in: what the worker counted."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def count(self, counter: str, n: int = 1) -> None:
        self.counts[counter] = self.counts.get(counter, 0) + n


def _worker(record: list, gate: threading.Event, started: threading.Event | None = None) -> ExpressWorker:
    w = ExpressWorker.__new__(ExpressWorker)  # only the parts wait_for_save's dispatch uses
    w.stages = True
    w.engine_id = f"engine-{next(_engine_ids)}"
    w._extractor = ThreadPoolExecutor(1, "test-extract")
    w._extracting = None
    w._go = None
    w.states = _Counts()
    w.refusal = ""

    def save(saves):
        record.append(("start", saves))
        if started is not None:
            started.set()
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
    w.stages, w._extracting, w._go, w.engine_id, w.states = True, None, None, "engine-failing", None
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


@pytest.fixture
def scheduler_here(monkeypatch):
    """A worker whose engine's scheduler-side connector runs in this process (the "uni" executor)."""
    monkeypatch.setattr(worker_mod, "FIRST_TOKENS_WAIT_S", WAIT_S)  # only the scheduler or the next step start it
    made = []

    def make(record, gate, started):
        w = _worker(record, gate, started)
        worker_mod.scheduler_in_process(w.engine_id)
        monkeypatch.setitem(worker_mod._workers_here, w.engine_id, w)
        made.append(w)
        return w

    yield make
    for w in made:
        worker_mod._schedulers_here.discard(w.engine_id)
        w.first_tokens_out()
        w._extractor.shutdown(wait=True)


def test_with_the_scheduler_here_extraction_starts_when_the_first_tokens_are_out(scheduler_here):
    record, gate, started = [], threading.Event(), threading.Event()
    gate.set()
    w = scheduler_here(record, gate, started)
    step = _step("req-1")
    w.wait_for_save(step)
    assert not started.wait(0.05) and record == []  # held: the step's sampling and output go first
    worker_mod.first_tokens_out(w.engine_id)  # what the connector's request_finished calls after publishing
    assert started.wait(WAIT_S)
    w.wait_extracted()
    assert record == [("start", step), ("done", step)]
    assert w.states.counts == {"extract_after_first_token": 1}


def test_the_next_step_starts_a_held_extraction_and_waits_for_it(scheduler_here):
    record, gate, started = [], threading.Event(), threading.Event()
    gate.set()
    w = scheduler_here(record, gate, started)
    steps = [_step(f"req-{i}") for i in range(3)]
    w.wait_for_save(steps[0])
    # no first token came (the request goes on running): the scheduler planning the next step
    # starts the copy and returns once it has read the blocks
    worker_mod.extraction_done(w.engine_id)
    assert record == [("start", steps[0]), ("done", steps[0])]
    w.wait_for_save(steps[1])
    w.wait_for_save(steps[2])  # a step's wait_for_save waits for the step before it, started first
    w.wait_extracted()  # the worker's own wait when vLLM binds the next step's metadata
    assert record[2:] == [(what, steps[i]) for i in (1, 2) for what in ("start", "done")]
    assert w.states.counts == {}  # none of them waited for a first token
    worker_mod.extraction_done(w.engine_id)  # nothing pending: returns at once


def test_a_step_with_failures_only_reports_them_at_once(scheduler_here):
    record, gate, started = [], threading.Event(), threading.Event()
    gate.set()
    w = scheduler_here(record, gate, started)
    step = _step("req-1", reads=False)  # e.g. aborted before its prompt ran: nothing to copy
    w.wait_for_save(step)
    assert started.wait(WAIT_S)  # not held for a first token that will not come
    w.wait_extracted()
    assert record == [("start", step), ("done", step)] and w.states.counts == {}


def test_a_held_extraction_starts_by_itself_after_the_backstop_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(worker_mod, "FIRST_TOKENS_WAIT_S", 0.001)
    record, gate, started = [], threading.Event(), threading.Event()
    gate.set()
    w = _worker(record, gate, started)
    worker_mod.scheduler_in_process(w.engine_id)
    step = _step("req-1")
    try:
        w.wait_for_save(step)  # no first token, no next step (not a case vLLM's scheduler makes)
        assert started.wait(WAIT_S)
        w.wait_extracted()
        assert record == [("start", step), ("done", step)]
        assert "neither a first token nor a next step" in caplog.text and "req-1" in caplog.text
        assert w.states.counts == {}
    finally:
        worker_mod._schedulers_here.discard(w.engine_id)
        w._extractor.shutdown(wait=True)


def test_without_the_scheduler_here_extraction_starts_at_once(monkeypatch):
    monkeypatch.setattr(worker_mod, "FIRST_TOKENS_WAIT_S", WAIT_S)
    record, gate, started = [], threading.Event(), threading.Event()
    gate.set()
    w = _worker(record, gate, started)  # another process's executor: nobody would say when
    try:
        w.wait_for_save(["step-1"])
        assert started.wait(WAIT_S)
        w.wait_extracted()
        assert w.states.counts == {}
    finally:
        w._extractor.shutdown(wait=True)


def test_the_scheduler_side_calls_for_an_engine_without_a_worker_here_are_no_ops():
    worker_mod.first_tokens_out("no-such-engine")
    worker_mod.extraction_done("no-such-engine")
