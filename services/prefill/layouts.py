"""Layout adapters: vLLM's paged KV cache of one layer -> the decode engine's native layout.

Contract: ``adapter(kv_layer, block_ids, num_tokens, out)`` reads the first ``num_tokens`` tokens of
one request (its blocks ``block_ids``, in order) from vLLM's cache tensor of one layer and writes them
into ``out``, the staging views of that layer in the native layout (shared.kvlayout):

- GQA: ``out = [k, v]``, each ``[num_tokens, num_kv_heads, head_dim]`` (K after rope / q-k norm);
- MLA: ``out = [latent]``, ``[num_tokens, kv_lora_rank + qk_rope_head_dim]``: the normalized latent,
  then the roped ``k_pe`` in the engine's order (see ``MlaLatent.deinterleave_rope``).

One adapter per vLLM layout (the tensor as vLLM registers it with a connector):

| name          | vLLM backend                   | registered tensor, per layer                       |
| ------------- | ------------------------------ | -------------------------------------------------- |
| cpu_vec       | CPU_ATTN, isa vec/vec16/...    | [NB, H, B, 2D]; per (block, head): K^T [D, B], V [B, D] |
| cpu_amx       | CPU_ATTN, isa amx (bf16)       | [NB, H, B, 2D]; K [B/16, D/2, 16, 2], V [D/16, B/2, 16, 2] |
| flash_attn    | FLASH_ATTN, TRITON_ATTN, ...   | [2, NB, B, H, D] (NHD; HND is a stride permutation) |
| flashinfer    | FLASHINFER                     | [NB, 2, B, H, D] (NHD; HND is a stride permutation) |
| mla           | CPU_MLA, AMX_MLA, FLASHMLA, TRITON_MLA, FLASHINFER_MLA, CUTLASS_MLA | [NB, B, Dl + Dr] or [NB, 1, B, Dl + Dr] |

Sparse attention (deepseek_v32, glm_moe_dsa: the ``*_MLA_SPARSE`` latent caches, plain or FP8, and
the DEEPSEEK_V32_INDEXER key cache) has its adapters in ``services.prefill.layouts_dsa``.

GPU layouts are indexed through the logical shape, so whether vLLM allocated NHD or HND (a stride
permutation of the same logical tensor) does not matter. Pure torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

# AMX tiles: 64-byte rows; K groups 16 tokens, V packs token pairs in 16-column tiles (bf16).
_AMX_ROW_BYTES = 64


class LayerAdapter(Protocol):
    kind: str  # "gqa" | "mla"
    segments: tuple[str, ...]  # the native-layout segments of its layer it fills, in ``out`` order

    def block_size(self, kv_layer: torch.Tensor) -> int:
        """Tokens per block of the registered tensor (the kernel block size)."""
        ...

    def __call__(self, kv_layer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
                 out: list[torch.Tensor]) -> None: ...


def _gather_tokens(x: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
    """``x`` [nb, B, ...] -> out[:num_tokens] (first tokens of the concatenated blocks), copied
    straight into ``out`` (a permuted ``x`` is not made contiguous on the way: one pass, not two)."""
    block_size = x.shape[1]
    full = min(num_tokens // block_size, x.shape[0])
    if full:
        out[:full * block_size].view(full, block_size, *x.shape[2:]).copy_(x[:full])
    rest = num_tokens - full * block_size
    if rest:
        out[full * block_size:num_tokens].copy_(x[full, :rest])


# Blocks at least this large are copied one by one from the cache into the staging segments (one
# pass over the bytes); smaller ones are gathered first (one op for all blocks: ~3 us an op matters).
CPU_BLOCKWISE_MIN_TOKENS = 64


@dataclass(frozen=True)
class CpuVec:
    """CPU_ATTN "vec" family: inside each (block, head) K is stored transposed, then V row-major."""

    kind = "gqa"
    segments = ("k", "v")

    def block_size(self, kv_layer):
        return kv_layer.shape[2]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        block_size = kv_layer.shape[2]
        if block_size >= CPU_BLOCKWISE_MIN_TOKENS:  # 675 tokens, 128-token blocks: 0.17 -> 0.14 ms; 4K x 8 heads: 13 -> 6
            for i, block in enumerate(block_ids.tolist()):
                lo = i * block_size
                if lo >= num_tokens:
                    break
                k, v = self._tokens(kv_layer[block:block + 1])
                n = min(block_size, num_tokens - lo)
                out[0][lo:lo + n].copy_(k[0, :n])
                out[1][lo:lo + n].copy_(v[0, :n])
            return
        k, v = self._tokens(kv_layer.index_select(0, block_ids))
        _gather_tokens(k, num_tokens, out[0])
        _gather_tokens(v, num_tokens, out[1])

    @staticmethod
    def _tokens(blocks):
        """Blocks [nb, H, B, 2D] of this layout -> K and V views [nb, B, H, D]."""
        nb, num_heads, block_size, two_d = blocks.shape
        head_dim = two_d // 2
        kv = blocks.view(nb, num_heads, 2, block_size * head_dim)
        k = kv[:, :, 0].view(nb, num_heads, head_dim, block_size).permute(0, 3, 1, 2)
        v = kv[:, :, 1].view(nb, num_heads, block_size, head_dim).permute(0, 2, 1, 3)
        return k, v


@dataclass(frozen=True)
class CpuAmx:
    """CPU_ATTN "amx" (bf16/fp16): VNNI-packed K (pairs of dims per 32-bit word, 16-token groups)
    and V (pairs of tokens per 32-bit word, 16-dim column groups)."""

    kind = "gqa"
    segments = ("k", "v")

    def block_size(self, kv_layer):
        return kv_layer.shape[2]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        num_blocks, num_heads, block_size, two_d = kv_layer.shape
        head_dim = two_d // 2
        # elements per 32-bit word: 2 for bf16; vLLM packs FP8 (uint8) K/V in pairs too, as bf16
        pack = 2 if kv_layer.dtype == torch.uint8 else 4 // kv_layer.element_size()
        k_group = _AMX_ROW_BYTES // 4  # tokens per K group (16)
        v_cols = _AMX_ROW_BYTES // 4  # head dims per V column group (16)
        if block_size % k_group or head_dim % v_cols or head_dim % pack:
            raise ValueError(f"AMX layout needs block_size % 16 == 0 and head_dim % 16 == 0, "
                             f"got block_size {block_size}, head_dim {head_dim}")
        blocks = kv_layer.index_select(0, block_ids).view(-1, num_heads, 2, block_size * head_dim)
        nb = blocks.shape[0]
        # K: (g, j, t, p) = K[g*16 + t, pack*j + p]
        k = blocks[:, :, 0].view(nb, num_heads, block_size // k_group, head_dim // pack, k_group, pack)
        k = k.permute(0, 2, 4, 1, 3, 5).reshape(nb, block_size, num_heads, head_dim)
        # V: (i, s, j, p) = V[pack*s + p, 16*i + j]
        v = blocks[:, :, 1].view(nb, num_heads, head_dim // v_cols, block_size // pack, v_cols, pack)
        v = v.permute(0, 3, 5, 1, 2, 4).reshape(nb, block_size, num_heads, head_dim)
        _gather_tokens(k, num_tokens, out[0])
        _gather_tokens(v, num_tokens, out[1])


@dataclass(frozen=True)
class FlashAttn:
    """FLASH_ATTN-style: logical [2, NB, B, H, D] (K plane, V plane)."""

    kind = "gqa"
    segments = ("k", "v")

    def block_size(self, kv_layer):
        return kv_layer.shape[2]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        _gather_tokens(kv_layer[0].index_select(0, block_ids), num_tokens, out[0])
        _gather_tokens(kv_layer[1].index_select(0, block_ids), num_tokens, out[1])


@dataclass(frozen=True)
class FlashInfer:
    """FLASHINFER: logical [NB, 2, B, H, D]."""

    kind = "gqa"
    segments = ("k", "v")

    def block_size(self, kv_layer):
        return kv_layer.shape[2]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        blocks = kv_layer.index_select(0, block_ids)  # [nb, 2, B, H, D]
        _gather_tokens(blocks[:, 0], num_tokens, out[0])
        _gather_tokens(blocks[:, 1], num_tokens, out[1])


@dataclass(frozen=True)
class MlaLatent:
    """MLA latent cache [NB, B, kv_lora_rank + rope_dim], one row per token: model-dtype values, or with
    ``--kv-cache-dtype fp8`` E4M3 bytes (uint8; the row divided by the layer's k_scale), staged as they are.

    vLLM ropes DeepSeek's ``k_pe`` GPT-J style (rotated pairs stay adjacent); the engine, like HF
    transformers with ``rope_interleave``, keeps the rotated evens then the rotated odds. With
    ``deinterleave_rope`` the adapter reorders the rope part accordingly.
    """

    rope_dim: int
    deinterleave_rope: bool = True
    kind = "mla"
    segments = ("kv_latent",)

    @staticmethod
    def _blocks(kv_layer: torch.Tensor) -> torch.Tensor:
        """[NB, B, C]; vLLM may register it as [NB, 1, B, C] (a single latent "head")."""
        return kv_layer.squeeze(1) if kv_layer.dim() == 4 else kv_layer

    def block_size(self, kv_layer):
        return self._blocks(kv_layer).shape[1]

    def __call__(self, kv_layer, block_ids, num_tokens, out):
        rows = self._blocks(kv_layer).index_select(0, block_ids)
        rows = rows.reshape(-1, rows.shape[-1])[:num_tokens]  # [n, Dl + Dr] on the cache's device
        if rows.dtype in (torch.uint8, torch.float8_e4m3fn):  # an FP8 latent (--kv-cache-dtype fp8): its bytes
            if out[0].dtype != torch.uint8:
                raise ValueError(f"an FP8 MLA latent cache stages into an FP8 slot layout, not {out[0].dtype}: "
                                 "run the decode node with --kv-cache-dtype fp8 (the claim pairs only those)")
            rows = rows.view(torch.uint8)
        if self.deinterleave_rope and self.rope_dim:
            pe = rows[:, -self.rope_dim:]
            rows = torch.cat((rows[:, : -self.rope_dim], pe[:, 0::2], pe[:, 1::2]), dim=-1)
        out[0].copy_(rows)  # one copy into staging (possibly across devices)


# vLLM attention backend name -> adapter factory (MLA factories take the rope settings).
GQA_BACKENDS: dict[str, Callable[[], LayerAdapter]] = {
    "FLASH_ATTN": FlashAttn,
    "TRITON_ATTN": FlashAttn,
    "FLEX_ATTENTION": FlashAttn,
    "ROCM_ATTN": FlashAttn,
    "FLASHINFER": FlashInfer,
}
MLA_BACKENDS = frozenset({
    "CPU_MLA", "AMX_MLA", "FLASHMLA", "TRITON_MLA", "FLASHINFER_MLA", "CUTLASS_MLA",
    "FLASH_ATTN_MLA", "ROCM_AITER_MLA",
})
ADAPTERS = ("cpu_vec", "cpu_amx", "flash_attn", "flashinfer", "mla")


def kernel_block_ids(block_ids: list[int], manager_block_size: int, kernel_block_size: int,
                     num_tokens: int) -> list[int]:
    """The cache tensor's block ids holding the first ``num_tokens`` tokens of a request whose
    scheduler block table is ``block_ids`` (vLLM may split each scheduler block into
    ``manager_block_size // kernel_block_size`` kernel blocks)."""
    if manager_block_size % kernel_block_size:
        raise ValueError(f"scheduler block size {manager_block_size} is not a multiple of the "
                         f"kernel block size {kernel_block_size}")
    split = manager_block_size // kernel_block_size
    ids = [b * split + i for b in block_ids for i in range(split)]
    return ids[: -(-num_tokens // kernel_block_size)]


def adapter_for(backend: str, *, isa: str | None = None, rope_dim: int = 0,
                rope_interleave: bool = True) -> LayerAdapter:
    """Pick the adapter of a vLLM attention backend (``isa``: CPU_ATTN's kernel family)."""
    if backend in MLA_BACKENDS:
        return MlaLatent(rope_dim=rope_dim, deinterleave_rope=rope_interleave)
    if backend == "CPU_ATTN":
        return CpuAmx() if isa == "amx" else CpuVec()
    if backend in GQA_BACKENDS:
        return GQA_BACKENDS[backend]()
    raise ValueError(
        f"vLLM attention backend {backend!r} has no expresslane layout adapter: supported are "
        f"CPU_ATTN, {', '.join(sorted(GQA_BACKENDS))}, {', '.join(sorted(MLA_BACKENDS))}"
    )
