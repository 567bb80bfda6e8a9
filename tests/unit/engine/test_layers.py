"""The CPU step's shortcuts in layers.py: which steps take them, and that they write what the general forms write."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.layers import attend, cached_rows, causal_mask, lone_run, write_cache
from services.decode.engine.rope import rope_factors, rotate


@pytest.mark.parametrize("slots,positions,want", [
    ([2], [[7]], (2, 7)),  # a plain step
    ([0], [[5, 6, 7, 8]], (0, 5)),  # a verify's consecutive positions
    ([1], [[5, 7]], None),  # not a run
    ([0, 1], [[3], [9]], None),  # two slots: the gather's general form
])
def test_lone_run_names_one_slots_consecutive_positions(slots, positions, want):
    assert lone_run(torch.tensor(slots), torch.tensor(positions)) == want


@pytest.mark.parametrize("positions", [[[3]], [[3, 4, 5]]])
def test_a_sliced_write_is_the_indexed_one(positions):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 10, 2, 4, generator=g)
    values = torch.randn(1, len(positions[0]), 2, 4, generator=g, dtype=torch.float64)  # converted on write
    slots, pos = torch.tensor([1]), torch.tensor(positions)
    indexed, sliced = cache.clone(), cache.clone()
    write_cache(indexed, slots, pos, values)
    write_cache(sliced, slots, pos, values, lone_run(slots, pos))
    assert torch.equal(indexed, sliced) and not torch.equal(indexed, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_over_its_prefix_attends_alike_without_the_mask(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 9, 16, generator=g).to(dtype) for _ in range(2))
    masked = attend(q, k, v, causal_mask(torch.tensor([[8]]), 9), 0.25)
    assert torch.equal(attend(q, k, v, None, 0.25), masked)


@pytest.mark.parametrize("hq,hkv,masked", [(4, 2, False), (4, 2, True), (8, 1, False), (6, 3, True), (4, 4, False)])
def test_one_tokens_query_heads_as_rows_of_their_kv_head_attend_as_enable_gqa(hq, hkv, masked):
    # one token's grouped form against SDPA's enable_gqa: the same head mapping (query head i reads K/V head
    # i // (hq / hkv)), values equal up to the summation order
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, hq, 1, 16, generator=g)
    k, v = (torch.randn(2, hkv, 9, 16, generator=g) * 3 for _ in range(2))
    mask = causal_mask(torch.tensor([[6], [8]]), 9) if masked else None
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                                            enable_gqa=hq != hkv).transpose(1, 2)
    got = attend(q, k, v, mask, 0.25)
    assert got.shape == (2, 1, hq, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 2, 64), (2, 1, 4, 128), (5, 7168)])
def test_fp32_rms_norm_in_one_op_is_the_four_op_form(shape):
    from services.decode.engine.cuda.reference import rms_norm

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(*shape, generator=g) * 4, torch.randn(shape[-1], generator=g) + 1
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(rms_norm(x, w, 1e-6), want)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """HF transformers' rotation (nine ops) with cos/sin [..., T, dim/2]: rotated evens then odds where interleaved."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 6, 64), (2, 3, 4, 128), (1, 5, 2, 16)])
@pytest.mark.parametrize("interleave", [False, True])  # Llama / Qwen halves; the DeepSeek family's adjacent pairs
def test_the_four_op_rotation_is_hf_transformers_nine_op_one_bit_for_bit(dtype, shape, interleave):
    g = torch.Generator().manual_seed(shape[-1] + shape[1])
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    angles = torch.randn(*shape[:2], shape[-1] // 2, generator=g) * 30
    cos, sin = angles.cos(), angles.sin()
    got = rotate(x, *rope_factors(cos, sin, dtype), interleave)
    assert got.dtype == dtype and torch.equal(got, hf_rotate(x, cos, sin, interleave)) and not torch.equal(got, x)


@pytest.mark.parametrize("slot,positions", [(0, [[4]]), (2, [[6, 7, 8]])])
def test_the_lone_runs_cached_rows_are_the_ids_view(slot, positions):
    cache = torch.randn(3, 16, 2, 4, generator=torch.Generator().manual_seed(slot))
    slots = torch.tensor([slot])
    run = lone_run(slots, torch.tensor(positions))
    assert run == (slot, positions[0][0])
    got = cached_rows(cache, slots, 9, run)
    assert torch.equal(got, cached_rows(cache, slots, 9)) and torch.equal(got, cache[slot:slot + 1, :9])
    assert got.data_ptr() == cache[slot].data_ptr()  # a view, no copy
