"""The layout contract's tensor-parallel split: which heads each rank holds, and the writes that move
a writer's heads into a reader's slot, checked by moving real bytes between numpy images."""

import numpy as np
import pytest

from shared.kvlayout import KvShape, layout_spec, staged_layout, tp_heads, tp_mismatch, tp_write_ops

GQA = KvShape(kind="gqa", num_layers=2, num_kv_heads=4, head_dim=3)
MLA = KvShape(kind="mla", num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2)
MAX, N = 8, 5  # slot capacity, tokens written


@pytest.mark.parametrize("heads,size,rank,expected", [
    (4, 1, 0, (0, 4)), (4, 2, 0, (0, 2)), (4, 2, 1, (2, 2)), (8, 4, 3, (6, 2)), (4, 4, 2, (2, 1)),
])
def test_rank_holds_its_share_of_heads(heads, size, rank, expected):
    assert tp_heads(heads, size, rank) == expected


@pytest.mark.parametrize("heads,size,rank,message", [
    (4, 3, 0, "do not split over 3"), (4, 2, 2, "rank 2 of 2 does not exist"), (4, 0, 0, "does not exist"),
])
def test_impossible_splits_are_refused(heads, size, rank, message):
    with pytest.raises(ValueError, match=message):
        tp_heads(heads, size, rank)


def test_rank_layout_holds_its_heads_only():
    full, half = layout_spec(GQA, "float32", MAX), layout_spec(GQA, "float32", MAX, 2, 1)
    assert (half.kv_head_start, half.kv_heads, half.kv_heads_total, half.tp_rank, half.tp_size) == (2, 2, 4, 1, 2)
    assert half.slot_nbytes * 2 == full.slot_nbytes
    assert [s.bytes_per_token for s in half.segments] == [2 * 3 * 4] * 4
    mla = layout_spec(MLA, "bfloat16", MAX, 2, 1)
    assert mla.slot_nbytes == layout_spec(MLA, "bfloat16", MAX).slot_nbytes and mla.kv_heads == 0


def _image(spec, fill):
    """A slot image of ``spec`` whose every (layer, k/v, token, head, dim) element says which it is."""
    buf = np.zeros(spec.slot_nbytes // 4, dtype=np.float32)
    for seg in spec.segments:
        per = seg.bytes_per_token // 4
        for t in range(N if fill else 0):
            if spec.kind == "gqa":
                for h in range(spec.kv_heads):
                    head = spec.kv_head_start + h
                    for d in range(per // spec.kv_heads):
                        buf[(seg.offset_bytes + t * seg.token_stride_bytes) // 4 + h * (per // spec.kv_heads) + d] = (
                            seg.layer * 1000 + (seg.name == "v") * 500 + t * 50 + head * 10 + d)
            else:
                buf[(seg.offset_bytes + t * seg.token_stride_bytes) // 4:][:per] = seg.layer * 1000 + t * 50 + np.arange(per)
    return buf


def _move(src_spec, dst_spec, src, dst, stage=True):
    """Apply the writes (after staging an image of the reader's heads where the contract says to)."""
    staged = staged_layout(src_spec, dst_spec) if stage else None
    if staged is not None:  # gather the reader's heads out of the writer's image, as a stager would
        image = np.zeros(staged.slot_nbytes // 4, dtype=np.float32)
        for op in tp_write_ops(src_spec, 0, staged, 0, N):
            image[op[1] // 4:(op[1] + op[2]) // 4] = src[op[0] // 4:(op[0] + op[2]) // 4]
        src_spec, src = staged, image
    ops = tp_write_ops(src_spec, 0, dst_spec, 0, N)
    for local, remote, nbytes in ops:
        dst[remote // 4:(remote + nbytes) // 4] = src[local // 4:(local + nbytes) // 4]
    return ops


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (2, 4)])
def test_mixed_tp_handoff_lands_each_reader_exactly_its_heads(p, d):
    """Every decode rank's slot ends up byte-equal to the image a rank holding its heads computes."""
    readers = [layout_spec(GQA, "float32", MAX, d, r) for r in range(d)]
    writers = [layout_spec(GQA, "float32", MAX, p, r) for r in range(p)]
    for r, reader in enumerate(readers):
        got = _image(reader, fill=False)
        for w in writers:
            _move(w, reader, _image(w, fill=True), got)
        assert np.array_equal(got, _image(reader, fill=True)), f"rank {r} of {d} from {p} writers"


@pytest.mark.parametrize("p,d,ops_per_reader", [(1, 1, 4), (2, 2, 4), (1, 2, 4), (2, 1, 4 * N)])
def test_writes_are_whole_segments_unless_rows_interleave(p, d, ops_per_reader):
    reader = layout_spec(GQA, "float32", MAX, d, 0)
    writer = layout_spec(GQA, "float32", MAX, p, 0)
    ops = _move(writer, reader, _image(writer, True), _image(reader, False))
    assert len(ops) == ops_per_reader


def test_disjoint_heads_write_nothing():
    assert tp_write_ops(layout_spec(GQA, "float32", MAX, 2, 0), 0, layout_spec(GQA, "float32", MAX, 2, 1), 0, N) == []


def test_mla_latent_goes_whole_to_every_rank_from_writer_rank_zero_only():
    readers = [layout_spec(MLA, "float32", MAX, 2, r) for r in range(2)]
    writers = [layout_spec(MLA, "float32", MAX, 2, r) for r in range(2)]
    for reader in readers:
        got = _image(reader, fill=False)
        writes = [_move(w, reader, _image(w, True), got) for w in writers]
        assert [len(w) for w in writes] == [2, 0]
        assert np.array_equal(got, _image(reader, fill=True))


def test_a_peer_without_the_split_pairs_only_whole():
    old = layout_spec(GQA, "float32", MAX)
    old = type(old)(**{f: getattr(old, f) for f in old.__struct_fields__ if f not in ("kv_heads", "kv_heads_total")})
    assert tp_mismatch(old, old) == ""
    assert "too old" in tp_mismatch(old, layout_spec(GQA, "float32", MAX, 2, 0))
    assert tp_mismatch(layout_spec(GQA, "float32", MAX, 2, 1), layout_spec(GQA, "float32", MAX)) == ""
    new = layout_spec(GQA, "float32", MAX)
    assert len(tp_write_ops(new, 0, old, 0, N)) == len(tp_write_ops(old, 0, new, 0, N)) == 4  # whole segments
