"""A NIXL writer keeps each finished transfer's handle and reposts it for the same ops to the same
agent; the kept handles go when the agent's metadata changes (the receiver restarted), when a write
to it fails, when local memory is (de)registered, and beyond MAX_CACHED_XFERS. A fake agent stands
in for NIXL."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest

from shared.transport import TransferError, nixl
from shared.transport.nixl import NixlTransport

OPS = [(0x1000, 0x9000, 64), (0x2000, 0xA000, 64)]


class FakeAgent:
    def __init__(self) -> None:
        self.created, self.posted, self.released = [], [], []
        self.remotes: list[str] = []
        self.fail_next = 0

    def get_xfer_descs(self, descs, mem_type):
        return tuple(descs)

    def initialize_xfer(self, op, local, remote, agent):
        handle = ("xfer", len(self.created), agent, local, remote)
        self.created.append(handle)
        return handle

    def transfer(self, handle):
        assert handle not in self.released, "a released handle was posted"
        self.posted.append(handle)
        if self.fail_next:
            self.fail_next -= 1
            return "ERR"
        return "DONE"

    def check_xfer_state(self, handle):
        return "DONE"

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def add_remote_agent(self, metadata: bytes):
        name = metadata.decode().split("#")[0]
        self.remotes.append(name)
        return name

    def remove_remote_agent(self, name):
        self.remotes.remove(name)

    def register_memory(self, descs, mem_type):
        return descs

    def deregister_memory(self, descs):
        pass

    def get_agent_metadata(self):
        return b"local"


def meta(agent: str, version: int) -> str:
    import base64

    return base64.b64encode(f"{agent}#{version}".encode()).decode()


@pytest.fixture
def pair():
    agent = FakeAgent()
    t = NixlTransport.__new__(NixlTransport)  # no NIXL library needed
    t._agent, t._mem_type, t._device_id = agent, "VRAM", 0
    t._lock, t._remotes, t._regions = threading.Lock(), {}, {}
    t._epochs, t._xfers, t._local_epoch = {}, OrderedDict(), 0
    return t, agent


def test_the_same_ops_repost_one_handle(pair):
    t, agent = pair
    for _ in range(3):
        t.write("node", OPS, meta("node", 1))
    assert len(agent.created) == 1 and len(agent.posted) == 3 and agent.released == []
    t.write("node", OPS[:1], meta("node", 1))  # other ops (another prompt length): a handle of their own
    assert len(agent.created) == 2 and agent.released == []


def test_a_restarted_receiver_gets_new_handles(pair):
    t, agent = pair
    t.write("node", OPS, meta("node", 1))
    first = agent.created[0]
    t.write("node", OPS, meta("node", 2))  # same agent name, new metadata: a new process
    assert agent.released == [first] and len(agent.created) == 2 and agent.remotes == ["node"]
    assert agent.posted[-1] is agent.created[1]


def test_a_failed_write_drops_the_agent_and_its_handles(pair):
    t, agent = pair
    t.write("node", OPS, meta("node", 1))
    t.write("other", OPS, meta("other", 1))
    agent.fail_next = 2  # the repost and the new request both fail: the receiver is gone
    with pytest.raises(TransferError, match="failed"):
        t.write("node", OPS, meta("node", 1))
    assert agent.released == [agent.created[0], agent.created[2]] and agent.remotes == ["other"]
    t.write("node", OPS, meta("node", 1))  # loaded again, a fresh handle
    assert len(agent.created) == 4 and agent.posted[-1] is agent.created[3]


def test_kept_handles_are_bounded(pair, monkeypatch):
    monkeypatch.setattr(nixl, "MAX_CACHED_XFERS", 2)
    t, agent = pair
    for n in (1, 2, 3):
        t.write("node", [(0x1000, 0x9000, n)], meta("node", 1))
    assert agent.released == [agent.created[0]]  # the least recently used
    t.write("node", [(0x1000, 0x9000, 3)], meta("node", 1))
    assert len(agent.created) == 3


def test_local_registration_drops_every_handle(pair):
    t, agent = pair
    t.write("node", OPS, meta("node", 1))
    t.register(0x5000, 4096)
    assert agent.released == agent.created
    t.write("node", OPS, meta("node", 1))
    t.unregister(0x5000)
    assert agent.released == agent.created and len(agent.created) == 2
    t.close()


def test_a_kept_request_refused_at_post_is_replaced_once(pair):
    t, agent = pair
    t.write("node", OPS, meta("node", 1))
    agent.fail_next = 1  # the repost is refused; a new request goes through
    t.write("node", OPS, meta("node", 1))
    assert agent.released == [agent.created[0]] and len(agent.created) == 2
    assert agent.posted[-1] is agent.created[1] and agent.remotes == ["node"]
