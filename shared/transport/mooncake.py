"""Mooncake Transfer Engine behind the :class:`shared.transport.Transport` interface.

P2P handshake (no metadata server): the engine listens on an RPC port and the session id
``"host:port"`` is what remote writers address. Writes are coalesced; when the caller's
``timeout_s`` is at least the engine's own transfer timeout (``MC_TRANSFER_TIMEOUT``, s, read at
start, default 30) they go out as one blocking batch (the GIL is released for the whole
transfer, which matters inside a busy vLLM process); a shorter deadline is enforced by submitting
the ops and polling them.

A writer's engine caches each receiver's segment descriptor (its buffers and TCP data port) under
the receiver's ``host:port`` for its whole life and never refreshes it, even when writes fail. A
receiver that restarts and happens to get the same RPC port (random in ``MC_MIN_PRC_PORT`` ..
``MC_MAX_PRC_PORT``, 15000-17000 by default; or pinned by an operator) would then be unreachable
from that writer for good. So when a write fails to an endpoint this engine has written to before,
the transport starts a fresh engine (registering the same regions) and tries once more within the
same deadline: a receiver that restarted gets its writes again; one that is really gone fails again,
and its stale descriptor has gone with the old engine. Receivers never write, so their engine (and
the endpoint they advertise) never changes.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from shared.transport import TransferError

log = logging.getLogger(__name__)

def coalesce(ops: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ops whose local and remote ranges both continue the previous op; drop empty ops."""
    merged: list[tuple[int, int, int]] = []
    for local, remote, n in ops:
        if n <= 0:
            continue
        if merged:
            pl, pr, pn = merged[-1]
            if pl + pn == local and pr + pn == remote:
                merged[-1] = (pl, pr, pn + n)
                continue
        merged.append((local, remote, n))
    return merged


# transfer_check_status results
_DONE, _PENDING = 1, 0


