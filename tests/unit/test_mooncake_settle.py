"""A Mooncake write that gives up while batches are still in flight says so: its TransferError
carries ``settle``, which waits for those batches (and only those) to stop."""

from __future__ import annotations

import pytest

from shared.transport import TransferError
from shared.transport import mooncake
from shared.transport.mooncake import _DONE, _PENDING, MooncakeTransport


class Engine:
    """Batch ``i`` stays pending for ``polls[i]`` status checks (None: for good), then is done;
    ``fail``: the batch that reports a failure on its first check."""

    def __init__(self, polls: list[int | None], fail: int | None = None, refuse: int | None = None) -> None:
        self.polls, self.fail, self.refuse, self.checks = list(polls), fail, refuse, []

    def transfer_submit_write(self, endpoint, local, remote, nbytes) -> int:
        return -1 if local == self.refuse else 100 + local  # a batch id per op

    def transfer_check_status(self, batch_id: int) -> int:
        i = batch_id - 100
        self.checks.append(i)
        if i == self.fail:
            return -1
        if self.polls[i] is None:
            return _PENDING
        if self.polls[i] > 0:
            self.polls[i] -= 1
            return _PENDING
        return _DONE


def _write(engine, timeout_s: float) -> TransferError:
    t = MooncakeTransport.__new__(MooncakeTransport)
    t.engine_timeout_s = 30.0
    ops = [(i, 1000 + i, 8) for i in range(len(engine.polls))]
    with pytest.raises(TransferError) as err:
        t._write(engine, "peer", ops, timeout_s)
    return err.value


def test_a_write_past_its_deadline_settles_once_its_batches_end():
    engine = Engine([0, 10 ** 9, 3])  # batch 1 outlasts the write's deadline, then ends
    err = _write(engine, 0.01)
    assert err.settle is not None and not err.settle(0.01)  # still pending
    engine.polls[1] = 0
    assert err.settle(1.0)


def test_a_failed_batch_leaves_the_others_to_settle():
    engine = Engine([None, 0, None], fail=1)
    err = _write(engine, 5.0)
    assert "failed" in str(err) and not err.settle(0.01)
    checked = len(engine.checks)
    engine.polls[0] = engine.polls[2] = 0
    assert err.settle(1.0) and set(engine.checks[checked:]) == {0, 2}  # never the failed one


def test_nothing_in_flight_nothing_to_settle():
    assert mooncake._settler(Engine([]), []) is None


def test_a_refused_submit_leaves_the_batches_submitted_before_it_to_settle():
    engine = Engine([None, None, 0], refuse=2)
    err = _write(engine, 5.0)
    assert "could not submit" in str(err) and not err.settle(0.01)
    engine.polls[0] = engine.polls[1] = 0
    assert err.settle(1.0)


def test_a_first_submit_refused_has_nothing_in_flight():
    assert _write(Engine([0, 0], refuse=0), 5.0).settle is None
