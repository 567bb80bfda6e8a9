"""Layout adapters for vLLM's CUDA sparse-attention (DSA) caches: deepseek_v32 and glm_moe_dsa.

A DSA model registers two cache tensors per layer with a connector: the sparse-MLA latent cache
(``model.layers.N.self_attn.attn``, backend FLASHMLA_SPARSE or another ``*_MLA_SPARSE``) and, for
every layer that runs its own lightning indexer, the indexer's key cache
(``model.layers.N.self_attn.indexer.k_cache``, backend DEEPSEEK_V32_INDEXER). Both are registered
as the logical ``[num_blocks, 1, block_size, C]`` page of vLLM's KV cache layout (``[NB, B, C]``
where the head dimension is squeezed); vLLM's kernels address them with the tensor's own block
stride, so a padded block stride (``block_stride_alignment``) is read through the tensor's strides.

What vLLM 0.32 stores (the CUDA DSA model writes both caches in one fused Triton kernel,
``vllm/models/deepseek_v32/common/kernels.py::_fused_norm_rope_kernel``; the latent cache's size per
token is ``MLAAttention.get_kv_cache_spec`` in ``vllm/model_executor/layers/attention/mla_attention.py``,
the indexer cache's ``DeepseekV32Indexer`` / ``DeepseekV32IndexerCache`` in
``vllm/models/deepseek_v32/attention.py`` and ``vllm/model_executor/models/deepseek_v2.py``):

Latent cache, one row per token, by ``--kv-cache-dtype`` (``_canonicalize_sparse_mla_kv_cache_dtype``
turns any fp8 dtype into ``fp8_ds_mla`` on FLASHMLA_SPARSE):

- ``auto`` / ``bfloat16`` (the default for deepseek_v32): ``[kv_lora_rank + rope]`` in the model
  dtype, the normalized latent then ``k_pe`` roped GPT-J style (rotated pairs adjacent). Adapter
  ``layouts.MlaLatent``: a copy, ``k_pe`` de-interleaved into the engine's order.
- ``fp8_ds_mla`` (656 bytes for kv_lora_rank 512, rope 64; FlashMLA's "FP8 with scale" format, see
  the note in ``vllm/v1/attention/backends/mla/flashmla_sparse.py``): bytes ``[0, 512)`` the latent
  as float8_e4m3fn, ``[512, 528)`` four float32 scales, one per 128-element tile of the latent,
  ``[528, 656)`` ``k_pe`` as 64 bfloat16, roped GPT-J style, not quantized. The fused writer takes
  ``s = max(amax(tile) / 448, 1e-4)`` rounded up to a power of two and stores ``e4m3(x / s)``; the
  unfused CUDA op (``concat_and_cache_ds_mla_kernel`` in upstream's ``csrc/cache_kernels.cu``) takes
  ``max(amax / 448, FLT_MIN)`` unrounded. The adapter reads the stored scale, so it reads either.
  Adapter ``DsMlaFp8``.
- plain ``fp8`` / ``fp8_e4m3`` on a backend that keeps the standard format (FLASHINFER_MLA_SPARSE
  and others): ``[kv_lora_rank + rope]`` float8_e4m3fn, latent and ``k_pe`` both divided by the
  layer's one per-tensor ``k_scale``. Adapter ``MlaLatentFp8``.
- ``nvfp4_ds_mla`` (Blackwell only, 352 bytes) is not handed over: refused with the reason.

Indexer key cache (``DeepseekV32IndexerBackend``, kernel block size 64 on CUDA), uint8
``[NB, 1, B, index_head_dim + 4]``; vLLM reads a block as one run of ``B * (index_head_dim + 4)``
bytes (``_fp8_quant_and_cache_write``; the CUDA op ``indexer_k_quant_and_cache`` in
``csrc/cache_kernels.cu`` and the reader ``cp_gather_indexer_k_quant_cache`` agree):

- bytes ``[0, B * D)``: token ``t``'s key at ``t * D``, D float8_e4m3fn values (D = index_head_dim;
  the indexer's LayerNorm output with rope on its first ``qk_rope_head_dim`` dims, GPT-J pairs when
  the config says ``indexer_rope_interleave`` (GLM), NeoX halves otherwise (DeepSeek-V3.2));
- bytes ``[B * D, B * D + 4 * B)``: token ``t``'s float32 scale at ``B * D + 4 * t``, one per token
  (``scale_fmt`` ue8m0: ``max(amax / 448, 1e-4)`` rounded up to a power of two);
- ROCm's shuffled variant (``uses_shuffled_layout``) tiles the values ``[B/16, D/16, 16, 16]``
  (16 tokens x 16 bytes); the scales are unchanged. ``DsaIndexerKeys(shuffled=True)`` reads it.
  vLLM sizes the page ``D + D // 128 * 4`` bytes per token, so D must be a multiple of 128 (both
  families use 128); another D is refused.

The decode engine's slot (shared.kvlayout) keeps the latent, ``k_pe`` and the index keys in the
model dtype, so the FP8 forms are dequantized here exactly as vLLM's readers dequantize them:
``float32(e4m3) * scale``, rounded once to the model dtype (``cp_gather_and_upconvert_fp8_kv_cache``
for the latent, ``cp_gather_indexer_k_quant_cache`` + the fp8 MQA logits for the index keys). With
power-of-two scales that product is exact in bfloat16, so the slot holds exactly what vLLM's own
kernels attend with (with an unrounded scale, after the one rounding vLLM's bf16 upconvert makes
too); the bfloat16 ``k_pe`` tail and the ``auto`` latent are copied bit for bit (only reordered).
The FP8 flavour is the platform's (``current_platform.fp8_dtype()``): OCP e4m3fn on CUDA, e4m3fnuz
on ROCm's MI300 (whose writers divide by 224 instead of 448; the bytes still mean
``e4m3fnuz * scale``). Pure torch, no I/O; works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.prefill.layouts import MlaLatent

FP8 = torch.float8_e4m3fn
DS_MLA_TILE = 128  # latent elements per float32 scale in fp8_ds_mla
INDEX_QUANT_BLOCK = 128  # DeepseekV32Indexer.quant_block_size
SHUFFLE_BLOCK_TILE, SHUFFLE_HEAD_TILE = 16, 16  # kernels.py _INDEXER_CACHE_{BLOCK,HEAD}_TILE(_BYTES)

# vLLM sparse-MLA backends (MLAAttention with use_sparse) and its DSA indexer cache backend.
SPARSE_MLA_BACKENDS = frozenset({
    "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_MLA_SPARSE_SM90",
    "FLASH_ATTN_MLA_SPARSE", "ROCM_AITER_MLA_SPARSE", "XPU_MLA_SPARSE",
})
INDEXER_BACKENDS = frozenset({"DEEPSEEK_V32_INDEXER"})
FP8_DTYPES = ("fp8", "fp8_e4m3")


def _pages(kv_layer: torch.Tensor) -> torch.Tensor:
    """[NB, B, C]; vLLM registers the page as [NB, 1, B, C] (one latent "head")."""
    return kv_layer.squeeze(1) if kv_layer.dim() == 4 else kv_layer


def _rows(kv_layer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request's first ``num_tokens`` rows [n, C], gathered through the cache's strides."""
    pages = _pages(kv_layer).index_select(0, block_ids)
    return pages.reshape(-1, pages.shape[-1])[:num_tokens]


