"""The decode node's receiving side: each slot's receive buffer (its KV cache memory) registered
with the transport once, at start, and advertised.

Contract: ``Receiver(transport, buffers)`` registers every slot buffer (a uint8 tensor per slot)
once and advertises ``endpoint``, ``metadata_b64`` and ``slot_targets()``;
``slot_reader(slot)`` reads a slot's bytes by range (for checksums: host memory without copies,
device memory one range at a time); ``close()`` unregisters. Which lease a slot serves is the slot
core's business (slots.py).
"""

from __future__ import annotations

from shared.events import SlotTarget
from shared.kvchecksum import Reader, host_reader


class Receiver:
    """Registers each slot's receive buffer with the transport once and advertises it."""

    def __init__(self, transport, buffers: list) -> None:
        self.transport = transport
        self._tensors = list(buffers)
        self.buffers = [(b.data_ptr(), b.numel()) for b in buffers]  # (addr, nbytes) per slot
        for addr, nbytes in self.buffers:
            transport.register(addr, nbytes)

    @property
    def name(self) -> str:
        return self.transport.name

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    @property
    def metadata_b64(self) -> str:
        return self.transport.metadata_b64

    def slot_targets(self) -> list[SlotTarget]:
        return [SlotTarget(slot=i, base_addr=a, nbytes=n) for i, (a, n) in enumerate(self.buffers)]

    def slot_reader(self, slot: int) -> Reader:
        """``read(offset, nbytes)`` of one slot's receive buffer."""
        buf = self._tensors[slot]
        if buf.device.type == "cpu":
            return host_reader(buf.numpy())
        return lambda offset, nbytes: buf[offset : offset + nbytes].cpu().numpy()

    def close(self) -> None:
        for addr, _ in self.buffers:
            try:
                self.transport.unregister(addr)
            except Exception:
                pass
        self.transport.close()
