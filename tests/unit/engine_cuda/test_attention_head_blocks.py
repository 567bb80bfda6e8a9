"""Decode attention with a group's query heads spread over several programs (head blocks): how many
blocks a shape gets, and that the blocked kernel gives the twin's output (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda import reference
from services.decode.engine.cuda.attention import MAX_ROW_ELEMS, DecodeAttention, head_blocks

BF = torch.bfloat16


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(BF)


def close(a, b, tol=1e-5):
    a, b = a.float(), b.float()
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("group,tokens,d_qk,expected", [
    (4, 1, 128, 1),  # Llama-3-8B GQA: 16 rows of 128
    (8, 8, 128, 1),  # GQA, 8 tokens a step: 64 rows of 128
    (16, 1, 576, 1),  # DeepSeek-V2-Lite MLA, one token: 16 rows of 576
    (16, 4, 576, 1),  # its 4-token verify: 64 rows of 576, the limit
    (128, 1, 576, 2),  # DeepSeek-V3 MLA, one token: 128 heads in two programs of 64
    (128, 2, 576, 4),
    (128, 4, 576, 8),  # its 4-token verify: 8 programs of 16 heads x 4 tokens
    (3, 64, 576, 1),  # no power of two divides the group: one block, whatever its size
    (128, 1, 4096, 8),  # never below 16 rows: 8 blocks of 16 heads even where 16 rows exceed the limit
])
def test_head_blocks_fit_the_row_tile(group, tokens, d_qk, expected):
    hb = head_blocks(group, tokens, d_qk)
    assert hb == expected
    assert group % hb == 0


def test_mla_attention_over_head_blocks_matches_twin():
    """Absorbed MLA (values are the latent, rope part apart) with 32 heads over 4 blocks of 8."""
    hq, r, rope, t, pos = 32, 32, 16, 2, 21
    q_c, q_pe, lat = rand(hq, t, r), rand(t, hq, rope, seed=3), rand(pos + t + 2, 1, r + rope, seed=4)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_tokens=t,
                           num_splits=4, block_s=16, v_chunks=2, max_row_elems=16 * (r + rope))
    assert attn.head_blocks == 4 and attn.rows == 16
    out = torch.full((t, hq, r), float("nan"), dtype=BF)
    attn(q_c, lat, lat, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
         rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=t * r)
    ref = reference.attention(torch.cat([q_c.transpose(0, 1), q_pe], -1), lat, lat[..., :r], pos, (r + rope) ** -0.5)
    close(out, ref)


def test_gqa_attention_over_head_blocks_matches_twin():
    """Two kv heads of 32 query heads each, two blocks of 16 per kv head: the two-launch kernel (the
    one-launch GQA kernel keeps a whole group per program and is not chosen)."""
    hq, hkv, d, t, pos = 64, 2, 32, 1, 40
    q, k, v = rand(t, hq, d), rand(pos + t + 3, hkv, d, seed=1), rand(pos + t + 3, hkv, d, seed=2)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_tokens=t, num_splits=4,
                           block_s=16, max_row_elems=16 * d)
    assert attn.head_blocks == 2 and attn.rows == 16 and not attn.one_launch
    out = torch.full((t, hq, d), float("nan"), dtype=BF)
    attn(q, k, v, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d)
    close(out, reference.attention(q, k, v, pos, d ** -0.5))


def test_default_limit_keeps_deepseek_v2_lite_in_one_block():
    assert head_blocks(16, 4, 576) == 1 and MAX_ROW_ELEMS == 64 * 576


@pytest.mark.parametrize("pos,min_chunk,active", [
    (21, 0, 2),  # 24 keys over 16 splits of one 16-row block: the first two take them
    (21, 32, 1),  # at least 32 keys a split: one split holds them all, fifteen are empty
    (100, 32, 4),  # 101 keys: four splits of 32, the rest empty
    (300, 32, 10),  # 301 keys: 16 splits would take 32 each (a block of 16 rounds 19 up): ten fill
])
def test_mla_attention_with_a_least_split_matches_twin(pos, min_chunk, active):
    """Many splits in a long slot (adapter.attention_splits) over a short context: with ``min_chunk`` each
    split takes at least that many keys and the later splits stay empty (their partials weigh nothing in the
    merge); the output is the twin's either way."""
    hq, r, rope, t = 4, 32, 16, 1
    q_c, q_pe, lat = rand(hq, t, r), rand(t, hq, rope, seed=3), rand(pos + t + 2, 1, r + rope, seed=4)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_tokens=t,
                           num_splits=16, block_s=16, v_is_k=True, min_chunk=min_chunk)
    out = torch.full((t, hq, r), float("nan"), dtype=BF)
    attn(q_c, lat, lat, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
         rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=t * r)
    ref = reference.attention(torch.cat([q_c.transpose(0, 1), q_pe], -1), lat, lat[..., :r], pos, (r + rope) ** -0.5)
    close(out, ref)
    sums = attn.part_ml.view(t, hq, 16, 2)[..., 1]  # each split's softmax sum: 0 where it took no key
    assert (sums[0, 0] > 0).sum().item() == active


def test_least_split_is_whole_key_blocks():
    with pytest.raises(ValueError, match="min_chunk 40 is not a multiple of block_s 16"):
        DecodeAttention(num_q_heads=4, num_kv_heads=1, d_main=32, d_v=32, d_rope=16, block_s=16, min_chunk=40)


@pytest.mark.parametrize("heads,r,tokens,batch,slot_splits,want", [
    # (splits, value chunks, fewest rows a split): one token over at most 16 heads takes twice the slot's
    # splits of 32 rows in 2 value chunks (MlaStack.FEW_ROWS_ATTN); the rest keep ATTN_FORM and SPLIT_MIN_ROWS
    (16, 512, 1, False, 16, (32, 2, 32)),  # DeepSeek-V2-Lite, one token, a slot up to 8K rows
    (16, 512, 1, False, 64, (64, 2, 32)),  # ... a 32K slot: at most 64 splits
    (16, 512, 4, False, 16, (16, 4, 64)),  # ... its 4-token verify
    (16, 512, 4, True, 16, (16, 4, 64)),  # ... 4 slots' batch
    (128, 512, 1, False, 16, (16, 4, 64)),  # DeepSeek-V3: 128 heads, 64 rows a program
    (2, 32, 1, False, 16, (32, 1, 32)),  # a tiny latent: one value chunk
])
def test_mla_attention_form_by_query_rows(heads, r, tokens, batch, slot_splits, want):
    from services.decode.engine.cuda.mla import MlaDims, MlaStack

    dims = MlaDims(hidden=64, num_heads=heads, kv_lora_rank=r, nope=16, rope=16, v_dim=16, num_experts=0, top_k=0,
                   moe_inter=0, num_shared=0, routed_scale=1.0, eps=1e-6, sm_scale=0.1)
    st = MlaStack(dims, tokens, "cpu", num_splits=slot_splits, batch=batch)
    a = st.attn
    assert (a.num_splits, a.v_chunks, a.min_chunk) == want
    assert not a.v_is_k and a.d_v == r  # the values read as their own tiles (an FP8 latent needs that)
    assert a.pos_last == (tokens == 1 and not batch and heads <= 16)  # row pos after the loops: the few-rows form
