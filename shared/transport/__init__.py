"""One small interface for one-sided bulk writes of KV state: Mooncake Transfer Engine or NIXL.

Contract (the prefill sender writes, the decode node only registers and advertises):

    t = create_transport("mooncake", host="10.0.0.5", protocol="rdma")   # or "nixl"
    t.register(addr, nbytes)          # once, at start, for every buffer written from or into
                                      # (device="cuda[:i]" at creation: the buffers are GPU memory)
    t.endpoint, t.metadata_b64        # what the receiver advertises (NodeAvailable / TransferTarget)
    t.write(remote_endpoint, [(local_addr, remote_addr, nbytes), ...], remote_metadata_b64, timeout_s)
    t.close()

``write`` blocks until every op has landed in the remote memory or raises :class:`TransferError`
(remote gone, timeout, bad address); it never returns with part of the data in flight unreported.
The receiver learns of completion only from the KV-ready event the writer publishes afterwards.

- Mooncake: P2P handshake, no metadata server; ``protocol="rdma"`` in production, ``"tcp"`` where
  there is no RDMA NIC (the same API; "rdma" without HCAs silently falls back to TCP). The endpoint
  is the session id ``"host:rpc_port"``; ``metadata_b64`` is "".
- NIXL (UCX backend): the endpoint is the agent name; ``metadata_b64`` is the agent metadata, taken
  after registration; a writer loads it once per remote agent (again when it changes). GPU memory
  is registered as VRAM of the process's CUDA device (``device``); a remote slot is addressed as
  device 0 of its node, the one GPU a decode node sees. Between two GPUs of one host UCX writes
  over CUDA IPC (NVLink where the GPUs have it).
- Mooncake tells host from GPU memory itself at registration (its CUDA build).

Both are imported lazily, so importing this package needs neither library.
"""

from __future__ import annotations

from collections.abc import Callable

from typing import Protocol, runtime_checkable

__all__ = ["TransferError", "Transport", "create_transport", "TRANSPORTS"]

TRANSPORTS = ("mooncake", "nixl")


class TransferError(Exception):
    """A one-sided write did not complete (remote gone, timeout, unregistered memory).

    ``settle``: set where the write gave up with parts of it still in flight (they go on reading
    the local buffer and writing the remote one): ``settle(timeout_s) -> bool`` waits up to
    ``timeout_s`` for them to end and says whether they did. Until then neither buffer may be
    reused."""

    def __init__(self, message: str, settle: Callable[[float], bool] | None = None) -> None:
        super().__init__(message)
        self.settle = settle


@runtime_checkable
class Transport(Protocol):
    """A registered-memory endpoint able to write one-sidedly into remote registered memory."""

    name: str  # "mooncake" | "nixl"
    endpoint: str  # what a remote writer addresses
    metadata_b64: str  # nixl agent metadata; "" for mooncake

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr + nbytes)`` for transfers (local source or remote target)."""
        ...

    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` for the region starting at ``addr``."""
        ...

    def write(
        self,
        remote_endpoint: str,
        ops: list[tuple[int, int, int]],
        remote_metadata_b64: str = "",
        timeout_s: float = 30.0,
    ) -> None:
        """Write every ``(local_addr, remote_addr, nbytes)`` op; block until done; raise TransferError."""
        ...

    def close(self) -> None:
        """Release the engine / agent and every registration."""
        ...


def create_transport(
    name: str,
    *,
    host: str = "127.0.0.1",
    protocol: str = "tcp",
    agent_name: str | None = None,
    receives: bool = True,
    device: str = "cpu",
) -> Transport:
    """Build a transport by name: "mooncake" (``host``, ``protocol``) or "nixl" (``agent_name``).

    ``receives=False`` for a transport that only writes (the prefill's sender): it then keeps no
    background progress thread (NIXL's polls without pause and would hold a core while idle).
    ``device``: where the buffers it registers live ("cpu", "cuda", "cuda:1")."""
    if name == "mooncake":
        from shared.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host=host, protocol=protocol)
    if name == "nixl":
        from shared.transport.nixl import NixlTransport

        kind, _, index = str(device).partition(":")
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"transport device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        return NixlTransport(agent_name=agent_name, receives=receives,
                             mem_type="VRAM" if kind == "cuda" else "DRAM",
                             device_id=int(index) if index else 0)
    raise ValueError(f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")