def _engine_rope(pe: torch.Tensor, deinterleave: bool) -> torch.Tensor:
    """vLLM's GPT-J rope order (rotated pairs adjacent) -> the engine's (evens, then odds)."""
    return torch.cat((pe[..., 0::2], pe[..., 1::2]), dim=-1) if deinterleave else pe


@dataclass(frozen=True)
class DsMlaFp8:
    """``fp8_ds_mla``: per token 512 e4m3 latent values, 4 float32 tile scales, 64 bfloat16 rope."""

    kv_lora_rank: int = 512
    rope_dim: int = 64
    deinterleave_rope: bool = True
    fp8_dtype: torch.dtype = FP8
    kind = "mla"
    segments = ("kv_latent",)

    @property
    def entry_bytes(self) -> int:
        return self.kv_lora_rank + 4 * (self.kv_lora_rank // DS_MLA_TILE) + 2 * self.rope_dim

    def block_size(self, kv_layer):
        return _pages(kv_layer).shape[1]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        if kv_layer.dtype != torch.uint8 or kv_layer.shape[-1] != self.entry_bytes:
            raise ValueError(f"fp8_ds_mla cache must be uint8 [..., {self.entry_bytes}], got "
                             f"{kv_layer.dtype} {tuple(kv_layer.shape)}")
        r, tiles = self.kv_lora_rank, self.kv_lora_rank // DS_MLA_TILE
        rows = _rows(kv_layer, block_ids, num_tokens).contiguous()  # [n, 656] uint8
        n = rows.shape[0]
        nope = rows[:, :r].view(self.fp8_dtype).float().view(n, tiles, DS_MLA_TILE)
        scales = rows[:, r : r + 4 * tiles].contiguous().view(torch.float32)  # [n, tiles]
        pe = rows[:, r + 4 * tiles :].contiguous().view(torch.bfloat16)  # [n, rope]
        out[0][:, :r].copy_((nope * scales[:, :, None]).view(n, r))
        out[0][:, r:].copy_(_engine_rope(pe, self.deinterleave_rope))


@dataclass(frozen=True)
class MlaLatentFp8:
    """Standard fp8 MLA cache: ``[latent, k_pe]`` as e4m3, both divided by one per-tensor scale."""

    rope_dim: int
    k_scale: float
    deinterleave_rope: bool = True
    fp8_dtype: torch.dtype = FP8
    kind = "mla"
    segments = ("kv_latent",)

    def block_size(self, kv_layer):
        return _pages(kv_layer).shape[1]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        rows = _rows(kv_layer, block_ids, num_tokens)
        vals = rows.contiguous().view(self.fp8_dtype).float() * self.k_scale
        d = vals.shape[-1] - self.rope_dim
        out[0][:, :d].copy_(vals[:, :d])
        out[0][:, d:].copy_(_engine_rope(vals[:, d:], self.deinterleave_rope))


@dataclass(frozen=True)
class DsaIndexerKeys:
    """DEEPSEEK_V32_INDEXER key cache: per block, B x D e4m3 values, then B float32 scales."""

    index_head_dim: int
    rope_dim: int
    deinterleave_rope: bool = False  # GLM's interleaved indexer rope
    shuffled: bool = False  # ROCm's tiled value layout
    fp8_dtype: torch.dtype = FP8
    kind = "mla"
    segments = ("index_k",)

    def block_size(self, kv_layer):
        return _pages(kv_layer).shape[1]

    def _check(self, kv_layer: torch.Tensor) -> None:
        d = self.index_head_dim
        if d % INDEX_QUANT_BLOCK:
            raise ValueError(f"vLLM's indexer cache needs index_head_dim a multiple of {INDEX_QUANT_BLOCK} "
                             f"(its page has no room for the scales otherwise), got {d}")
        want = d + d // INDEX_QUANT_BLOCK * 4
        if kv_layer.element_size() != 1 or kv_layer.shape[-1] != want:
            raise ValueError(f"indexer cache must hold {want} bytes per token (index_head_dim {d} + scale), "
                             f"got {kv_layer.dtype} {tuple(kv_layer.shape)}")

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        self._check(kv_layer)
        d = self.index_head_dim
        pages = _pages(kv_layer).index_select(0, block_ids).view(torch.uint8)  # [nb, B, D + 4]
        nb, bsz = pages.shape[:2]
        flat = pages.reshape(nb, -1)  # each block's bytes in the order vLLM's kernels address them
        values = flat[:, : bsz * d]
        if self.shuffled:  # [B/16, D/16, 16 tokens, 16 bytes] -> [B, D]
            values = values.reshape(nb, bsz // SHUFFLE_BLOCK_TILE, d // SHUFFLE_HEAD_TILE, SHUFFLE_BLOCK_TILE,
                                    SHUFFLE_HEAD_TILE).permute(0, 1, 3, 2, 4)
        values = values.reshape(nb * bsz, d)[:num_tokens]
        scales = flat[:, bsz * d : bsz * (d + 4)].contiguous().view(torch.float32).reshape(-1)[:num_tokens]
        keys = values.contiguous().view(self.fp8_dtype).float() * scales[:, None]
        if self.deinterleave_rope and self.rope_dim:
            keys = torch.cat((_engine_rope(keys[:, : self.rope_dim], True), keys[:, self.rope_dim :]), dim=-1)
        out[0].copy_(keys)


def sparse_mla_adapter(kv_cache_dtype: str, *, rope_dim: int, kv_lora_rank: int, rope_interleave: bool = True,
                       k_scale: float = 1.0, fp8_dtype: torch.dtype = FP8):
    """The latent cache's adapter of a sparse-MLA layer by its ``kv_cache_dtype`` (as vLLM canonicalized it)."""
    if kv_cache_dtype in ("auto", "bfloat16", "float16"):
        return MlaLatent(rope_dim=rope_dim, deinterleave_rope=rope_interleave)
    if kv_cache_dtype == "fp8_ds_mla":
        return DsMlaFp8(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, deinterleave_rope=rope_interleave,
                        fp8_dtype=fp8_dtype)
    if kv_cache_dtype in FP8_DTYPES:
        return MlaLatentFp8(rope_dim=rope_dim, k_scale=float(k_scale), deinterleave_rope=rope_interleave,
                            fp8_dtype=fp8_dtype)
    raise ValueError(f"sparse-MLA kv cache dtype {kv_cache_dtype!r} has no expresslane adapter: supported are "
                     f"auto, bfloat16, float16, fp8_ds_mla, {', '.join(FP8_DTYPES)} (nvfp4_ds_mla is not "
                     "handed over: serve with --kv-cache-dtype fp8 or auto)")
