"""Staging slot states, counters, pool views, the sender's layout checks and write plan, config."""

from __future__ import annotations

import pytest
import torch

from services.prefill.config import ExpressConfig
from services.prefill.layouts import kernel_block_ids
from services.prefill.sender import layout_mismatch, write_ops, write_timeout_s
from services.prefill.staging import FREE, RESERVED, SENDING, SlotStates, StagingPool, read_stats
from shared.kvlayout import KvShape, layout_spec

SHAPE = KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=4)


def test_slot_states_are_shared_through_the_file(tmp_path):
    path = str(tmp_path / "slots")
    scheduler = SlotStates(path, 3, create=True)
    worker = SlotStates(path, 3)
    assert [scheduler.reserve(), scheduler.reserve()] == [0, 1]
    worker.set(0, SENDING)
    scheduler.count("claimed", 2)
    scheduler.count("decode_started")
    worker.count("kv_ready")
    assert read_stats(path) == {"total": 3, "free": 1, "reserved": 1, "sending": 1, "claimed": 2,
                                "not_handed_off": 0, "kv_ready": 1, "kv_failed": 0, "decode_started": 1, "first_token_direct": 0,
                                "staging_slot_quarantined": 0}
    worker.set(0, FREE)
    worker.set(1, FREE)
    assert scheduler.reserve() == 0
    assert worker.get(0) == RESERVED
    assert SlotStates(path, 3, create=True).snapshot() == [FREE] * 3  # a restart starts clean


def test_pool_views_follow_the_native_layout():
    spec = layout_spec(SHAPE, "float32", max_tokens=8)
    pool = StagingPool(spec, num_slots=2)
    views = pool.segment_views(1, 3)
    assert [tuple(v.shape) for v in views] == [(3, 8)] * 4
    views[2].fill_(7.0)  # layer 1, K
    row = pool.buffer[1].view(torch.float32)
    seg = spec.segments[2]
    start = seg.offset_bytes // 4
    assert torch.all(row[start: start + 24] == 7.0) and row.sum().item() == 7.0 * 24
    assert pool.slot_addr(1) - pool.addr == spec.slot_nbytes


MISMATCH_CASES = [
    ("same", layout_spec(SHAPE, "float32", 16), 10, ""),
    ("bigger slot is fine", layout_spec(SHAPE, "float32", 64), 10, ""),
    ("dtype", layout_spec(SHAPE, "bfloat16", 16), 10, "dtype"),
    ("layers", layout_spec(KvShape("gqa", 3, 2, 4), "float32", 16), 10, "num_layers"),
    # as many bytes per token, but 1 head of 8 is another model than 2 of 4: the layouts say so
    ("heads", layout_spec(KvShape("gqa", 2, 1, 8), "float32", 16), 10, "different model"),
    ("head_dim", layout_spec(KvShape("gqa", 2, 2, 8), "float32", 16), 10, "segment sizes"),
    ("too long", layout_spec(SHAPE, "float32", 8), 10, "does not fit"),
    ("kind", layout_spec(KvShape("mla", 2, kv_lora_rank=8, qk_rope_head_dim=8), "float32", 16), 10, "kind"),
]


MLA = KvShape("mla", 2, kv_lora_rank=8, qk_rope_head_dim=8)
MLA_CASES = [
    ("same", layout_spec(MLA, "float32", 16), ""),
    ("node keeps no MTP layer", layout_spec(KvShape("mla", 1, kv_lora_rank=8, qk_rope_head_dim=8), "float32", 16), ""),
    ("node has an MTP layer more", layout_spec(KvShape("mla", 3, kv_lora_rank=8, qk_rope_head_dim=8), "float32", 16), ""),
    ("latent size", layout_spec(KvShape("mla", 2, kv_lora_rank=16, qk_rope_head_dim=8), "float32", 16), "segment sizes"),
    ("dtype", layout_spec(MLA, "bfloat16", 16), "dtype"),
]


@pytest.mark.parametrize("name,theirs,reason", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_layouts_may_differ_in_trailing_mtp_layers(name, theirs, reason):
    ours = layout_spec(MLA, "float32", 16)
    got = layout_mismatch(ours, theirs, 10)
    assert (reason in got) if reason else got == ""
    if not reason:  # only the layers both have are written
        ops = write_ops(ours, 0, theirs, 0, 10)
        assert len(ops) == min(ours.num_layers, theirs.num_layers)


@pytest.mark.parametrize("name,theirs,num_tokens,reason", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_layout_mismatch(name, theirs, num_tokens, reason):
    got = layout_mismatch(layout_spec(SHAPE, "float32", 16), theirs, num_tokens)
    assert (reason in got) if reason else got == ""


def test_write_ops_cover_each_segment_prefix():
    ours, theirs = layout_spec(SHAPE, "float32", 16), layout_spec(SHAPE, "float32", 64)
    ops = write_ops(ours, 1000, theirs, 50_000, 5)
    per_token = 2 * 4 * 4
    assert ops == [(1000 + i * 16 * per_token, 50_000 + i * 64 * per_token, 5 * per_token) for i in range(4)]


BLOCK_CASES = [
    # scheduler blocks, manager size, kernel size, tokens, kernel block ids
    ([3, 1], 128, 128, 200, [3, 1]),
    ([3, 1], 128, 128, 100, [3]),
    ([3, 1], 64, 32, 100, [6, 7, 2, 3]),
    ([2], 64, 16, 17, [8, 9]),
]


@pytest.mark.parametrize("blocks,manager,kernel,tokens,want", BLOCK_CASES)
def test_kernel_block_ids(blocks, manager, kernel, tokens, want):
    assert kernel_block_ids(blocks, manager, kernel, tokens) == want


CONFIG_CASES = [
    ({}, None),
    ({"transports": "nixl", "staging_slots": 8}, None),
    ({"transports": ["carrier"]}, "transports"),
    ({"staging_slots": 0}, "staging_slots"),
    ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
    ({"nats": "x"}, "unknown"),
    ({"kv_checksum": True, "fault_flip_kv_byte_every": 3}, None),
    ({"kv_checksum": "yes"}, "kv_checksum"),
    ({"fault_flip_kv_byte_every": 1}, "set kv_checksum too"),
    ({"kv_checksum": True, "fault_flip_kv_byte_every": -1}, "fault_flip_kv_byte_every"),
]


@pytest.mark.parametrize("extra,error", CONFIG_CASES)
def test_config_from_extra_config(extra, error):
    if error is None:
        config = ExpressConfig.from_extra_config(extra)
        assert config.stats_file("e1") == "/dev/shm/expresslane-staging-e1"
    else:
        with pytest.raises(ValueError, match=error):
            ExpressConfig.from_extra_config(extra)


WRITE_TIMEOUT_CASES = [
    # transfer timeout, lease expiry (ms), now (ms), time the write may take
    (30.0, 0, 5_000, 30.0),          # no expiry known: the transfer timeout
    (30.0, 10_000, 5_000, 5.0),      # the lease ends first
    (3.0, 10_000, 5_000, 3.0),       # the transfer timeout ends first
    (30.0, 10_000, 10_000, 0.0),     # expired: no write starts
    (30.0, 10_000, 12_000, -2.0),
]


@pytest.mark.parametrize("timeout_s,expires_at_ms,now_ms,want", WRITE_TIMEOUT_CASES)
def test_writes_never_outlive_the_lease(timeout_s, expires_at_ms, now_ms, want):
    assert write_timeout_s(timeout_s, expires_at_ms, now_ms) == pytest.approx(want)
