"""Staging slots: the pool of registered memory the worker copies claimed KV into.

Its parts:
- ``SlotStates``: one byte per slot in a small shared file (``stats_path``), so the scheduler side
  (which hands out slots) and the worker side (which frees them when its write is over) agree
  without a round trip, and anyone can check for leaks: ``read_stats(path)``. States: FREE (0),
  RESERVED (1, given to a request by the scheduler), SENDING (2, staged by the worker, write in
  flight). Only the scheduler moves FREE -> RESERVED; only the worker moves a slot back to FREE.
  After the slot bytes come 64-bit counters, each written by one side only: ``claimed``,
  ``not_handed_off``, ``decode_started`` (decodes the prefill started itself: scheduler),
  ``first_token_direct`` (first tokens the scheduler wrote on its own connection, not through
  the loop thread: scheduler),
  ``kv_ready``, ``kv_failed``, ``staging_slot_quarantined`` (slots kept SENDING for good: a failed
  write still read them after the sender's settle timeout) (worker).
- Tensor parallelism: each staging rank (services.prefill.parallel) has its own pool and its own
  state file, ``rank_path(path, rank)`` (rank 0's is ``path`` itself). The scheduler reserves
  through ``RankSlotStates``: a slot only while it is FREE on every rank, then on every rank at
  once, so no slot is reused before every rank's sender has freed it. ``read_stats(path)`` merges
  the ranks' files (a slot's state is its busiest rank's; counters add up).
- ``StagingPool``: the memory, ``num_slots`` x the native layout (shared.kvlayout) of
  ``max_tokens`` tokens, with per-slot, per-segment tensor views. On the KV cache's GPU
  (``device="cuda:N"``: extraction is a device-to-device gather, the transport writes GPU to GPU)
  or in pinned host memory (``device="cpu"``). Copies into a GPU slot are queued on the
  extracting thread's CUDA stream: ``fence(slot)`` (that thread, after staging) marks them, and
  ``wait_staged(slot)`` (the sender's thread, before writing) blocks until they are done, so a
  write never reads a slot still being filled. A writer holding more KV heads than a decode rank
  (prefill TP < decode TP) packs that rank's heads into the slot's scratch area first
  (``scratch_addr``, ``pack_heads``; shared.kvlayout.staged_layout), so it writes whole segments.

No vLLM imports; torch only for the pool.
"""

from __future__ import annotations

import mmap
import os
import threading

FREE, RESERVED, SENDING = 0, 1, 2
STATE_NAMES = {FREE: "free", RESERVED: "reserved", SENDING: "sending"}
COUNTERS = ("claimed", "not_handed_off", "kv_ready", "kv_failed", "decode_started", "first_token_direct",
            "staging_slot_quarantined")


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


def rank_path(path: str, rank: int) -> str:
    """The state file of staging rank ``rank`` of a prefill whose rank 0 keeps its states in ``path``."""
    return path if rank == 0 else f"{path}.rank{rank}"


