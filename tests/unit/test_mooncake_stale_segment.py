"""A Mooncake writer whose write fails to a receiver it has written to before starts a fresh engine
(same regions registered) and tries once more: Mooncake caches a receiver's segment descriptor under
its host:port for the engine's life, so a receiver that restarted on the same port is otherwise
unreachable for good. A fake engine stands in for Mooncake's TransferEngine; the real one is
exercised by tests/integration/test_transport.py."""

from __future__ import annotations

import pytest

from shared.transport import TransferError
from shared.transport.mooncake import MooncakeTransport

EP = "127.0.0.1:15555"
OPS = [(0x1000, 0x9000, 64)]


class World:
    """What the fake engines see: which endpoints their writes reach, per engine."""

    def __init__(self, *, fail_init_after: int = 10**9) -> None:
        self.engines: list[FakeEngine] = []
        self.fail_init_after = fail_init_after
        self.reachable: dict[int, bool] = {}  # engine index -> does a write to EP land
        self.on_write = lambda engine: None

    def new(self) -> "FakeEngine":
        e = FakeEngine(self, len(self.engines))
        self.engines.append(e)
        return e


class FakeEngine:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.registered: dict[int, int] = {}
        self.writes = 0

    def initialize(self, host, meta, protocol, device):
        return 0 if self.index <= self.world.fail_init_after else -1

    def get_rpc_port(self):
        return 16000 + self.index

    def register_memory(self, addr, nbytes):
        self.registered[addr] = nbytes
        return 0

    def unregister_memory(self, addr):
        self.registered.pop(addr, None)
        return 0

    def batch_transfer_sync_write(self, endpoint, local, remote, lengths):
        self.writes += 1
        self.world.on_write(self)
        return 0 if self.world.reachable.get(self.index, True) else -1


def transport(world: World) -> MooncakeTransport:
    t = MooncakeTransport(engine_factory=world.new)
    t.engine_timeout_s = 1.0  # every write below goes as one blocking batch
    t.register(0x1000, 4096)
    return t


# (written before, first engine reaches EP, fresh engine reaches EP, fresh engine starts)
#   -> (write succeeds, engines started)
CASES = [
    pytest.param(True, False, True, True, True, 2, id="receiver restarted on the same port: fresh engine lands it"),
    pytest.param(True, False, False, True, False, 2, id="receiver gone: one fresh engine, then the error"),
    pytest.param(False, False, True, True, False, 1, id="never written: no restart, the error"),
    pytest.param(True, False, True, False, False, 2, id="fresh engine cannot start: the error, old engine kept"),
    pytest.param(True, True, True, True, True, 1, id="write lands: nothing restarts"),
]


@pytest.mark.parametrize("written,first_ok,fresh_ok,fresh_starts,ok,engines", CASES)
def test_stale_descriptor_recovery(written, first_ok, fresh_ok, fresh_starts, ok, engines):
    world = World(fail_init_after=10**9 if fresh_starts else 0)
    t = transport(world)
    if written:
        t.write(EP, OPS, timeout_s=5)
    world.reachable = {0: first_ok, 1: fresh_ok}
    if ok:
        t.write(EP, OPS, timeout_s=5)
    else:
        with pytest.raises(TransferError, match="failed"):
            t.write(EP, OPS, timeout_s=5)
    assert len(world.engines) == engines
    current = world.engines[1] if fresh_starts and engines == 2 else world.engines[0]
    assert t.transfer_engine is current
    assert current.registered == {0x1000: 4096}  # the fresh engine holds the same regions
    assert t.engine_restarts == (1 if current.index == 1 else 0)
    assert t.endpoint == f"127.0.0.1:{current.get_rpc_port()}"


def test_a_restart_forgets_every_cached_endpoint():
    """After a fresh engine, a failure to another receiver written only by the old engine does not
    start yet another engine: the fresh one has no descriptor cached for it."""
    world = World()
    t = transport(world)
    t.write(EP, OPS, timeout_s=5)
    t.write("127.0.0.1:15556", OPS, timeout_s=5)
    world.reachable = {0: False, 1: False}
    with pytest.raises(TransferError):
        t.write(EP, OPS, timeout_s=5)
    with pytest.raises(TransferError):
        t.write("127.0.0.1:15556", OPS, timeout_s=5)
    assert len(world.engines) == 2 and t.engine_restarts == 1


def test_no_retry_past_the_deadline(monkeypatch):
    """A failed write that used up the caller's deadline is not tried again."""
    clock = [100.0]
    monkeypatch.setattr("shared.transport.mooncake.time.monotonic", lambda: clock[0])
    world = World()
    t = transport(world)
    t.write(EP, OPS, timeout_s=5)
    world.reachable = {0: False, 1: True}
    world.on_write = lambda engine: clock.__setitem__(0, clock[0] + 6.0)  # the engine's own timeout
    with pytest.raises(TransferError):
        t.write(EP, OPS, timeout_s=5)
    assert world.engines[-1].writes == 0
