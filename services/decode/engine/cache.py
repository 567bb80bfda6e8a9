"""Static KV cache: one preallocated receive buffer per slot, laid out as shared.kvlayout says.

All slots live in one allocation ``buffer [num_slots + 1, slot_nbytes]`` (uint8); row ``slot`` is
that slot's receive buffer (what a Transport registers and a prefill sender writes), and the
per-layer cache tensors are typed views into it, so injected bytes are the cache with no copy.
The extra last row is a scratch slot that padded batch entries may write without harm.

Per cache layer (main layers first, then MTP layers):
- GQA: ``k[layer]``, ``v[layer]``: [num_slots + 1, max_tokens, num_kv_heads, head_dim]; with an FP8
  ``kv_dtype`` (fp8_e4m3 | fp8_e5m2) they are uint8, vLLM's FP8 bytes, and ``scales[layer]`` is the
  layer's (k_scale, v_scale) (kvquant.py says how they are written and read)
- MLA: ``kv[layer]``: [num_slots + 1, max_tokens, kv_lora_rank + qk_rope_head_dim], the normalized
  latent then the roped shared key; with ``kv_dtype`` fp8_e4m3 uint8, vLLM's FP8 latent bytes (the row
  divided by ``scales[layer][0]``, its k_scale, rounded to nearest: kvquant.quantize(nearest=True)). With ``rope_interleave`` (DeepSeek-V3) the rope part holds
  the rotated even elements then the rotated odd ones, as HF transformers' cache does (vLLM keeps
  the rotated pairs adjacent; the prefill adapter de-interleaves them). With sparse attention
  (deepseek_v32, glm_moe_dsa) also ``index_k[layer]`` for each layer with its own indexer:
  [num_slots + 1, max_tokens, index_head_dim], the indexer's keys.

Tensor parallelism (``tp_size`` / ``tp_rank``): the cache is the rank's layout
(``layout_spec(shape, dtype, max_tokens, tp_size, tp_rank)``): GQA views hold the rank's
``layout.kv_heads`` KV heads (heads ``[kv_head_start, kv_head_start + kv_heads)`` of the model),
MLA views the whole latent on every rank.
"""

from __future__ import annotations

import torch

from shared.events import KvLayoutSpec
from shared.kvlayout import FP8_DTYPES, KvShape, layout_spec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, and so on (the name kvlayout uses)."""
    return str(dtype).removeprefix("torch.")


class KvCache:
    """The slots' receive buffers and the per-layer views the models read and write."""

    def __init__(self, shape: KvShape, num_slots: int, max_tokens: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: str | None = None, scales: list[tuple[float, float]] | None = None,
                 tp_size: int = 1, tp_rank: int = 0, kv_nearest: bool = False):
        self.shape = shape
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_tokens = max_tokens
        kv_dtype = kv_dtype or dtype_name(dtype)
        self.kv_format = kv_dtype if kv_dtype in FP8_DTYPES else None  # None: K/V in the model dtype
        # FP8 bytes written rounded to nearest (vLLM's CUDA cache writers) rather than truncated (its CPU writer)
        self.kv_nearest = bool(self.kv_format) and kv_nearest
        self.scales = list(scales) if scales is not None else [(1.0, 1.0)] * shape.num_layers
        if len(self.scales) != shape.num_layers:
            raise ValueError(f"{len(self.scales)} KV scale pairs for {shape.num_layers} cache layers")
        self.layout: KvLayoutSpec = layout_spec(shape, kv_dtype, max_tokens, tp_size, tp_rank)
        self.buffer = torch.zeros(num_slots + 1, self.layout.slot_nbytes, dtype=torch.uint8, device=device)
        typed = self.buffer if self.kv_format else self.buffer.view(dtype)
        elt = typed.element_size()
        rows = num_slots + 1
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.kv: list[torch.Tensor] = []
        self.index_k: dict[int, torch.Tensor] = {}  # layer -> its indexer keys
        for seg in self.layout.segments:
            start = seg.offset_bytes // elt
            region = typed[:, start : start + max_tokens * seg.bytes_per_token // elt]
            if shape.kind == "gqa":
                view = region.view(rows, max_tokens, self.layout.kv_heads, shape.head_dim)
                (self.k_caches if seg.name == "k" else self.v_caches).append(view)
            elif seg.name == "index_k":
                self.index_k[seg.layer] = region.view(rows, max_tokens, shape.index_head_dim)
            else:
                self.kv.append(region.view(rows, max_tokens, shape.kv_lora_rank + shape.qk_rope_head_dim))

    def slot_buffer(self, slot: int) -> torch.Tensor:
        """uint8 [slot_nbytes]: the slot's cache memory, allocated once."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} does not exist: this engine has slots 0..{self.num_slots - 1}")
        return self.buffer[slot]
