"""How a NIXL writer waits for its transfer: polls that only yield for the first SPIN_S (a sleep can
outlast a GPU-to-GPU write many times over on a virtualised host), sleeps between polls after
that. A fake agent stands in for NIXL."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest

from shared.transport import TransferError, nixl
from shared.transport.nixl import NixlTransport


class FakeAgent:
    def __init__(self, polls_in_flight: int, final: str = "DONE") -> None:
        self.polls_left = polls_in_flight
        self.final = final
        self.released = 0

    def get_xfer_descs(self, descs, mem_type):
        return (tuple(descs), mem_type)

    def initialize_xfer(self, op, local, remote, agent):
        return object()

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        self.polls_left -= 1
        return "PROC" if self.polls_left > 0 else self.final

    def release_xfer_handle(self, handle):
        self.released += 1


def transport(agent: FakeAgent) -> NixlTransport:
    t = NixlTransport.__new__(NixlTransport)  # no NIXL library needed
    t._agent, t._mem_type, t._device_id = agent, "VRAM", 0
    t._lock, t._remotes, t._regions = threading.Lock(), {"node": "meta"}, {}
    t._epochs, t._xfers, t._local_epoch = {}, OrderedDict(), 0
    return t


@pytest.fixture
def sleeps(monkeypatch):
    calls = []
    monkeypatch.setattr(nixl.time, "sleep", calls.append)
    return calls


def test_polls_only_yield_while_the_write_is_young(sleeps, monkeypatch):
    yields = []
    monkeypatch.setattr(nixl, "_yield", lambda: yields.append(1))
    agent = FakeAgent(polls_in_flight=50)
    transport(agent).write("node", [(1, 2, 3)], "meta", timeout_s=5)
    assert sleeps == [] and len(yields) == 50 and agent.released == 0  # kept for the next write


def test_polls_sleep_once_the_spin_window_is_over(sleeps, monkeypatch):
    monkeypatch.setattr(nixl, "SPIN_S", 0.0)
    agent = FakeAgent(polls_in_flight=5)
    transport(agent).write("node", [(1, 2, 3)], "meta", timeout_s=5)
    assert len(sleeps) == 5 and all(0 < s <= nixl.POLL_MAX_S for s in sleeps)


def test_a_failed_write_raises_and_releases_its_handle(sleeps):
    agent = FakeAgent(polls_in_flight=3, final="ERR")
    with pytest.raises(TransferError, match="failed"):
        transport(agent).write("node", [(1, 2, 3)], "meta", timeout_s=5)
    assert agent.released == 1


def test_a_write_given_up_in_flight_leaves_its_handle_to_settle(sleeps):
    # past its deadline the write is still in flight (NIXL reads the staging buffer, writes the remote slot):
    # the writer raises without releasing the handle (UCX may not cancel it); TransferError.settle says when it
    # has ended, and only then is the handle released, once
    agent = FakeAgent(polls_in_flight=10**9)
    with pytest.raises(TransferError, match="did not complete") as err:
        transport(agent).write("node", [(1, 2, 3)], "meta", timeout_s=-1.0)
    settle = err.value.settle
    assert settle is not None and agent.released == 0
    assert settle(-1.0) is False and agent.released == 0  # still in flight: nothing may be reused yet
    agent.polls_left = 1  # the next poll reports it ended
    assert settle(5.0) is True and agent.released == 1
