"""Torch twins of vLLM 0.32's CUDA cache writers for sparse attention (DSA), for tests on CPU.

They fill caches laid out exactly as vLLM's CUDA DSA model fills them, written from
``vllm/models/deepseek_v32/common/kernels.py::_fused_norm_rope_kernel`` (the one kernel that
writes both the sparse-MLA latent cache and the indexer key cache; see
services/prefill/layouts_dsa.py for the layouts). Each takes the values in vLLM's own order (rope
GPT-J style where vLLM ropes that way: ``gptj`` turns the engine's order into it) and a slot
mapping ``block * block_size + offset`` per token.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FNUZ, FNUZ_MAX = torch.float8_e4m3fnuz, 224.0  # ROCm MI300's FP8 and the writers' divisor there
BLOCK_SIZE = 64  # the CUDA kernel block size of FLASHMLA_SPARSE and DEEPSEEK_V32_INDEXER


def gptj(x: torch.Tensor) -> torch.Tensor:
    """Engine rope order (rotated evens, then rotated odds) -> vLLM's GPT-J order (pairs adjacent)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``exp2(ceil(log2(s)))``: the ue8m0 scale."""
    return torch.exp2(torch.ceil(torch.log2(s)))


def ds_mla_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """[n, 4] float32: per 128-element tile ``max(amax * (1 / 448), 1e-4)`` rounded up to a power of 2."""
    amax = kv_c.float().view(kv_c.shape[0], -1, 128).abs().amax(dim=-1)
    return pow2_ceil(torch.clamp(amax * torch.tensor(1.0 / FP8_MAX), min=1e-4))


def index_scales(k: torch.Tensor, fp8_max: float = FP8_MAX) -> torch.Tensor:
    """[n] float32: per token ``max(amax, 1e-4) / 448`` rounded up to a power of 2 (_fp8_ue8m0_quantize)."""
    return pow2_ceil(torch.clamp(k.float().abs().amax(dim=-1), min=1e-4) / fp8_max)


def dequant_ds_mla_latent(kv_c: torch.Tensor) -> torch.Tensor:
    """What a reader of vLLM's fp8_ds_mla cache gets back for latent ``kv_c`` (float32)."""
    s = ds_mla_scales(kv_c)
    x = kv_c.float().view(kv_c.shape[0], -1, 128)
    return ((x / s[:, :, None]).to(FP8).float() * s[:, :, None]).view(kv_c.shape)


def dequant_index_keys(k: torch.Tensor, fp8: torch.dtype = FP8, fp8_max: float = FP8_MAX) -> torch.Tensor:
    s = index_scales(k, fp8_max)[:, None]
    return (k.float() / s).to(fp8).float() * s


def _flat_rows(cache: torch.Tensor) -> torch.Tensor:
    pages = cache.squeeze(1) if cache.dim() == 4 else cache
    return pages.reshape(-1, pages.shape[-1])  # a view: the caches here are contiguous


def write_latent(cache: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """``auto``: [kv_c, k_pe] in the cache dtype, one row per token."""
    _flat_rows(cache)[slots] = torch.cat([kv_c, k_pe], dim=-1).to(cache.dtype)


def write_latent_fp8(cache: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     k_scale: float) -> None:
    """Standard ``fp8``: [kv_c, k_pe] / k_scale as e4m3 bytes."""
    row = (torch.cat([kv_c, k_pe], dim=-1).float() / k_scale).to(FP8)
    _flat_rows(cache)[slots] = row.view(torch.uint8)


def write_ds_mla(cache: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """``fp8_ds_mla``: 512 e4m3 bytes, 4 float32 tile scales, 64 bfloat16 rope values per token."""
    n = kv_c.shape[0]
    s = ds_mla_scales(kv_c)
    nope = (kv_c.float().view(n, -1, 128) / s[:, :, None]).to(FP8).view(n, -1).view(torch.uint8)
    row = torch.cat([nope, s.contiguous().view(torch.uint8).view(n, -1),
                     k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).view(n, -1)], dim=-1)
    _flat_rows(cache)[slots] = row


def write_index_keys(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, shuffled: bool = False,
                     fp8: torch.dtype = FP8, fp8_max: float = FP8_MAX) -> None:
    """DEEPSEEK_V32_INDEXER: per block B x D e4m3 values (tiled [B/16, D/16, 16, 16] when
    ``shuffled``), then B float32 scales; addressed through the block's bytes as the kernel does."""
    pages = cache.squeeze(1) if cache.dim() == 4 else cache  # [NB, B, D + 4]
    nb, bsz, c = pages.shape
    d = c - 4
    flat = pages.view(nb, bsz * c)
    s = index_scales(k, fp8_max)
    q = (k.float() / s[:, None]).to(fp8).view(torch.uint8)
    scale_bytes = s.contiguous().view(torch.uint8).view(-1, 4)
    offsets = torch.arange(d)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bsz)
        if shuffled:
            value_off = o // 16 * 16 * d + o % 16 * 16 + offsets // 16 * 16 * 16 + offsets % 16
        else:
            value_off = o * d + offsets
        flat[b, value_off] = q[t]
        flat[b, bsz * d + 4 * o : bsz * d + 4 * o + 4] = scale_bytes[t]
