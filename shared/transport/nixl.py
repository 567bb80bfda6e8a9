"""NIXL (UCX backend) behind the :class:`shared.transport.Transport` interface.

The endpoint is the agent name; ``metadata_b64`` is the agent metadata (base64), refreshed after
every registration, which a receiver advertises and a writer loads before its first write to that
agent (and again when the advertised metadata changes, e.g. after the receiver restarted).
Memory is host DRAM (``mem_type="DRAM"``) or GPU memory (``"VRAM"`` of CUDA device ``device_id``);
both sides of a write use the same kind, and a remote VRAM slot is device 0 of its node.

A writer waits for its transfer by polling NIXL. For the first ``SPIN_S`` it only yields between
polls (``sched_yield``: the GIL and the core go to whoever wants them, no timer is involved), since
a GPU-to-GPU write of a whole prompt takes about a millisecond to a few, and a sleep can last far
longer than asked on a busy or virtualised host; after that it sleeps between polls, at most
``POLL_MAX_S``, so a slow network write does not hold a core.

A finished transfer's handle is kept, per remote agent and exact ops, and posted again by the next
write of the same ops (NIXL reposts a completed request), so such a write is only post and poll:
no descriptor lists, no request creation, no release on the write's path. At most
``MAX_CACHED_XFERS`` handles are kept (least recently used goes first). The handles of a remote
agent are released when its advertised metadata changes (the receiver restarted), when a write to
it fails, and every handle when a local region is registered or deregistered; a handle is used by
one write at a time. ``last_write`` says how the last completed write spent its time (benchmarks).
"""

from __future__ import annotations

import base64
import os
from collections import OrderedDict
import threading
import time
import uuid

from shared.transport import TransferError

