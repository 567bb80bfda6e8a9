"""The background sender: one-sided writes of staged KV into decode slots, then KV-ready.

Runs on its own threads inside vLLM's worker process, so the prefill loop never waits for the
network. For each job it checks that every decode rank's slot layout pairs with the one staged,
writes each decode rank the first ``num_tokens`` tokens of the KV both hold with the transport the
target names, marks the staging slot free, and publishes ``KvReady`` on ``xl.kv.ready.<node>`` (or
``KvFailed`` with the reason) with the request's trace context. Failures are reported as data,
never raised into vLLM.

Tensor parallelism (shared.kvlayout, services.prefill.parallel): the staged layout is this prefill
rank's (its share of the KV heads; MLA: the whole latent, staged by rank 0 only), and the target
lists the decode node's ranks (``TransferTarget.rank_targets``). Each decode rank gets
``tp_write_ops`` of the heads both hold; where this rank holds more heads than a decode rank
(prefill TP < decode TP) their heads are first packed into the staging slot's scratch area in that
rank's layout (``StagingPool.pack_heads``), so each is written whole, one op per segment. Ranks
that hold none of our heads are skipped. Each prefill rank that wrote announces it with its own
``KvReady`` (``source_rank``: its rank, ``source_ranks``: how many prefill ranks write to the node,
``nbytes``: what this rank wrote); the node injects once it has every one. A rank that writes
nothing publishes nothing.

With ``checksum`` on, each written segment's CRC-32 is computed on the staging copy just before
the write and carried in ``KvReady.kv_checksums`` (shared.kvchecksum), for a single writer of a
single decode buffer only (prefill and decode TP 1): a tensor-parallel node cannot check sums of
bytes several writers put into its buffers, so under TP none are sent (logged once).
``fault_flip_every=N`` (fault injection for tests and bench/chaos.py, never in production) then
flips the first written byte of every Nth such transfer's staging copy, so the decode node must
catch it.

With GPU staging, while a job's staging copies still run on the GPU, the sender first writes
``PREWARM_BYTES`` of the first segment into the first decode rank it writes (``prewarm``, on by
default): the write path's
first use after an idle spell is slow (host caches, the transport's and the driver's state; on
CPU NIXL about 0.1 ms against 0.03 back to back; between two H200s over NVLink a copy after 50 ms
idle takes ~0.29 ms more than back to back, whatever its size, and a 1 MB copy up to 1 ms before
takes all but ~0.02 ms of that away where 64 bytes took 0.1 ms: bench/gpu_copy_idle.py), and this
pays it while the thread would only wait. Those bytes are stale and are overwritten by the write proper, which starts after the
prewarm write has completed; the decode node reads the slot only after ``KvReady``. A failed
prewarm write is only logged: the write proper decides the outcome.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from opentelemetry import trace

from shared import subjects
from shared.events import KvFailed, KvLayoutSpec, KvReady, RankTarget, TransferTarget
from shared.handoff import Handoff
from shared.kvchecksum import CHECKSUM_ALGO, checksums
from shared.kvlayout import (
    FP8_DTYPES, held_heads, kv_cache_dtype_flag, staged_layout, tp_mismatch, tp_write_ops,
)
from shared.tracing import context_from_traceparent, current_traceparent
from shared.transport import TransferError, Transport

from services.prefill.staging import FREE

# A child of vLLM's logger, so lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.expresslane.prefill")

PREWARM_BYTES = 1 << 20  # written ahead while GPU staging copies run (see the module docstring)


@dataclasses.dataclass
class SendJob:
    handoff: Handoff
    staging_slot: int
    num_tokens: int
    extract_ms: float = 0.0
    fail_reason: str = ""  # set: publish KvFailed only
    kv_checksums: list[int] = dataclasses.field(default_factory=list)  # set by the sender
    checksum_ms: float = 0.0


def layout_mismatch(ours: KvLayoutSpec, theirs: KvLayoutSpec, num_tokens: int) -> str:
    """Why the staged layout cannot be written into the target's ("" when it can).

    MLA layouts may differ in their trailing MTP layers: a prefill running the MTP drafter stages
    one layer more than a node that does not speculate keeps (the extra layer is not sent), and a
    node that speculates behind a prefill without the drafter gets the main layers only (its
    drafts are still verified, so output is unchanged; only their acceptance suffers).

    GQA layouts of two tensor-parallel splits hold different numbers of heads per token: they pair
    when both describe the same model's heads (shared.kvlayout.tp_mismatch) and each head takes as
    many bytes on both sides; a peer that does not describe its heads pairs only whole (TP 1)."""
    fields = ("layout_version", "kind", "dtype") + (() if ours.kind == "mla" else ("num_layers",))
    for field in fields:
        if field == "dtype" and ours.dtype != theirs.dtype and {ours.dtype, theirs.dtype} & set(FP8_DTYPES):
            return kv_dtype_mismatch(ours.dtype, theirs.dtype)
        if getattr(ours, field) != getattr(theirs, field):
            return (f"layout mismatch: prefill stages {field}={getattr(ours, field)!r}, decode slot "
                    f"expects {getattr(theirs, field)!r}")
    reason = tp_mismatch(ours, theirs)
    if reason:
        return reason
    per_head = ours.kind == "gqa" and bool(ours.kv_heads and theirs.kv_heads)
    ours_heads, theirs_heads = (ours.kv_heads, theirs.kv_heads) if per_head else (1, 1)
    if ours.kind != "mla" and len(ours.segments) != len(theirs.segments) or any(
            a.bytes_per_token * theirs_heads != b.bytes_per_token * ours_heads or a.name != b.name
            for a, b in zip(ours.segments, theirs.segments)):
        return "layout mismatch: per-token segment sizes differ (different model?)"
    if num_tokens > theirs.max_tokens:
        return f"prompt of {num_tokens} tokens does not fit the decode slot ({theirs.max_tokens})"
    return ""


def kv_dtype_mismatch(ours: str, theirs: str) -> str:
    """Why an FP8 KV cache and a slot of another KV dtype cannot pair, and which flag to change."""
    return (f"layout mismatch: prefill stages KV in {ours} (vLLM --kv-cache-dtype {kv_cache_dtype_flag(ours)}), "
            f"decode slot keeps {theirs}: run both with one KV cache dtype (decode --kv-cache-dtype "
            f"{kv_cache_dtype_flag(ours)}, or vLLM --kv-cache-dtype {kv_cache_dtype_flag(theirs)})")


def write_ops(ours: KvLayoutSpec, staging_addr: int, theirs: KvLayoutSpec, remote_base: int,
              num_tokens: int) -> list[tuple[int, int, int]]:
    """(local, remote, nbytes) per segment both layouts have, for the first ``num_tokens`` tokens."""
    return [(staging_addr + a.offset_bytes, remote_base + b.offset_bytes, num_tokens * a.bytes_per_token)
            for a, b in zip(ours.segments, theirs.segments)]


@dataclasses.dataclass(frozen=True)
class RankWrite:
    """One decode rank's share of a job: its target and the (local, remote, nbytes) writes. With
    ``staged``, the writes read an image of that rank's heads which ``StagingPool.pack_heads``
    builds first at ``scratch_offset`` into the staging slot's scratch area."""

    rank: RankTarget
    ops: list[tuple[int, int, int]]
    staged: KvLayoutSpec | None = None
    scratch_offset: int = 0


