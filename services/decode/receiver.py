"""The decode node's receiving side: each slot's receive buffer (its KV cache memory) registered
with the transport once, at start, and advertised.

Contract: ``Receiver(transport, buffers)`` registers every slot buffer (a uint8 tensor per slot)
once and advertises ``endpoint``, ``metadata_b64`` and ``slot_targets()``;
``slot_reader(slot)`` reads a slot's bytes by range (for checksums: host memory without copies,
device memory one range at a time); ``check_kv(msg, layout, require_checksum)`` says why the KV a
``KvReady`` announces must not be injected (its segment checksums do not match the slot's bytes,
or it has none and they are required), in worker threads; ``close()`` unregisters. Which lease a
slot serves is the slot core's business (slots.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from shared.events import KvLayoutSpec, KvReady, SlotTarget
from shared.kvchecksum import CHECKSUM_FAILED, CHECKSUM_MISSING, Reader, host_reader, verify
from shared.kvlayout import write_ranges


class Receiver:
    """Registers each slot's receive buffer with the transport once and advertises it."""

    def __init__(self, transport, buffers: list, num_checksum_threads: int = 4) -> None:
        self.transport = transport
        self._checksum_pool = ThreadPoolExecutor(num_checksum_threads, "kv-checksum")
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

    def check_kv(self, msg: KvReady, layout: KvLayoutSpec, require_checksum: bool) -> tuple[str, str]:
        """(reason, detail): why the announced KV must not be injected, ("", "") when it may, or
        when the slot core refuses it anyway (a slot or size out of range). Blocks: run it in a
        worker thread."""
        if not 0 <= msg.slot < len(self.buffers) or not 0 < msg.num_tokens <= layout.max_tokens:
            return "", ""
        if not msg.kv_checksums:
            return (CHECKSUM_MISSING, "no checksums") if require_checksum else ("", "")
        detail = verify(self.slot_reader(msg.slot), write_ranges(layout, msg.num_tokens),
                        msg.kv_checksums, msg.kv_checksum_algo, self._checksum_pool)
        return (CHECKSUM_FAILED, detail) if detail else ("", "")

    def close(self) -> None:
        self._checksum_pool.shutdown(wait=False)
        for addr, _ in self.buffers:
            try:
                self.transport.unregister(addr)
            except Exception:
                pass
        self.transport.close()