class MooncakeTransport:
    """One Mooncake TransferEngine instance."""

    name = "mooncake"
    metadata_b64 = ""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 engine_factory=None) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol {protocol!r}: use 'rdma' or 'tcp'")
        self._host, self.protocol, self._device_name = host, protocol, device_name
        self._engine_factory = engine_factory or _mooncake_engine
        self._engine = self._start_engine()
        self._written: set[str] = set()  # endpoints the current engine has written to
        self.engine_timeout_s = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30") or 30)
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.engine_restarts = 0

    def _start_engine(self):
        engine = self._engine_factory()
        rc = engine.initialize(self._host, "P2PHANDSHAKE", self.protocol, self._device_name)
        if rc != 0:
            raise TransferError(
                f"mooncake initialize({self._host!r}, P2PHANDSHAKE, {self.protocol!r}) returned {rc}")
        return engine

    @property
    def endpoint(self) -> str:
        """``host:port`` remote writers address (a receiver's engine never changes; see the module)."""
        return f"{self._host}:{self._engine.get_rpc_port()}"

    @property
    def transfer_engine(self):
        """The bare mooncake TransferEngine (a benchmark's baseline); transfers go through ``write``."""
        return self._engine

    def register(self, addr: int, nbytes: int) -> None:
        """Register a buffer with the engine (local source or target of remote writes)."""
        with self._lock:
            if addr in self._regions:
                raise ValueError(f"region at {addr:#x} is already registered")
            _register(self._engine, addr, nbytes)
            self._regions[addr] = nbytes

    def unregister(self, addr: int) -> None:
        """Unregister a buffer registered with :meth:`register`."""
        with self._lock:
            if self._regions.pop(addr, None) is None:
                return
            self._engine.unregister_memory(addr)

    def write(
        self,
        remote_endpoint: str,
        ops: list[tuple[int, int, int]],
        remote_metadata_b64: str = "",
        timeout_s: float = 30.0,
    ) -> None:
        """One-sided writes; returns when every op has landed, raises TransferError otherwise."""
        ops = coalesce(ops)
        if not ops:
            return
        deadline = time.monotonic() + timeout_s
        engine = self._engine
        try:
            self._write(engine, remote_endpoint, ops, timeout_s)
        except TransferError as exc:
            if not self._restart_if_stale(engine, remote_endpoint):
                raise
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise
            log.warning("mooncake write to %s failed (%s) with a descriptor cached from an earlier "
                        "write; trying again on a fresh engine (the receiver may have restarted on "
                        "the same port)", remote_endpoint, exc)
            engine = self._engine
            self._write(engine, remote_endpoint, ops, left_s)
        if remote_endpoint not in self._written:  # the lock only for a receiver's first write
            with self._lock:
                if engine is self._engine:
                    self._written.add(remote_endpoint)

    def _restart_if_stale(self, failed_engine, remote_endpoint: str) -> bool:
        """After ``failed_engine`` failed a write to ``remote_endpoint``: True if a retry should go to
        a fresh engine (which this starts unless another thread already has)."""
        with self._lock:
            if self._closed:
                return False
            if failed_engine is not self._engine:
                return True  # another writer replaced it meanwhile
            if remote_endpoint not in self._written:
                return False  # nothing cached from an earlier write: the receiver is just not there
            try:
                engine = self._start_engine()
                for addr, nbytes in self._regions.items():
                    _register(engine, addr, nbytes)
            except TransferError as exc:
                log.error("mooncake: could not start a fresh engine (%s); keeping the current one", exc)
                return False
            self._engine, self._written = engine, set()
            self.engine_restarts += 1
            return True

    def _write(self, engine, remote_endpoint: str, ops: list[tuple[int, int, int]], timeout_s: float) -> None:
        nbytes = sum(op[2] for op in ops)
        if timeout_s >= self.engine_timeout_s:
            rc = engine.batch_transfer_sync_write(
                remote_endpoint, [op[0] for op in ops], [op[1] for op in ops], [op[2] for op in ops])
            if rc != 0:
                raise TransferError(f"mooncake write of {nbytes} bytes to {remote_endpoint} failed "
                                    f"(rc {rc}): receiver gone, unreachable or stalled for "
                                    f"{self.engine_timeout_s:.0f} s")
            return
        # One single-op batch per (coalesced) op: transfer_check_status reports one task per batch.
        pending = []
        for local, remote, n in ops:
            batch_id = engine.transfer_submit_write(remote_endpoint, local, remote, n)
            # Batch ids are pointers: 0 (or negative) means the submit failed, e.g. the peer's
            # segment could not be opened; polling such an id crashes the engine.
            if batch_id is None or batch_id <= 0:
                raise TransferError(
                    f"mooncake could not submit a write to {remote_endpoint} (rc {batch_id}): "
                    "is the receiver running and its memory registered?", settle=_settler(engine, pending)
                )
            pending.append(batch_id)
        deadline = time.monotonic() + timeout_s
        delay_s = 20e-6
        while pending:
            still = []
            for i, batch_id in enumerate(pending):
                status = engine.transfer_check_status(batch_id)
                if status == _PENDING:
                    still.append(batch_id)
                elif status != _DONE:
                    what = "timed out inside mooncake" if status == -2 else "failed"
                    raise TransferError(
                        f"mooncake write of {nbytes} bytes to {remote_endpoint} {what} (status {status})",
                        settle=_settler(engine, still + pending[i + 1:]))
            pending = still
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TransferError(
                    f"mooncake write of {nbytes} bytes to {remote_endpoint} did not complete "
                    f"within {timeout_s:.1f} s", settle=_settler(engine, pending)
                )
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 1e-3)

    def close(self) -> None:
        """Unregister every region; the engine itself is released with the object."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for addr in list(self._regions):
                self._engine.unregister_memory(addr)
            self._regions.clear()


def _settler(engine, batch_ids: list[int]):
    """TransferError.settle for batches a write left in flight: True once none is pending."""
    def settle(timeout_s: float) -> bool:
        pending, deadline = list(batch_ids), time.monotonic() + timeout_s
        while True:
            pending = [b for b in pending if engine.transfer_check_status(b) == _PENDING]
            if not pending:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
    return settle if batch_ids else None


def _register(engine, addr: int, nbytes: int) -> None:
    rc = engine.register_memory(addr, nbytes)
    if rc != 0:
        raise TransferError(f"mooncake register_memory({addr:#x}, {nbytes}) returned {rc}")


def _mooncake_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise TransferError(
            f"mooncake is not importable ({exc}): pip install mooncake-transfer-engine "
            "(-non-cuda on CPU hosts) and apt-get install libibverbs1"
        ) from exc
    return TransferEngine()
