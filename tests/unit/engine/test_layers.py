"""The CPU step's shortcuts in layers.py: which steps take them, and that they write what the general forms write."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.layers import attend, causal_mask, lone_run, write_cache


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
