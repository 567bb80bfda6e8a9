"""The background sender: one-sided writes of staged KV into decode slots, then KV-ready.

Runs on its own threads inside vLLM's worker process, so the prefill loop never waits for the
network. For each job it checks that the decode slot's layout is the one staged, writes every
segment's first ``num_tokens`` tokens with the transport the target names, marks the staging
slot free, and publishes ``KvReady`` on ``xl.kv.ready.<node>`` (or ``KvFailed`` with the reason)
with the request's trace context. Failures are reported as data, never raised into vLLM.

With ``checksum`` on, each written segment's CRC-32 is computed on the staging copy just before
the write and carried in ``KvReady.kv_checksums`` (shared.kvchecksum). ``fault_flip_every=N``
(fault injection for tests and bench/chaos.py, never in production) then flips the first written
byte of every Nth such transfer's staging copy, so the decode node must catch it.

With GPU staging, while a job's staging copies still run on the GPU, the sender first writes
``PREWARM_BYTES`` of the first segment into the slot (``prewarm``, on by default): the write path's
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

from opentelemetry import trace

from shared import subjects
from shared.events import KvFailed, KvLayoutSpec, KvReady
from shared.handoff import Handoff
from shared.kvchecksum import CHECKSUM_ALGO, checksums
from shared.kvlayout import FP8_DTYPES, kv_cache_dtype_flag
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
    drafts are still verified, so output is unchanged; only their acceptance suffers)."""
    fields = ("layout_version", "kind", "dtype") + (() if ours.kind == "mla" else ("num_layers",))
    for field in fields:
        if field == "dtype" and ours.dtype != theirs.dtype and {ours.dtype, theirs.dtype} & set(FP8_DTYPES):
            return kv_dtype_mismatch(ours.dtype, theirs.dtype)
        if getattr(ours, field) != getattr(theirs, field):
            return (f"layout mismatch: prefill stages {field}={getattr(ours, field)!r}, decode slot "
                    f"expects {getattr(theirs, field)!r}")
    if ours.kind != "mla" and len(ours.segments) != len(theirs.segments) or any(
            a.bytes_per_token != b.bytes_per_token or a.name != b.name
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


def write_timeout_s(timeout_s: float, expires_at_ms: int, now_ms: float) -> float:
    """The time a write may take: the transfer timeout, cut to what is left of the lease."""
    if not expires_at_ms:
        return timeout_s
    return min(timeout_s, (expires_at_ms - now_ms) / 1000)


class Sender:
    """A small pool of sender threads fed by a queue."""

    def __init__(self, transports: dict[str, Transport], pool, states, publisher, timeout_s: float,
                 num_threads: int = 2, tracer: trace.Tracer | None = None, checksum: bool = False,
                 num_checksum_threads: int = 4, fault_flip_every: int = 0, prewarm: bool = True) -> None:
        self.prewarm = prewarm
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
            except Exception:  # never let a bad job kill the thread
                log.exception("expresslane sender: unexpected error")
                if job.staging_slot >= 0:
                    self.states.set(job.staging_slot, FREE)

    def _handle(self, job: SendJob) -> None:
        h = job.handoff
        parent = context_from_traceparent(h.traceparent)
        with self.tracer.start_as_current_span("prefill.kv_transfer", context=parent) as span:
            span.set_attribute("expresslane.request_id", h.request_id)
            span.set_attribute("expresslane.node_id", h.target.node_id)
            transfer_ms, nbytes, reason = 0.0, 0, job.fail_reason
            if not reason:
                t0 = time.perf_counter()
                self._prewarm(job)
                self.pool.wait_staged(job.staging_slot)  # GPU staging: its copies have landed
                job.extract_ms += (time.perf_counter() - t0) * 1e3  # extraction ends when they have
                t0 = time.perf_counter()
                nbytes, reason = self._write(job)
                transfer_ms = (time.perf_counter() - t0) * 1e3 - job.checksum_ms  # the write alone
                self.states.set(job.staging_slot, FREE)
            base = dict(request_id=h.request_id, lease_id=h.lease_id, generation=h.generation,
                        node_id=h.target.node_id, slot=h.target.slot.slot)
            if reason:
                span.set_attribute("expresslane.failed", reason)
                event = KvFailed(**base, reason=reason)
                self.states.count("kv_failed")
            else:
                self.states.count("kv_ready")
                event = KvReady(**base, num_tokens=job.num_tokens,
                                layout_version=h.target.layout.layout_version, nbytes=nbytes,
                                extract_ms=job.extract_ms, transfer_ms=transfer_ms,
                                kv_checksums=job.kv_checksums,
                                kv_checksum_algo=CHECKSUM_ALGO if job.kv_checksums else "",
                                checksum_ms=job.checksum_ms)
            traceparent = current_traceparent() or h.traceparent
        self.publisher.publish(subjects.kv_ready(h.target.node_id), event, traceparent)

    def _write(self, job: SendJob) -> tuple[int, str]:
        target = job.handoff.target
        transport = self.transports.get(target.transport)
        if transport is None:
            return 0, (f"transport {target.transport!r} is not enabled on this prefill "
                       f"(enabled: {', '.join(self.transports)})")
        reason = layout_mismatch(self.pool.spec, target.layout, job.num_tokens)
        if reason:
            return 0, reason
        timeout_s = write_timeout_s(self.timeout_s, job.handoff.expires_at_ms, time.time() * 1000)
        if timeout_s <= 0:
            return 0, "lease expired before the write could start"
        slot_addr = self.pool.slot_addr(job.staging_slot)
        ops = write_ops(self.pool.spec, slot_addr, target.layout, target.slot.base_addr, job.num_tokens)
        if self.checksum:
            self._checksum(job, [(local - slot_addr, nbytes) for local, _, nbytes in ops])
        try:
            transport.write(target.endpoint, ops, target.nixl_metadata_b64, timeout_s=timeout_s)
        except TransferError as exc:
            return 0, f"transfer failed: {exc}"
        return sum(op[2] for op in ops), ""

    def _prewarm(self, job: SendJob) -> None:
        """With GPU staging, a tiny write into the target slot while the staging copies run."""
        if not self.prewarm or getattr(self.pool, "on_gpu", False) is not True:
            return
        target = job.handoff.target
        transport = self.transports.get(target.transport)
        if transport is None or layout_mismatch(self.pool.spec, target.layout, job.num_tokens):
            return  # the write proper reports it
        timeout_s = write_timeout_s(self.timeout_s, job.handoff.expires_at_ms, time.time() * 1000)
        ops = write_ops(self.pool.spec, self.pool.slot_addr(job.staging_slot), target.layout,
                        target.slot.base_addr, job.num_tokens)
        if timeout_s <= 0 or not ops or ops[0][2] <= 0:
            return
        local, remote, nbytes = ops[0]
        try:
            transport.write(target.endpoint, [(local, remote, min(nbytes, PREWARM_BYTES))],
                            target.nixl_metadata_b64, timeout_s=timeout_s)
        except TransferError as exc:
            log.info("expresslane sender: prewarm write for %s failed (%s); the write proper decides",
                     job.handoff.request_id, exc)

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
