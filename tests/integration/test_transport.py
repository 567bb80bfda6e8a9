"""Both transports write one-sidedly into memory registered by a separate process."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from shared.transport import TransferError, Transport, create_transport
from infra.receiver import ReceiverProcess

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

NBYTES = 1 << 20


@pytest.fixture(params=["mooncake", "nixl"])
def transport_name(request) -> str:
    return request.param


@pytest.fixture
def sender(transport_name):
    t = create_transport(transport_name, receives=False)  # as the prefill's sender runs it
    src = np.random.default_rng(0).integers(0, 256, NBYTES, dtype=np.uint8)
    t.register(src.ctypes.data, NBYTES)
    yield t, src
    t.unregister(src.ctypes.data)
    t.close()


def test_transport_satisfies_interface(sender):
    t, _ = sender
    assert isinstance(t, Transport)
    assert t.name in ("mooncake", "nixl")
    assert t.endpoint
    assert (t.metadata_b64 != "") == (t.name == "nixl")


def test_scattered_writes_land_exactly(sender, transport_name, tmp_path):
    t, src = sender
    rx = ReceiverProcess(transport_name, NBYTES, fill=0xAB)
    try:
        base = src.ctypes.data
        # Three regions, one pair adjacent on both sides (coalesced by mooncake), one gap.
        ops = [(base, rx.addr, 4096), (base + 4096, rx.addr + 4096, 8192),
               (base + 65536, rx.addr + 200_000, 100_000)]
        t.write(rx.endpoint, ops, rx.metadata_b64, timeout_s=10)
        got = np.frombuffer(rx.read(str(tmp_path / "dump")), dtype=np.uint8)
        want = np.full(NBYTES, 0xAB, dtype=np.uint8)
        want[0:12288] = src[0:12288]
        want[200_000:300_000] = src[65536:165536]
        assert np.array_equal(got, want)
        # A second write to the same receiver reuses the connection.
        t.write(rx.endpoint, [(base, rx.addr, NBYTES)], rx.metadata_b64, timeout_s=10)
        assert rx.sha256(0, NBYTES) == hashlib.sha256(src.tobytes()).hexdigest()
    finally:
        rx.close()


def test_write_to_receiver_gone_raises(sender, transport_name):
    t, src = sender
    rx = ReceiverProcess(transport_name, NBYTES)
    t.write(rx.endpoint, [(src.ctypes.data, rx.addr, 4096)], rx.metadata_b64, timeout_s=10)
    rx.kill()
    rx.close()
    with pytest.raises(TransferError):
        t.write(rx.endpoint, [(src.ctypes.data, rx.addr, 4096)], rx.metadata_b64, timeout_s=10)
    if transport_name == "mooncake":
        # It had written there before, so it tried once more on a fresh engine (the receiver might
        # have restarted on the same port); that engine holds the same regions and writes on.
        assert t.engine_restarts == 1
    rx2 = ReceiverProcess(transport_name, NBYTES)
    try:
        t.write(rx2.endpoint, [(src.ctypes.data, rx2.addr, 4096)], rx2.metadata_b64, timeout_s=10)
        assert rx2.sha256(0, 4096) == hashlib.sha256(src[:4096].tobytes()).hexdigest()
    finally:
        rx2.close()


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="unknown transport"):
        create_transport("carrier-pigeon")


def test_write_to_endpoint_never_reached_raises(sender, transport_name):
    """No receiver ever listened there: an error, never a hang or a crash."""
    t, src = sender
    if transport_name == "mooncake":
        endpoint, metadata = "127.0.0.1:1", ""
    else:
        rx = ReceiverProcess("nixl", NBYTES)
        endpoint, metadata = rx.endpoint, rx.metadata_b64
        rx.kill()
        rx.close()
    with pytest.raises(TransferError):
        t.write(endpoint, [(src.ctypes.data, 1 << 30, 4096)], metadata, timeout_s=10)


@pytest.mark.parametrize("timeout_s", [1.0, 60.0])  # polled deadline / one blocking batch
def test_mooncake_both_write_paths_land(timeout_s, tmp_path):
    t = create_transport("mooncake")
    src = np.arange(NBYTES, dtype=np.uint32).view(np.uint8)[:NBYTES].copy()
    t.register(src.ctypes.data, NBYTES)
    rx = ReceiverProcess("mooncake", NBYTES)
    try:
        base = src.ctypes.data
        ops = [(base + i * 65536, rx.addr + i * 131072, 65536) for i in range(4)]
        t.write(rx.endpoint, ops, timeout_s=timeout_s)
        got = np.frombuffer(rx.read(str(tmp_path / "d")), dtype=np.uint8)
        for i in range(4):
            assert np.array_equal(got[i * 131072: i * 131072 + 65536], src[i * 65536: (i + 1) * 65536])
    finally:
        rx.close()
        t.unregister(src.ctypes.data)
        t.close()


def test_receiver_that_cannot_start_says_it_exited():
    """A receiver process that dies before its hello is reported at once with its exit code, not as a
    receiver that did not answer in time."""
    with pytest.raises(RuntimeError, match=r"closed its output without answering \(exit code 2\)"):
        ReceiverProcess("no-such-transport", NBYTES, start_timeout_s=600)
