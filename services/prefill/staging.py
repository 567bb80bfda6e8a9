"""Staging slots: the pool of registered memory the worker copies claimed KV into.

Two parts:
- ``SlotStates``: one byte per slot in a small shared file (``stats_path``), so the scheduler side
  (which hands out slots) and the worker side (which frees them when its write is over) agree
  without a round trip, and anyone can check for leaks: ``read_stats(path)``. States: FREE (0),
  RESERVED (1, given to a request by the scheduler), SENDING (2, staged by the worker, write in
  flight). Only the scheduler moves FREE -> RESERVED; only the worker moves a slot back to FREE.
  After the slot bytes come 64-bit counters, each written by one side only: ``claimed``,
  ``not_handed_off``, ``decode_started`` (decodes the prefill started itself: scheduler),
  ``kv_ready``, ``kv_failed`` (worker).
- ``StagingPool``: the memory, ``num_slots`` x the native layout (shared.kvlayout) of
  ``max_tokens`` tokens, with per-slot, per-segment tensor views. On the KV cache's GPU
  (``device="cuda:N"``: extraction is a device-to-device gather, the transport writes GPU to GPU)
  or in pinned host memory (``device="cpu"``). Copies into a GPU slot are queued on the
  extracting thread's CUDA stream: ``fence(slot)`` (that thread, after staging) marks them, and
  ``wait_staged(slot)`` (the sender's thread, before writing) blocks until they are done, so a
  write never reads a slot still being filled.

No vLLM imports; torch only for the pool.
"""

from __future__ import annotations

import mmap
import os
import threading

FREE, RESERVED, SENDING = 0, 1, 2
STATE_NAMES = {FREE: "free", RESERVED: "reserved", SENDING: "sending"}
COUNTERS = ("claimed", "not_handed_off", "kv_ready", "kv_failed", "decode_started")


def _file_size(num_slots: int) -> int:
    return num_slots + 8 * len(COUNTERS)


class SlotStates:
    """Slot states in a shared file; ``create=True`` (re)initializes every slot to FREE."""

    def __init__(self, path: str, num_slots: int, create: bool = False) -> None:
        self.path = path
        self.num_slots = num_slots
        flags = os.O_RDWR | os.O_CREAT
        fd = os.open(path, flags, 0o600)
        try:
            size = _file_size(num_slots)
            if create or os.fstat(fd).st_size != size:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._count_lock = threading.Lock()

    def reserve(self) -> int | None:
        """Scheduler: take the first free slot (FREE -> RESERVED), or None when all are busy."""
        for slot in range(self.num_slots):
            if self._map[slot] == FREE:
                self._map[slot] = RESERVED
                return slot
        return None

    def set(self, slot: int, state: int) -> None:
        self._map[slot] = state

    def get(self, slot: int) -> int:
        return self._map[slot]

    def count(self, counter: str, n: int = 1) -> None:
        """Add to one counter (each counter has a single writer process)."""
        off = self.num_slots + 8 * COUNTERS.index(counter)
        with self._count_lock:
            value = int.from_bytes(self._map[off : off + 8], "little") + n
            self._map[off : off + 8] = value.to_bytes(8, "little")

    def snapshot(self) -> list[int]:
        return list(self._map[: self.num_slots])

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass


def read_stats(path: str) -> dict:
    """A running prefill's staging slots and counters: {"total", "free", "reserved", "sending",
    "claimed", "not_handed_off", "kv_ready", "kv_failed", "decode_started"}."""
    with open(path, "rb") as f:
        data = f.read()
    num_slots = len(data) - 8 * len(COUNTERS)
    states = data[:num_slots]
    stats = {"total": num_slots}
    for value, name in STATE_NAMES.items():
        stats[name] = states.count(bytes([value]))
    for i, name in enumerate(COUNTERS):
        off = num_slots + 8 * i
        stats[name] = int.from_bytes(data[off : off + 8], "little")
    return stats


class StagingPool:
    """``num_slots`` slots of ``spec.slot_nbytes`` bytes, each viewed per segment of the layout."""

    def __init__(self, spec, num_slots: int, device: str = "cpu") -> None:
        import torch

        from shared.kvlayout import DTYPE_SIZES, FP8_DTYPES

        self.spec = spec
        self.num_slots = num_slots
        # an FP8 layout is vLLM's FP8 cache bytes: staged as uint8, as vLLM registers those caches
        self.dtype = torch.uint8 if spec.dtype in FP8_DTYPES else getattr(torch, spec.dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.buffer = torch.zeros(num_slots, spec.slot_nbytes, dtype=torch.uint8, device=self.device)
        else:  # host memory, pinned where CUDA exists (GPU -> staging copies are DMA)
            self.buffer = torch.zeros(num_slots, spec.slot_nbytes, dtype=torch.uint8,
                                      pin_memory=torch.cuda.is_available())
        self.addr = self.buffer.data_ptr()
        self.nbytes = self.buffer.numel()
        self._elt = DTYPE_SIZES[spec.dtype]
        self._staged: dict[int, object] = {}  # slot -> CUDA event after its staging copies

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def fence(self, slot: int) -> None:
        """Mark the end of the staging copies queued so far on this thread's CUDA stream (no-op
        for host staging, where the copies are done when they return)."""
        if self.on_gpu:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._staged[slot] = event

    def wait_staged(self, slot: int) -> None:
        """Block until the copies ``fence(slot)`` marked have finished."""
        event = self._staged.pop(slot, None)
        if event is not None:
            event.synchronize()

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.spec.slot_nbytes

    def slot_bytes(self, slot: int):
        """A host slot's bytes as a numpy uint8 array (a view, no copy)."""
        return self.buffer[slot].numpy()

    def slot_reader(self, slot: int):
        """``read(offset, nbytes)`` of one slot (shared.kvchecksum): host staging without copies,
        GPU staging one range at a time."""
        from shared.kvchecksum import host_reader

        row = self.buffer[slot]
        if not self.on_gpu:
            return host_reader(row.numpy())
        return lambda offset, nbytes: row[offset : offset + nbytes].cpu().numpy()

    def flip_byte(self, slot: int, offset: int) -> None:
        """Invert one byte of a slot (fault injection)."""
        self.buffer[slot][offset] ^= 0xFF

    def segment_views(self, slot: int, num_tokens: int) -> list:
        """Per segment, a [num_tokens, elems_per_token] view into the slot."""
        row = self.buffer[slot]
        views = []
        for seg in self.spec.segments:
            nbytes = num_tokens * seg.bytes_per_token
            part = row[seg.offset_bytes : seg.offset_bytes + nbytes]
            views.append(part.view(self.dtype).view(num_tokens, seg.bytes_per_token // self._elt))
        return views