class RankSlotStates:
    """The scheduler's view of every staging rank's slot states (one file each, ``rank_path``).

    ``reserve`` takes a slot that is FREE on every rank and marks it RESERVED on every rank; each
    rank's worker frees its own word when its write is over, so a slot is handed out again only
    once every rank is done with it. Counters go to rank 0's file. ``create=True`` (re)initializes
    every rank's file and removes those of ranks beyond ``num_ranks`` (an earlier run's larger TP),
    so ``read_stats`` does not merge them."""

    def __init__(self, path: str, num_slots: int, num_ranks: int = 1, create: bool = False) -> None:
        self.num_slots = num_slots
        self.ranks = [SlotStates(rank_path(path, r), num_slots, create) for r in range(num_ranks)]
        self.path = path
        if create:
            stale = num_ranks
            while os.path.exists(rank_path(path, stale)):
                os.remove(rank_path(path, stale))
                stale += 1

    def reserve(self) -> int | None:
        """Scheduler: the first slot FREE on every rank, now RESERVED on every rank (None: all busy)."""
        for slot in range(self.num_slots):
            if all(r.get(slot) == FREE for r in self.ranks):
                for r in self.ranks:
                    r.set(slot, RESERVED)
                return slot
        return None

    def count(self, counter: str, n: int = 1) -> None:
        self.ranks[0].count(counter, n)

    def snapshot(self) -> list[int]:
        """Each slot's busiest state over the ranks (FREE only where every rank has freed it)."""
        return [max(states) for states in zip(*(r.snapshot() for r in self.ranks))]

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def read_stats(path: str) -> dict:
    """A running prefill's staging slots and counters: {"total", "free", "reserved", "sending",
    "claimed", "not_handed_off", "kv_ready", "kv_failed", "decode_started", "first_token_direct",
    "staging_slot_quarantined"}. A tensor-parallel
    prefill's ranks are merged: a slot counts as its busiest rank's state, counters add up (so
    ``kv_ready`` counts every rank's KvReady)."""
    merged: list[int] | None = None
    counters = dict.fromkeys(COUNTERS, 0)
    rank = 0
    while rank == 0 or os.path.exists(rank_path(path, rank)):
        with open(rank_path(path, rank), "rb") as f:
            data = f.read()
        num_slots = len(data) - 8 * len(COUNTERS)
        states = list(data[:num_slots])
        merged = states if merged is None else [max(a, b) for a, b in zip(merged, states)]
        for i, name in enumerate(COUNTERS):
            off = num_slots + 8 * i
            counters[name] += int.from_bytes(data[off : off + 8], "little")
        rank += 1
    stats = {"total": len(merged)}
    for value, name in STATE_NAMES.items():
        stats[name] = merged.count(value)
    return stats | counters


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
        self.buffer = self._alloc()
        self.addr = self.buffer.data_ptr()
        self.nbytes = self.buffer.numel()
        self._elt = DTYPE_SIZES[spec.dtype]
        self._staged: dict[int, object] = {}  # slot -> CUDA event after its staging copies
        self.scratch = None  # one slot-sized area per slot, allocated on first use (scratch_addr)
        self._scratch_lock = threading.Lock()

    def _alloc(self):
        """``num_slots`` x ``slot_nbytes`` bytes on the pool's device."""
        import torch

        if self.device.type == "cuda":
            return torch.zeros(self.num_slots, self.spec.slot_nbytes, dtype=torch.uint8, device=self.device)
        # host memory, pinned where CUDA exists (GPU -> staging copies are DMA)
        return torch.zeros(self.num_slots, self.spec.slot_nbytes, dtype=torch.uint8,
                           pin_memory=torch.cuda.is_available())

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

    def scratch_addr(self, slot: int, register) -> int:
        """Where ``slot``'s scratch area starts: as large as a slot, on the pool's device, for the
        images of decode ranks holding fewer heads than this pool (``pack_heads``). The areas of
        every slot are allocated together on the first call and handed to ``register(addr,
        nbytes)`` (the transports) then, never again: a job uses only its own slot's area."""
        with self._scratch_lock:
            if self.scratch is None:
                scratch = self._alloc()
                register(scratch.data_ptr(), scratch.numel())
                self.scratch = scratch
        return self.scratch.data_ptr() + slot * self.spec.slot_nbytes

    def pack_heads(self, slot: int, staged, offset: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of the KV heads layout ``staged`` holds out of
        ``slot``'s image into an image of ``staged`` at ``offset`` bytes into the slot's scratch
        area (shared.kvlayout.staged_layout: its heads are a run of ours, its segments ours in
        order). Done when it returns (on a GPU: this thread's stream is synchronised)."""
        spec, src_row = self.spec, self.buffer[slot]
        dst_row = self.scratch[slot][offset : offset + staged.slot_nbytes]
        first = staged.kv_head_start - spec.kv_head_start
        for ours, theirs in zip(spec.segments, staged.segments):
            head_bytes = ours.bytes_per_token // spec.kv_heads
            src = src_row[ours.offset_bytes : ours.offset_bytes + num_tokens * ours.bytes_per_token]
            dst = dst_row[theirs.offset_bytes : theirs.offset_bytes + num_tokens * theirs.bytes_per_token]
            dst.view(num_tokens, staged.kv_heads, head_bytes).copy_(
                src.view(num_tokens, spec.kv_heads, head_bytes)[:, first : first + staged.kv_heads])
        if self.on_gpu:
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def segment_views(self, slot: int, num_tokens: int) -> list:
        """Per segment, a [num_tokens, elems_per_token] view into the slot."""
        row = self.buffer[slot]
        views = []
        for seg in self.spec.segments:
            nbytes = num_tokens * seg.bytes_per_token
            part = row[seg.offset_bytes : seg.offset_bytes + nbytes]
            views.append(part.view(self.dtype).view(num_tokens, seg.bytes_per_token // self._elt))
        return views
