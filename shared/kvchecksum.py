"""KV integrity: one checksum per transferred segment, over exactly the bytes written.

Contract (opt-in, ``ExpressConfig.kv_checksum`` on the prefill, ``--require-kv-checksum`` on the
decode node):
- The prefill sender computes, on its staging copy and before the write, ``CHECKSUM_ALGO``
  (XXH3-64, ~20 GB/s on one core; CRC-32 from zlib, ~4 GB/s, where xxhash is missing) of every
  segment it writes: the ``num_tokens * bytes_per_token`` bytes at the
  segment's offset (``shared.kvlayout.write_ranges``), in segment order. Bytes past the prompt are
  never written, so never checked. The list rides in ``KvReady.kv_checksums`` with
  ``KvReady.kv_checksum_algo``; a KvReady without them (older prefills, or the option off) is
  unchecked.
- The decode node computes the same (the algorithm the KvReady names, if it knows it) over its
  receive buffer before it injects the KV; a mismatch
  ends the lease as failed with reason ``CHECKSUM_FAILED`` (the router migrates the request); a
  node that requires checksums ends a KvReady without them with ``CHECKSUM_MISSING``.
- Segments are independent, so they may be summed in parallel (``executor``): zlib releases the
  GIL for large buffers.
- Cost (bench/kv_checksum.py): on the host the sums cost more than a fast link takes to move the
  bytes, so the option is a diagnostic for suspected corruption, not a default.

Pure: no torch, no I/O. Buffers are anything with the buffer protocol (numpy arrays, memoryviews);
``read(offset, nbytes)`` lets a caller hand out device memory range by range.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

try:
    import xxhash
except ImportError:  # pragma: no cover - depends on the install
    xxhash = None

ALGOS: dict[str, Callable[[object], int]] = {"crc32": zlib.crc32}
if xxhash is not None:
    ALGOS["xxh3_64"] = xxhash.xxh3_64_intdigest
CHECKSUM_ALGO = "xxh3_64" if "xxh3_64" in ALGOS else "crc32"
CHECKSUM_FAILED = "checksum"  # the lease-end reason of a mismatch
CHECKSUM_MISSING = "checksum_missing"  # the node requires checksums, the KvReady has none

Reader = Callable[[int, int], object]


def host_reader(buf) -> Reader:
    """``read(offset, nbytes)`` over a host buffer, without copies."""
    view = memoryview(buf).cast("B")
    return lambda offset, nbytes: view[offset : offset + nbytes]


def checksums(read: Reader, ranges: Sequence[tuple[int, int]],
              executor: Executor | None = None, algo: str = CHECKSUM_ALGO) -> list[int]:
    """The ``algo`` sum of each (offset, nbytes) range, in order."""
    digest = ALGOS[algo]

    def one(r: tuple[int, int]) -> int:
        return digest(read(*r))

    if executor is None or len(ranges) < 2:
        return [one(r) for r in ranges]
    return list(executor.map(one, ranges))


def verify(read: Reader, ranges: Sequence[tuple[int, int]], expected: Sequence[int], algo: str,
           executor: Executor | None = None) -> str:
    """What does not match ``expected`` ("" when all does); ``ranges`` are the receiver's
    segments, of which the first ``len(expected)`` were written."""
    if algo not in ALGOS:
        return f"algorithm {algo!r} unknown (this node checks {', '.join(ALGOS)})"
    if len(expected) > len(ranges):
        return f"{len(expected)} segment sums for {len(ranges)} segments"
    actual = checksums(read, ranges[: len(expected)], executor, algo)
    bad = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    if bad:
        return f"{len(bad)} of {len(expected)} segments differ (first: segment {bad[0]})"
    return ""