def scratch_offset(ours: KvLayoutSpec, staged: KvLayoutSpec) -> int:
    """Where a decode rank's packed image starts in a slot's scratch area (as large as a slot of
    ``ours``): its first head's place among ours, so ranks of disjoint heads never overlap."""
    return (staged.kv_head_start - ours.kv_head_start) * (ours.slot_nbytes // ours.kv_heads)


def plan_rank_writes(ours: KvLayoutSpec, staging_addr: int, target: TransferTarget, num_tokens: int,
                     scratch_addr: Callable[[], int]) -> tuple[list[RankWrite], str]:
    """The writes of a slot image of ``ours`` at ``staging_addr`` into every decode rank of
    ``target``, rank 0 first, ranks that hold none of our KV left out; or ([], why not) when a
    rank's layout does not pair with ours. ``scratch_addr()``: the staging slot's scratch area,
    asked only when a rank holds fewer heads than we do (packed there, then written whole).
    Prefill and decode of one rank each write whole segments, as before tensor parallelism."""
    ranks = target.rank_targets()
    for rank in ranks:
        reason = layout_mismatch(ours, rank.layout, num_tokens)
        if reason:
            return [], reason if len(ranks) == 1 else f"decode rank {rank.tp_rank}: {reason}"
    writes = []
    for rank in ranks:
        theirs, base = rank.layout, rank.slot.base_addr
        staged = staged_layout(ours, theirs)
        if (ours.tp_size, theirs.tp_size) == (1, 1):  # one image each side (also a peer without heads)
            writes.append(RankWrite(rank, write_ops(ours, staging_addr, theirs, base, num_tokens)))
        elif staged is None:
            writes.append(RankWrite(rank, tp_write_ops(ours, staging_addr, theirs, base, num_tokens)))
        else:
            offset = scratch_offset(ours, staged)
            ops = tp_write_ops(staged, scratch_addr() + offset, theirs, base, num_tokens)
            writes.append(RankWrite(rank, ops, staged, offset))
    return [w for w in writes if w.ops], ""


def source_ranks(ours: KvLayoutSpec, target: TransferTarget) -> int:
    """How many prefill ranks (of ``ours.tp_size``, each holding as many heads as ours) write to the
    node of ``target``: MLA one (rank 0 writes the latent every rank holds); GQA every rank
    holding a head some decode rank holds (all of them, as a node's ranks hold every head)."""
    if ours.kind == "mla" or ours.tp_size == 1:
        return 1
    readers = [held_heads(rank.layout) for rank in target.rank_targets()]
    n = ours.kv_heads
    return sum(any(max(w * n, d0) < min((w + 1) * n, d1) for d0, d1 in readers) for w in range(ours.tp_size))


def write_timeout_s(timeout_s: float, expires_at_ms: int, now_ms: float) -> float:
    """The time a write may take: the transfer timeout, cut to what is left of the lease."""
    if not expires_at_ms:
        return timeout_s
    return min(timeout_s, (expires_at_ms - now_ms) / 1000)


# How long a write that gave up may take to stop touching its buffers (Mooncake's own transfer timeout,
# MC_TRANSFER_TIMEOUT, is 30 s by default) before its staging slot is written off.
SETTLE_TIMEOUT_S = 60.0


class Sender:
    """A small pool of sender threads fed by a queue."""

    def __init__(self, transports: dict[str, Transport], pool, states, publisher, timeout_s: float,
                 num_threads: int = 2, tracer: trace.Tracer | None = None, checksum: bool = False,
                 num_checksum_threads: int = 4, fault_flip_every: int = 0, prewarm: bool = True,
                 settle_timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        self.prewarm = prewarm
        self.settle_timeout_s = settle_timeout_s
        self._said_no_tp_checksums = False
        self.tracer = tracer or trace.get_tracer("expresslane.prefill")
        self.checksum = checksum
        self.fault_flip_every = fault_flip_every
        self._num_checksummed = 0
        self._checksum_lock = threading.Lock()
        self._checksum_pool = (ThreadPoolExecutor(num_checksum_threads, "expresslane-checksum")
                               if checksum and num_checksum_threads > 1 else None)
        self.transports = transports
        self.pool = pool
        self.states = states
        self.publisher = publisher
        self.timeout_s = timeout_s
        self._queue: queue.Queue[SendJob | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"expresslane-sender-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def submit(self, job: SendJob) -> None:
        """Queue a job; call it on the thread that staged it (its CUDA stream holds the copies)."""
        if job.staging_slot >= 0 and not job.fail_reason:
            self.pool.fence(job.staging_slot)
        self._queue.put(job)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(self.timeout_s + 5)
        if self._checksum_pool is not None:
            self._checksum_pool.shutdown(wait=False)

    def _bind_device(self) -> None:
        """Make the staging GPU this thread's CUDA device. A new thread starts on device 0: without
        this, the staging events and the transport's GPU copies (UCX CUDA IPC) would run in device
        0's context (created there if need be) on a host where the staging GPU is another."""
        device = getattr(self.pool, "device", None)
        if getattr(self.pool, "on_gpu", False) is not True or getattr(device, "index", None) is None:
            return
        try:
            import torch

            torch.cuda.set_device(device)
        except Exception:
            log.exception("expresslane sender: could not make %s this thread's CUDA device", device)

    def _run(self) -> None:
        self._bind_device()
        while (job := self._queue.get()) is not None:
            try:
                self._handle(job)
            except Exception:  # never let a bad job kill the thread (_handle has freed its slot)
                log.exception("expresslane sender: unexpected error")

    def _handle(self, job: SendJob) -> None:
        h = job.handoff
        parent = context_from_traceparent(h.traceparent)
        with self.tracer.start_as_current_span("prefill.kv_transfer", context=parent) as span:
            span.set_attribute("expresslane.request_id", h.request_id)
            span.set_attribute("expresslane.node_id", h.target.node_id)
            transfer_ms, nbytes, reason, writes = 0.0, 0, job.fail_reason, []
            stuck = False  # a write gave up with parts of it still reading the slot
            if not reason:
                try:
                    t0 = time.perf_counter()
                    writes, reason = self._plan(job)
                    if not reason:
                        self._prewarm(job, writes)
                    self.pool.wait_staged(job.staging_slot)  # GPU staging: its copies have landed
                    job.extract_ms += (time.perf_counter() - t0) * 1e3  # extraction ends when they have
                    if not reason:
                        t0 = time.perf_counter()
                        nbytes, reason, stuck = self._write(job, writes)
                        transfer_ms = (time.perf_counter() - t0) * 1e3 - job.checksum_ms  # the write alone
                except Exception as exc:  # a device or binding error: still one KvFailed, the slot freed once
                    log.exception("expresslane sender: hand-off of %s failed", h.request_id)
                    reason = f"the prefill's sender failed: {type(exc).__name__}: {exc}"
                finally:
                    if not stuck:
                        self.states.set(job.staging_slot, FREE)
                    else:  # losing one staging slot beats reusing bytes a write still reads
                        log.error("expresslane sender: staging slot %d stays out of use: the write of %s "
                                  "did not stop within %.0f s of giving up", job.staging_slot,
                                  h.request_id, self.settle_timeout_s)
                        self.states.count("staging_slot_quarantined")
            base = dict(request_id=h.request_id, lease_id=h.lease_id, generation=h.generation,
                        node_id=h.target.node_id, slot=h.target.slot.slot)
            if reason:
                span.set_attribute("expresslane.failed", reason)
                event = KvFailed(**base, reason=reason)
                self.states.count("kv_failed")
            elif not writes:  # no decode rank holds any of this rank's KV: the others announce it
                return
            else:
                self.states.count("kv_ready")
                spec = self.pool.spec
                event = KvReady(**base, num_tokens=job.num_tokens,
                                layout_version=h.target.layout.layout_version, nbytes=nbytes,
                                extract_ms=job.extract_ms, transfer_ms=transfer_ms,
                                kv_checksums=job.kv_checksums,
                                kv_checksum_algo=CHECKSUM_ALGO if job.kv_checksums else "",
                                checksum_ms=job.checksum_ms,
                                source_rank=spec.tp_rank, source_ranks=source_ranks(spec, h.target))
            traceparent = current_traceparent() or h.traceparent
        self.publisher.publish(subjects.kv_ready(h.target.node_id), event, traceparent)

    def _plan(self, job: SendJob) -> tuple[list[RankWrite], str]:
        """Every decode rank's writes for ``job`` (plan_rank_writes), or why there are none."""
        target = job.handoff.target
        if target.transport not in self.transports:
            return [], (f"transport {target.transport!r} is not enabled on this prefill "
                        f"(enabled: {', '.join(self.transports)})")
        slot = job.staging_slot
        try:
            return plan_rank_writes(self.pool.spec, self.pool.slot_addr(slot), target, job.num_tokens,
                                    lambda: self.pool.scratch_addr(slot, self._register))
        except (TransferError, RuntimeError) as exc:  # the scratch area: out of memory, not registered
            return [], (f"could not set up the staging scratch area that packs a decode rank's KV heads "
                        f"({exc}): free device memory or run the prefill with the decode node's "
                        f"tensor-parallel size")

    def _register(self, addr: int, nbytes: int) -> None:
        for transport in self.transports.values():
            transport.register(addr, nbytes)

    def _write(self, job: SendJob, writes: list[RankWrite]) -> tuple[int, str, bool]:
        """Pack where a decode rank holds fewer heads, then write each rank in turn, all within one
        deadline (the transfer timeout, cut to the lease): (bytes, why it failed, whether a failed
        write still has parts in flight after ``settle_timeout_s``). A write that gave up with parts
        in flight is waited for before the failure is reported, so that the staging slot is reused,
        and the decode slot given to another lease, only once nothing more lands there."""
        target = job.handoff.target
        transport = self.transports[target.transport]
        timeout_s = write_timeout_s(self.timeout_s, job.handoff.expires_at_ms, time.time() * 1000)
        if timeout_s <= 0:
            return 0, "lease expired before the write could start", False
        deadline = time.monotonic() + timeout_s
        if self.checksum:
            self._checksum_single_writer(job, writes)
        for w in writes:
            if w.staged is not None:
                try:
                    self.pool.pack_heads(job.staging_slot, w.staged, w.scratch_offset, job.num_tokens)
                except RuntimeError as exc:  # a device error: report it as the hand-off's failure
                    return 0, f"packing the KV heads of decode rank {w.rank.tp_rank} failed: {exc}", False
        for w in writes:
            left_s = deadline - time.monotonic()
            where = f" (decode rank {w.rank.tp_rank})" if len(writes) > 1 else ""
            if left_s <= 0:
                return 0, f"transfer failed{where}: not started within the {timeout_s:.1f} s left to write", False
            try:
                transport.write(w.rank.endpoint, w.ops, w.rank.nixl_metadata_b64, timeout_s=left_s)
            except TransferError as exc:
                stuck = exc.settle is not None and not exc.settle(self.settle_timeout_s)
                return 0, f"transfer failed{where}: {exc}", stuck
        return sum(op[2] for w in writes for op in w.ops), "", False

    def _prewarm(self, job: SendJob, writes: list[RankWrite]) -> None:
        """With GPU staging, a tiny write into the first decode rank written while the staging
        copies run."""
        if not self.prewarm or getattr(self.pool, "on_gpu", False) is not True or not writes:
            return
        target = job.handoff.target
        transport = self.transports[target.transport]
        timeout_s = write_timeout_s(self.timeout_s, job.handoff.expires_at_ms, time.time() * 1000)
        first = writes[0]
        local, remote, nbytes = first.ops[0]
        if timeout_s <= 0 or nbytes <= 0:
            return
        try:
            transport.write(first.rank.endpoint, [(local, remote, min(nbytes, PREWARM_BYTES))],
                            first.rank.nixl_metadata_b64, timeout_s=timeout_s)
        except Exception as exc:  # a warm-up only: whatever it meets, the write proper decides
            log.info("expresslane sender: prewarm write for %s failed (%s); the write proper decides",
                     job.handoff.request_id, exc)

    def _checksum_single_writer(self, job: SendJob, writes: list[RankWrite]) -> None:
        """Checksums for one writer of one decode buffer; under tensor parallelism none (said once)."""
        if self.pool.spec.tp_size == 1 and len(job.handoff.target.rank_targets()) == 1:
            slot_addr = self.pool.slot_addr(job.staging_slot)
            self._checksum(job, [(local - slot_addr, nbytes) for w in writes for local, _, nbytes in w.ops])
            return
        if not self._said_no_tp_checksums:
            self._said_no_tp_checksums = True
            log.warning("expresslane sender: kv_checksum is on, but a hand-off between tensor-parallel "
                        "ranks (prefill TP %d, decode TP %d) carries no checksums: the decode node cannot "
                        "check a sum of bytes several writers wrote; they are sent for TP 1 to TP 1 only",
                        self.pool.spec.tp_size, len(job.handoff.target.rank_targets()))

    def _checksum(self, job: SendJob, ranges: list[tuple[int, int]]) -> None:
        """Sum what is about to be written (ranges within the staging slot); fault injection after."""
        t0 = time.perf_counter()
        job.kv_checksums = checksums(self.pool.slot_reader(job.staging_slot), ranges, self._checksum_pool)
        job.checksum_ms = (time.perf_counter() - t0) * 1e3
        if self.fault_flip_every:
            with self._checksum_lock:
                self._num_checksummed += 1
                is_flipped = self._num_checksummed % self.fault_flip_every == 0
            if is_flipped:
                self.pool.flip_byte(job.staging_slot, ranges[0][0])
                log.warning("expresslane: fault injection: flipped a KV byte of %s after its checksum",
                            job.handoff.request_id)