SPIN_S = 0.02  # polls only yield this long into a transfer, then sleep between polls
POLL_MAX_S = 50e-6  # the longest sleep between two polls of a transfer in flight
MAX_CACHED_XFERS = 64  # finished transfer handles kept for reposting
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class NixlTransport:
    """One NIXL agent with the UCX backend."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, mem_type: str = "DRAM", device_id: int = 0,
                 receives: bool = True) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # it logs to stdout otherwise
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise TransferError(f"nixl is not importable ({exc}): pip install nixl") from exc
        self.endpoint = agent_name or f"xl-{uuid.uuid4().hex[:12]}"
        # NIXL's progress thread polls UCX with a zero timeout: it holds a core even when idle.
        # Only a receiver needs it (UCX over TCP lands remote writes when the target progresses);
        # a writer progresses UCX itself while it waits for its transfer (check_xfer_state).
        self._agent = nixl_agent(self.endpoint, nixl_agent_config(enable_prog_thread=receives,
                                                                  backends=["UCX"]))
        self._mem_type = mem_type
        self._device_id = device_id
        self._regions: dict[int, object] = {}  # addr -> reg descs
        self._remotes: dict[str, str] = {}  # agent name -> metadata b64 loaded
        self._epochs: dict[str, int] = {}  # agent name -> times (re)loaded or forgotten
        self._xfers: OrderedDict[tuple, object] = OrderedDict()  # (agent, ops) -> idle handle
        self._local_epoch = 0  # times a local region was registered or deregistered
        self.last_write: dict = {}  # the last completed write: bytes, kept handle?, post and wait ms
        self._lock = threading.Lock()
        self.metadata_b64 = self._metadata()

    def _metadata(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")

    def register(self, addr: int, nbytes: int) -> None:
        """Register a buffer with the UCX backend and refresh :attr:`metadata_b64`."""
        with self._lock:
            if addr in self._regions:
                raise ValueError(f"region at {addr:#x} is already registered")
            self._drop_xfers()
            descs = self._agent.register_memory([(addr, nbytes, self._device_id, "")], self._mem_type)
            self._regions[addr] = descs
            self.metadata_b64 = self._metadata()

    def unregister(self, addr: int) -> None:
        """Deregister a buffer registered with :meth:`register`."""
        with self._lock:
            descs = self._regions.pop(addr, None)
            if descs is not None:
                self._drop_xfers()
                self._agent.deregister_memory(descs)
                self.metadata_b64 = self._metadata()

    def _ensure_remote(self, remote: str, metadata_b64: str) -> None:
        loaded = self._remotes.get(remote)
        if loaded is not None and (not metadata_b64 or loaded == metadata_b64):
            return
        if not metadata_b64:
            raise TransferError(f"no NIXL metadata for agent {remote!r}: the receiver must advertise it")
        if loaded is not None:
            self._drop_xfers(remote)
            self._agent.remove_remote_agent(remote)
            self._remotes.pop(remote, None)
        self._epochs[remote] = self._epochs.get(remote, 0) + 1
        name = self._agent.add_remote_agent(base64.b64decode(metadata_b64))
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != remote:
            self._agent.remove_remote_agent(name)
            raise TransferError(f"NIXL metadata is for agent {name!r}, not {remote!r}")
        self._remotes[remote] = metadata_b64

    def write(
        self,
        remote_endpoint: str,
        ops: list[tuple[int, int, int]],
        remote_metadata_b64: str = "",
        timeout_s: float = 30.0,
    ) -> None:
        """One-sided WRITE of every op; returns when done, raises TransferError otherwise."""
        ops = tuple(op for op in ops if op[2] > 0)
        if not ops:
            return
        nbytes = sum(op[2] for op in ops)
        key = (remote_endpoint, ops)
        handle = None
        try:
            with self._lock:
                self._ensure_remote(remote_endpoint, remote_metadata_b64)
                epoch = (self._epochs.get(remote_endpoint, 0), self._local_epoch)
                handle = self._xfers.pop(key, None)  # this write's alone until it is put back
            kept = handle is not None
            if kept:
                posted = time.perf_counter()
                try:
                    state = self._agent.transfer(handle)
                except Exception:
                    state = "ERR"
                if state == "ERR":  # a kept request refused again: one new request decides
                    self._release(handle)
                    handle, kept = None, False
            if handle is None:
                local = self._agent.get_xfer_descs([(a, n, self._device_id) for a, _, n in ops], self._mem_type)
                remote = self._agent.get_xfer_descs([(r, n, 0) for _, r, n in ops], self._mem_type)  # device 0 there
                handle = self._agent.initialize_xfer("WRITE", local, remote, remote_endpoint)
                posted = time.perf_counter()
                state = self._agent.transfer(handle)
            start = time.monotonic()
            post_ms = (time.perf_counter() - posted) * 1e3
            spin_until, deadline = start + SPIN_S, start + timeout_s
            delay_s = 20e-6
            while state == "PROC":
                t = time.monotonic()
                if t > deadline:  # still in flight: the handle is the settle's to release once it has ended
                    inflight, handle = handle, None
                    raise TransferError(
                        f"nixl write of {nbytes} bytes to {remote_endpoint} did not complete "
                        f"within {timeout_s:.1f} s", settle=self._settler(inflight)
                    )
                if t < spin_until:
                    _yield()
                else:
                    time.sleep(delay_s)
                    delay_s = min(delay_s * 2, POLL_MAX_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"nixl write of {nbytes} bytes to {remote_endpoint} failed ({state})")
            self.last_write = {"nbytes": nbytes, "kept": kept, "post_ms": post_ms,
                               "wait_ms": (time.perf_counter() - posted) * 1e3 - post_ms}
            with self._lock:  # done: keep it for the next write of the same ops to this agent
                if (self._epochs.get(remote_endpoint, 0), self._local_epoch) == epoch and key not in self._xfers:
                    self._xfers[key] = handle
                    handle = None
                    while len(self._xfers) > MAX_CACHED_XFERS:
                        self._release(self._xfers.popitem(last=False)[1])
        except TransferError:
            self._forget(remote_endpoint)
            raise
        except Exception as exc:  # nixl raises its own error types (e.g. remote disconnect)
            self._forget(remote_endpoint)
            raise TransferError(f"nixl write to {remote_endpoint} failed: {exc}") from exc
        finally:
            if handle is not None:
                self._release(handle)

    def _settler(self, handle):
        """TransferError.settle for a write given up while in flight: True once NIXL no longer reports it in
        progress (done, or failed: the writer forgot the agent, which ends its requests), and then its
        handle is released; False while it still is."""
        def settle(timeout_s: float) -> bool:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:  # the request is gone with its agent
                    state = "ERR"
                if state != "PROC":
                    self._release(handle)
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_MAX_S * 20)

        return settle

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # an in-flight handle that cannot be cancelled is left to NIXL
            pass

    def _drop_xfers(self, remote: str | None = None) -> None:
        """Release the kept handles (of one remote agent, or all); under ``_lock``."""
        if remote is None:
            self._local_epoch += 1
        for key in [k for k in self._xfers if remote is None or k[0] == remote]:
            self._release(self._xfers.pop(key))

    def _forget(self, remote: str) -> None:
        with self._lock:
            self._drop_xfers(remote)
            self._epochs[remote] = self._epochs.get(remote, 0) + 1
            if self._remotes.pop(remote, None) is not None:
                try:
                    self._agent.remove_remote_agent(remote)
                except Exception:
                    pass

    def close(self) -> None:
        """Forget remote agents and deregister every region."""
        with self._lock:
            self._drop_xfers()
            for remote in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(remote)
                except Exception:
                    pass
            self._remotes.clear()
            for descs in self._regions.values():
                self._agent.deregister_memory(descs)
            self._regions.clear()
