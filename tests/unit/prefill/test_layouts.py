"""Layout adapters against caches written by vLLM's own CPU kernels and synthetic GPU layouts."""

from __future__ import annotations

import pytest
import torch

from services.prefill.layouts import (
    CpuAmx, CpuVec, FlashAttn, FlashInfer, MlaLatent, adapter_for,
)
from tests.fixtures.cpu_isa import skip_unless_vllm_isa, vllm_cpu_build, vllm_has_op

NUM_BLOCKS, HEADS = 6, 2
BLOCK_IDS = [4, 1, 3]  # out of order on purpose: the request's block table


def _kv(num_tokens: int, heads: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(num_tokens * 131 + head_dim)
    k = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    return k, v


def _slots(num_tokens: int, block_size: int) -> torch.Tensor:
    return torch.tensor([BLOCK_IDS[t // block_size] * block_size + t % block_size
                         for t in range(num_tokens)], dtype=torch.int64)


def _run(adapter, cache, num_tokens, shape, dtype, n_out=2):
    out = [torch.full((num_tokens, *shape), float("nan"), dtype=dtype) for _ in range(n_out)]
    adapter(cache, torch.tensor(BLOCK_IDS), num_tokens, out)
    return out


CPU_CASES = [
    # isa, dtype, block_size, head_dim, num_tokens, adapter
    ("vec", torch.float32, 32, 64, 70, CpuVec()),
    ("vec", torch.float32, 128, 32, 300, CpuVec()),  # blocks copied one by one (CPU_BLOCKWISE_MIN_TOKENS)
    ("vec", torch.float32, 64, 32, 128, CpuVec()),  # whole blocks only
    ("vec", torch.float32, 32, 64, 64, CpuVec()),  # gathered, whole blocks only
    ("vec", torch.bfloat16, 32, 64, 33, CpuVec()),
    ("vec", torch.bfloat16, 128, 64, 200, CpuVec()),
    ("vec16", torch.float32, 16, 80, 40, CpuVec()),
    ("amx", torch.bfloat16, 32, 64, 70, CpuAmx()),
    ("amx", torch.bfloat16, 64, 128, 129, CpuAmx()),
]


@pytest.mark.parametrize("isa,dtype,block_size,head_dim,num_tokens,adapter", CPU_CASES)
def test_cpu_attn_layouts_match_vllm_kernel(isa, dtype, block_size, head_dim, num_tokens, adapter):
    import vllm._custom_ops as ops  # the real CPU kernel that fills vLLM's cache

    skip_unless_vllm_isa(isa)
    cache = torch.zeros(NUM_BLOCKS, HEADS, block_size, 2 * head_dim, dtype=dtype)
    view = cache.view(NUM_BLOCKS, HEADS, 2 * block_size, head_dim)
    key_cache, value_cache = view.chunk(2, dim=2)
    k, v = _kv(num_tokens, HEADS, head_dim, dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, _slots(num_tokens, block_size), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got_k, got_v = _run(adapter, cache, num_tokens, (HEADS, head_dim), dtype)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, v)


def test_amx_is_not_the_vec_layout():
    """The two CPU layouts really differ, so picking the wrong adapter is caught."""
    import vllm._custom_ops as ops

    skip_unless_vllm_isa("amx")
    cache = torch.zeros(NUM_BLOCKS, HEADS, 32, 128, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, 64, 64).chunk(2, dim=2)
    k, v = _kv(40, HEADS, 64, torch.bfloat16)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, _slots(40, 32), "amx",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got_k, _ = _run(CpuVec(), cache, 40, (HEADS, 64), torch.bfloat16)
    assert not torch.equal(got_k, k)


GPU_CASES = [
    # name, adapter, logical shape builder, write(k, v, cache, block, offset), physical order
    ("flash_attn_nhd", FlashAttn(), lambda B, D: (2, NUM_BLOCKS, B, HEADS, D), None),
    ("flash_attn_hnd", FlashAttn(), lambda B, D: (2, NUM_BLOCKS, B, HEADS, D), (0, 1, 3, 2, 4)),
    ("flashinfer_nhd", FlashInfer(), lambda B, D: (NUM_BLOCKS, 2, B, HEADS, D), None),
    ("flashinfer_hnd", FlashInfer(), lambda B, D: (NUM_BLOCKS, 2, B, HEADS, D), (0, 1, 3, 2, 4)),
]


def _alloc(shape, order, dtype):
    """A tensor of logical ``shape`` whose memory follows ``order`` (vLLM's HND allocation)."""
    if order is None:
        return torch.zeros(shape, dtype=dtype)
    physical = torch.zeros([shape[i] for i in order], dtype=dtype)
    inverse = [order.index(i) for i in range(len(order))]
    return physical.permute(inverse)


@pytest.mark.parametrize("name,adapter,shape,order", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_layouts_synthetic(name, adapter, shape, order, dtype):
    block_size, head_dim, num_tokens = 16, 64, 37
    cache = _alloc(shape(block_size, head_dim), order, dtype)
    assert list(cache.shape) == list(shape(block_size, head_dim))
    k, v = _kv(num_tokens, HEADS, head_dim, dtype)
    for t in range(num_tokens):  # write as the documented layout says: token t of block b
        b, o = BLOCK_IDS[t // block_size], t % block_size
        if name.startswith("flash_attn"):
            cache[0, b, o], cache[1, b, o] = k[t], v[t]
        else:
            cache[b, 0, o], cache[b, 1, o] = k[t], v[t]
    got_k, got_v = _run(adapter, cache, num_tokens, (HEADS, head_dim), dtype)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def _gptj_interleave(x: torch.Tensor) -> torch.Tensor:
    """Engine order (evens then odds) -> vLLM's GPT-J order (pairs adjacent)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


MLA_CASES = [
    # writer, dtype, block_size
    ("cpu_mla", torch.float32, 16),
    ("cpu_mla", torch.bfloat16, 16),
    ("amx_mla", torch.bfloat16, 32),
    ("flashmla", torch.bfloat16, 64),
    ("cpu_mla_4d", torch.bfloat16, 16),
]


@pytest.mark.parametrize("writer,dtype,block_size", MLA_CASES)
def test_mla_latent_and_rope_order(writer, dtype, block_size):
    num_tokens, rank, rope = 45, 512, 64
    g = torch.Generator().manual_seed(7)
    latent = torch.randn(num_tokens, rank, generator=g).to(dtype)
    k_pe_engine = torch.randn(num_tokens, rope, generator=g).to(dtype)
    k_pe_vllm = _gptj_interleave(k_pe_engine)
    cache = torch.zeros(NUM_BLOCKS, block_size, rank + rope, dtype=dtype)
    if writer == "cpu_mla_4d":  # registered with a singleton head dimension
        cache = cache.unsqueeze(1)
    slots = _slots(num_tokens, block_size)
    if writer == "amx_mla":
        import vllm._custom_ops as ops

        if not vllm_has_op("concat_and_cache_mla_cpu"):  # the op vLLM's amx_mla_concat_and_cache calls
            pytest.skip(f"vLLM's {vllm_cpu_build()} kernels have no AMX MLA cache writer on this CPU")
        ops.amx_mla_concat_and_cache(latent, k_pe_vllm, cache, slots)
    else:  # CPU_MLA's do_kv_cache_update and the GPU MLA caches: one row per token
        flat = cache.view(-1, rank + rope)
        flat[slots, :rank], flat[slots, rank:] = latent, k_pe_vllm
    assert MlaLatent(rope_dim=rope).block_size(cache) == block_size
    (got,) = _run(MlaLatent(rope_dim=rope), cache, num_tokens, (rank + rope,), dtype, n_out=1)
    assert torch.equal(got[:, :rank], latent)
    assert torch.equal(got[:, rank:], k_pe_engine)
    (raw,) = _run(MlaLatent(rope_dim=rope, deinterleave_rope=False), cache, num_tokens,
                  (rank + rope,), dtype, n_out=1)
    assert torch.equal(raw[:, rank:], k_pe_vllm)


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_mla_latent_is_staged_as_its_bytes(cache_dtype):
    """vLLM's CUDA MLA backends with --kv-cache-dtype fp8: each row [latent, k_pe (GPT-J pairs)] / k_scale in
    E4M3 (concat_and_cache_mla). The adapter hands those bytes over, the rope part in the engine's order: the
    bytes the decode engine writes for the same values (kvquant.quantize(nearest=True)), no round trip through bf16."""
    from tests.unit.engine.test_kv_fp8_mla import quantize_nearest

    num_tokens, rank, rope, block_size, k_scale = 45, 512, 64, 64, 0.03
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(num_tokens, rank, generator=g).to(torch.bfloat16)
    k_pe_engine = torch.randn(num_tokens, rope, generator=g).to(torch.bfloat16)
    cache = torch.zeros(NUM_BLOCKS, block_size, rank + rope, dtype=torch.uint8)
    cache.view(-1, rank + rope)[_slots(num_tokens, block_size)] = quantize_nearest(
        torch.cat([latent, _gptj_interleave(k_pe_engine)], dim=-1), k_scale)
    out = [torch.zeros(num_tokens, rank + rope, dtype=torch.uint8)]
    MlaLatent(rope_dim=rope)(cache.view(cache_dtype), torch.tensor(BLOCK_IDS), num_tokens, out)
    assert torch.equal(out[0], quantize_nearest(torch.cat([latent, k_pe_engine], dim=-1), k_scale))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):  # never bytes read as numbers into a bf16 slot
        MlaLatent(rope_dim=rope)(cache.view(cache_dtype), torch.tensor(BLOCK_IDS), num_tokens,
                                 [torch.zeros(num_tokens, rank + rope, dtype=torch.bfloat16)])


SELECT_CASES = [
    ("CPU_ATTN", "vec", CpuVec), ("CPU_ATTN", "vec16", CpuVec), ("CPU_ATTN", "amx", CpuAmx),
    ("FLASH_ATTN", None, FlashAttn), ("FLASHINFER", None, FlashInfer), ("CPU_MLA", None, MlaLatent),
    ("AMX_MLA", None, MlaLatent), ("FLASHMLA", None, MlaLatent),
]


@pytest.mark.parametrize("backend,isa,cls", SELECT_CASES)
def test_adapter_selection(backend, isa, cls):
    assert isinstance(adapter_for(backend, isa=isa, rope_dim=64), cls)


def test_unknown_backend_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="CPU_ATTN"):
        adapter_for("PALLAS")
