"""Segment checksums over a real layout (shared/kvchecksum.py): what is written is what is summed,
one flipped byte in any written segment is caught, bytes past the prompt are not looked at."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shared.kvchecksum import ALGOS, CHECKSUM_ALGO, checksums, host_reader, verify
from shared.kvlayout import KvShape, layout_spec, write_ranges

GQA = layout_spec(KvShape(kind="gqa", num_layers=3, num_kv_heads=2, head_dim=8), "bfloat16", 32)
MLA = layout_spec(KvShape(kind="mla", num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8), "float32", 32)
NUM_TOKENS = 5


def slot_image(spec, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, spec.slot_nbytes, dtype=np.uint8)


def sums(spec, image, num_tokens=NUM_TOKENS, executor=None) -> list[int]:
    return checksums(host_reader(image), write_ranges(spec, num_tokens), executor)


def flip_in_segment(spec, image, segment, where) -> None:
    """Flip one byte of ``segment``: its first, last written, or first unwritten (past the prompt)."""
    seg = spec.segments[segment]
    written = NUM_TOKENS * seg.bytes_per_token
    image[seg.offset_bytes + {"first": 0, "last": written - 1, "past_prompt": written}[where]] ^= 0x01


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("where, is_detected", [
    ("first", True), ("last", True), ("past_prompt", False),
])
def test_one_flipped_byte_in_any_segment(spec, where, is_detected):
    image = slot_image(spec)
    expected = sums(spec, image)
    assert len(expected) == len(spec.segments)
    for segment in range(len(spec.segments)):
        corrupt = image.copy()
        flip_in_segment(spec, corrupt, segment, where)
        detail = verify(host_reader(corrupt), write_ranges(spec, NUM_TOKENS), expected, CHECKSUM_ALGO)
        if is_detected:
            assert detail == f"1 of {len(expected)} segments differ (first: segment {segment})"
        else:
            assert detail == ""


@pytest.mark.parametrize("case, expected, algo, detail", [
    ("matches", "all", CHECKSUM_ALGO, ""),
    ("fewer sums than segments: the written prefix", "first_two", CHECKSUM_ALGO, ""),
    ("more sums than segments", "too_many", CHECKSUM_ALGO, "7 segment sums for 6 segments"),
    ("unknown algorithm", "all", "md5", "algorithm 'md5' unknown (this node checks crc32, xxh3_64)"),
])
def test_verify(case, expected, algo, detail):
    image = slot_image(GQA)
    good = sums(GQA, image)
    expected = {"all": good, "first_two": good[:2], "too_many": good + [0]}[expected]
    assert verify(host_reader(image), write_ranges(GQA, NUM_TOKENS), expected, algo) == detail


@pytest.mark.parametrize("algo", ["crc32", "xxh3_64"])
def test_every_algorithm_catches_a_flipped_byte_and_names_its_sums(algo):
    assert CHECKSUM_ALGO == "xxh3_64" and set(ALGOS) == {"crc32", "xxh3_64"}  # xxhash is installed
    image = slot_image(GQA)
    ranges = write_ranges(GQA, NUM_TOKENS)
    expected = checksums(host_reader(image), ranges, algo=algo)
    assert verify(host_reader(image), ranges, expected, algo) == ""
    assert verify(host_reader(image), ranges, expected, "crc32" if algo != "crc32" else "xxh3_64") != ""
    image[ranges[-1][0]] ^= 0x80
    assert verify(host_reader(image), ranges, expected, algo).startswith("1 of ")


def test_sums_are_of_the_prompt_rows_only_and_the_same_in_parallel():
    image = slot_image(GQA)
    other = slot_image(GQA, seed=1)
    for off, n in write_ranges(GQA, NUM_TOKENS):  # same prompt rows, different bytes after them
        other[off : off + n] = image[off : off + n]
    with ThreadPoolExecutor(3) as pool:
        assert sums(GQA, image) == sums(GQA, other) == sums(GQA, other, executor=pool)
    assert sums(GQA, image, NUM_TOKENS + 1) != sums(GQA, other, NUM_TOKENS + 1)


def test_reader_does_not_copy():
    image = slot_image(GQA)
    view = host_reader(image)(3, 4)
    image[3] ^= 0xFF
    assert view[0] == image[3]
