"""Sparse-attention (DSA) adapters against caches laid out as vLLM's CUDA DSA kernels write them
(tests/unit/prefill/vllm_dsa_twin.py): the latent in each kv cache dtype and the indexer's FP8 keys."""

from __future__ import annotations

import pytest
import torch

from services.prefill.layouts import MlaLatent
from services.prefill.layouts_dsa import (
    DsaIndexerKeys, DsMlaFp8, MlaLatentFp8, sparse_mla_adapter,
)
from tests.unit.prefill import vllm_dsa_twin as twin

NUM_BLOCKS = 6
BLOCK_IDS = [4, 1, 3]  # out of order on purpose: the request's block table
RANK, ROPE, INDEX_DIM = 512, 64, 128


def _slots(num_tokens: int, block_size: int) -> torch.Tensor:
    return torch.tensor([BLOCK_IDS[t // block_size] * block_size + t % block_size
                         for t in range(num_tokens)], dtype=torch.int64)


def _values(num_tokens: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over several octaves, so tiles and tokens get different scales
    octaves = torch.exp2(torch.randint(-6, 4, (num_tokens, 1), generator=g).float())
    return (torch.randn(num_tokens, width, generator=g) * octaves).to(dtype)


def _padded(cache: torch.Tensor, pad_bytes: int) -> torch.Tensor:
    """The same pages behind a larger block stride (vLLM's block_stride_alignment)."""
    nb = cache.shape[0]
    per_block = cache[0].numel()
    fill = 0x7F if cache.dtype == torch.uint8 else float("nan")
    buf = torch.full((nb, per_block + pad_bytes // cache.element_size()), fill, dtype=cache.dtype)
    view = buf[:, :per_block].view(cache.shape)
    view.copy_(cache)
    assert view.stride(0) > per_block
    return view


def _extract(adapter, cache, num_tokens, width, dtype=torch.bfloat16) -> torch.Tensor:
    out = torch.full((num_tokens, width), float("nan"), dtype=dtype)
    assert adapter.block_size(cache) == twin.BLOCK_SIZE
    adapter(cache, torch.tensor(BLOCK_IDS), num_tokens, [out])
    return out


LATENT_CASES = [
    # kv cache dtype, head dim registered, padded block stride, tokens
    ("auto", True, False, 130),
    ("auto", False, True, 64),
    ("fp8_ds_mla", True, False, 130),
    ("fp8_ds_mla", False, True, 1),
    ("fp8", True, False, 100),
]


@pytest.mark.parametrize("dtype_name,four_d,padded,num_tokens", LATENT_CASES)
def test_sparse_mla_latent_is_what_vllms_reader_gets(dtype_name, four_d, padded, num_tokens):
    kv_c = _values(num_tokens, RANK, 1)
    k_pe = _values(num_tokens, ROPE, 2)  # the engine's rope order
    slots = _slots(num_tokens, twin.BLOCK_SIZE)
    width = {"auto": RANK + ROPE, "fp8_ds_mla": 656, "fp8": RANK + ROPE}[dtype_name]
    cache_dtype = torch.bfloat16 if dtype_name == "auto" else torch.uint8
    cache = torch.zeros(NUM_BLOCKS, twin.BLOCK_SIZE, width, dtype=cache_dtype)
    k_scale = 0.0625
    if dtype_name == "auto":
        twin.write_latent(cache, slots, kv_c, twin.gptj(k_pe))
        want_c = kv_c
    elif dtype_name == "fp8_ds_mla":
        twin.write_ds_mla(cache, slots, kv_c, twin.gptj(k_pe))
        want_c = twin.dequant_ds_mla_latent(kv_c).to(torch.bfloat16)
    else:
        twin.write_latent_fp8(cache, slots, kv_c, twin.gptj(k_pe), k_scale)
        vals = (torch.cat([kv_c, k_pe], -1).float() / k_scale).to(twin.FP8).float() * k_scale
        want_c, k_pe = vals[:, :RANK].to(torch.bfloat16), vals[:, RANK:].to(torch.bfloat16)
    if four_d:
        cache = cache.unsqueeze(1)
    if padded:
        cache = _padded(cache, 4096)
    adapter = sparse_mla_adapter(dtype_name, rope_dim=ROPE, kv_lora_rank=RANK, k_scale=k_scale)
    got = _extract(adapter, cache, num_tokens, RANK + ROPE)
    assert torch.equal(got[:, :RANK], want_c)
    assert torch.equal(got[:, RANK:], k_pe)  # bf16 rope: copied bit for bit, reordered only
    rel = (got[:, :RANK].float() - kv_c.float()).norm() / kv_c.float().norm()
    assert rel < (1e-6 if dtype_name == "auto" else 0.05)  # FP8's rounding only


def test_ds_mla_scales_are_per_tile_not_per_token():
    """A token whose four tiles differ in size by octaves keeps each tile's precision."""
    kv_c = torch.ones(1, RANK, dtype=torch.bfloat16)
    kv_c[0, 128:256] *= 1 / 64
    kv_c[0, 256:384] *= 64
    kv_c[0, 1] = 1.0625  # halfway between two e4m3 steps at its tile's scale: rounds
    cache = torch.zeros(NUM_BLOCKS, twin.BLOCK_SIZE, 656, dtype=torch.uint8)
    twin.write_ds_mla(cache, _slots(1, twin.BLOCK_SIZE), kv_c, torch.zeros(1, ROPE))
    got = _extract(DsMlaFp8(), cache, 1, RANK + ROPE)
    assert torch.equal(got[0, 128:384], kv_c[0, 128:384])  # powers of two: exact in every tile
    assert torch.equal(got[0, :RANK], twin.dequant_ds_mla_latent(kv_c)[0].to(torch.bfloat16))


INDEX_CASES = [
    # rope interleaved (GLM), ROCm shuffled values, padded block stride, tokens, ROCm MI300's FP8 (fnuz)
    (False, False, False, 130, False),
    (True, False, False, 65, False),
    (False, True, False, 130, False),
    (True, True, True, 64, False),
    (False, False, True, 3, False),
    (False, True, False, 100, True),
]


@pytest.mark.parametrize("interleaved,shuffled,padded,num_tokens,fnuz", INDEX_CASES)
def test_indexer_keys_are_dequantized_as_vllm_reads_them(interleaved, shuffled, padded, num_tokens, fnuz):
    keys = _values(num_tokens, INDEX_DIM, 3, torch.float32)  # the engine's order: rope first
    vllm_keys = torch.cat([twin.gptj(keys[:, :ROPE]), keys[:, ROPE:]], -1) if interleaved else keys
    fp8, fp8_max = (twin.FNUZ, twin.FNUZ_MAX) if fnuz else (twin.FP8, twin.FP8_MAX)
    cache = torch.zeros(NUM_BLOCKS, 1, twin.BLOCK_SIZE, INDEX_DIM + 4, dtype=torch.uint8)
    twin.write_index_keys(cache, _slots(num_tokens, twin.BLOCK_SIZE), vllm_keys, shuffled=shuffled, fp8=fp8,
                          fp8_max=fp8_max)
    if padded:
        cache = _padded(cache, 512)
    adapter = DsaIndexerKeys(index_head_dim=INDEX_DIM, rope_dim=ROPE, deinterleave_rope=interleaved, shuffled=shuffled,
                             fp8_dtype=fp8)
    got = _extract(adapter, cache, num_tokens, INDEX_DIM, torch.float32)
    # one scale per token: the rope reorder and the dequantization commute
    assert torch.equal(got, twin.dequant_index_keys(keys, fp8, fp8_max))
    assert (got - keys).norm() / keys.norm() < 0.05


def test_the_shuffled_layout_is_not_the_plain_one():
    keys = _values(40, INDEX_DIM, 4, torch.float32)
    cache = torch.zeros(NUM_BLOCKS, twin.BLOCK_SIZE, INDEX_DIM + 4, dtype=torch.uint8)
    twin.write_index_keys(cache, _slots(40, twin.BLOCK_SIZE), keys, shuffled=True)
    got = _extract(DsaIndexerKeys(index_head_dim=INDEX_DIM, rope_dim=ROPE), cache, 40, INDEX_DIM, torch.float32)
    assert not torch.equal(got, twin.dequant_index_keys(keys))


def test_an_index_head_dim_vllm_cannot_page_is_refused():
    cache = torch.zeros(NUM_BLOCKS, twin.BLOCK_SIZE, 64, dtype=torch.uint8)  # 64 + 64 // 128 * 4: no scales
    with pytest.raises(ValueError, match="multiple of 128"):
        _extract(DsaIndexerKeys(index_head_dim=64, rope_dim=ROPE), cache, 10, 64, torch.float32)


@pytest.mark.parametrize("dtype_name,cls", [("auto", MlaLatent), ("bfloat16", MlaLatent), ("fp8_ds_mla", DsMlaFp8),
                                            ("fp8", MlaLatentFp8), ("fp8_e4m3", MlaLatentFp8)])
def test_sparse_mla_adapter_selection(dtype_name, cls):
    assert isinstance(sparse_mla_adapter(dtype_name, rope_dim=ROPE, kv_lora_rank=RANK), cls)


def test_nvfp4_ds_mla_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        sparse_mla_adapter("nvfp4_ds_mla", rope_dim=ROPE, kv_lora_rank=RANK)
