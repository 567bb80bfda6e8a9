"""A NIXL writer reposts its kept transfer handle for the same ops: every write lands its bytes anew,
also after the receiver restarted under the same agent name (new metadata, new handles)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from infra.receiver import ReceiverProcess
from shared.transport import create_transport

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

NBYTES = 1 << 16


def test_reposted_writes_land_every_time_and_survive_a_receiver_restart():
    t = create_transport("nixl", receives=False)
    src = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    t.register(src.ctypes.data, NBYTES)
    want = hashlib.sha256(src.tobytes()).hexdigest()
    rx = ReceiverProcess("nixl", NBYTES, agent_name="xl-repost-rx")
    try:
        ops = [(src.ctypes.data, rx.addr, NBYTES // 2), (src.ctypes.data + NBYTES // 2, rx.addr + NBYTES // 2,
                                                         NBYTES // 2)]
        for fill in (1, 2):
            rx.fill(fill)
            t.write(rx.endpoint, ops, rx.metadata_b64, timeout_s=10)
            assert rx.sha256(0, NBYTES) == want
        assert len(t._xfers) == 1  # one handle, posted twice
        rx.close()
        rx = ReceiverProcess("nixl", NBYTES, agent_name="xl-repost-rx")  # restarted: same name
        ops = [(src.ctypes.data, rx.addr, NBYTES)]
        t.write(rx.endpoint, ops, rx.metadata_b64, timeout_s=10)
        assert rx.sha256(0, NBYTES) == want
    finally:
        rx.close()
        t.unregister(src.ctypes.data)
        t.close()
