"""FP8 KV cache (GQA), kept as vLLM keeps it, so prefill's cache bytes are the decode slot's bytes.

How vLLM's CPU build stores an FP8 KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``,
vllm/v1/attention/backends/cpu_attn.py and csrc/cpu/cpu_attn_fp8.hpp, cpu_attn_vec.hpp):

- **Tensor.** Every FP8 name allocates the cache as ``torch.uint8`` (STR_DTYPE_TO_TORCH_DTYPE), one
  byte per element, same shape as an auto cache: ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` per layer, K transposed ``[head_size, block_size]`` then V ``[block_size,
  head_size]`` inside each (block, head) for the ``vec`` ISA (the one an FP8 cache gets on x86
  without AMX; with AMX and bf16 the ``amx`` packing holds the same bytes in its tile order).
  ``fp8`` means E4M3 (OCP ``float8_e4m3fn``: bias 7, max 448, 0x7F/0xFF NaN); ``fp8_e5m2`` is
  ``float8_e5m2`` (bias 15, max 57344). FP8 KV on CPU needs x86 with AVX-512 or AMX and
  ``head_size % 32 == 0``.
- **Scales.** One float ``k_scale`` and one ``v_scale`` per attention layer (per tensor;
  ``layer._k_scale_float`` / ``_v_scale_float``). They default to 1.0. A checkpoint with a
  ``quantization_config`` whose method gives attention layers a KV-cache method (``fp8``,
  ``compressed-tensors`` with a ``kv_cache_scheme``, ModelOpt, ...) may carry calibrated scales:
  ``self_attn.k_scale`` / ``v_scale`` (llm-compressor's and vLLM's default names),
  ``self_attn.{k,v}_proj.{k,v}_scale`` (ModelOpt), ``self_attn.qkv_proj.{k,v}_scale`` or the
  deprecated single ``self_attn.kv_scale`` (used for both). vLLM takes them only where both are
  positive (or one, duplicated); without a quantization config a checkpoint's scale tensors are
  ignored and the scales stay 1.0 (BaseKVCacheMethod.process_weights_after_loading).
- **Write (quantize).** ``cpu_attn_reshape_and_cache`` stores ``x / scale`` (computed as
  ``float(x) * (1.0f / scale)`` in fp32), clamped to the format's max, **truncated toward zero**
  (not rounded to nearest): E4M3 by taking bits [26:20] of ``v * 2^-120`` (0x7F never written),
  E5M2 by dropping the low mantissa bits (subnormals shifted). ``+0/-0`` give 0x00; a non-zero
  value that truncates to zero keeps its sign (0x80).
- **Read (dequantize).** The attention kernel loads each byte as its exact FP8 value (E4M3 via a
  pseudo-FP16 with bias 15, corrected by ``2^8``) in fp32, folds ``k_scale`` into the softmax scale
  and ``v_scale`` into the output, and computes Q (upcast to fp32) K^T, softmax and P V in fp32.
  That is attention over ``K = fp8(byte) * k_scale``, ``V = fp8(byte) * v_scale`` in fp32.

MLA (DeepSeek family): vLLM's CUDA MLA backends keep an FP8 latent cache as E4M3 (``--kv-cache-dtype fp8``;
its CPU MLA backend has no FP8 cache): each token's ``[latent, k_pe]`` row divided by the layer's ``k_scale``
(one per-tensor scale, ``v_scale`` unused), rounded to nearest (:func:`quantize`'s ``nearest``), and attention
reads ``fp8(byte) * k_scale`` for both the keys and the values (the latent).

The engine's reference step does the same: :func:`quantize` is a byte-exact torch twin of vLLM's
CPU writer (so tokens the engine decodes itself land in the cache as vLLM would write them), and
:func:`dequantize` gives the fp32 K/V its attention reads. vLLM's ``--calculate-kv-scales`` (scales
measured on the first batch at run time) is not followed: a decode node uses the checkpoint's scales.
"""

from __future__ import annotations

from typing import Callable

import torch

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def quantize(x: torch.Tensor, scale: float, fmt: str, nearest: bool = False) -> torch.Tensor:
    """uint8 bytes of ``x / scale`` in ``fmt`` (fp8_e4m3 | fp8_e5m2): truncated toward zero as vLLM's CPU cache
    writer stores them, or with ``nearest`` rounded to nearest (ties to even) as its CUDA writers do
    (``reshape_and_cache_flash``, ``concat_and_cache_mla``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE,
    ...)``); both saturate at the format's max. The quotient is ``x`` times the fp32 inverse (vLLM's CUDA
    writers divide: the two can part at an exact rounding tie of the quotient)."""
    v = x.float() * torch.tensor(1.0 / scale, dtype=torch.float32).item()  # fp32 inverse, as the kernel's
    m = _MAX[fmt]
    v = v.clamp(-m, m)
    if nearest:
        return v.to(FP8_FORMATS[fmt]).view(torch.uint8)
    if fmt == "fp8_e4m3":
        bits = (v * 2.0**-120).view(torch.int32)
        sign = (bits >> 24) & 0x80
        payload = ((bits >> 20) & 0x7F).clamp(max=0x7E)
        out = torch.where(payload == 0, sign, sign | payload)
    else:
        bits = v.view(torch.int32)
        sign = (bits >> 24) & 0x80
        exp = ((bits >> 23) & 0xFF) - 127
        normal = sign | ((exp + 15).clamp(min=0, max=31) << 2) | ((bits >> 21) & 0x03)
        shift = (-14 - exp).clamp(min=0)
        mant = (0x800000 | (bits & 0x7FFFFF)) >> (shift + 21).clamp(max=31)
        sub = torch.where(shift + 21 >= 32, sign, sign | mant.clamp(max=3))
        out = torch.where(exp < -14, sub, normal)
    return torch.where(v == 0, torch.zeros_like(out), out).to(torch.uint8)


def dequantize(q: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 FP8 bytes times ``scale``, as vLLM's CPU attention reads them."""
    return q.view(FP8_FORMATS[fmt]).float() * scale


_SCALE_NAMES = {  # vLLM's checkpoint names of a layer's K and V scales (weight_utils.maybe_remap_kv_scale_name)
    "k": ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.qkv_proj.k_scale", "self_attn.kv_scale"),
    "v": ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.qkv_proj.v_scale", "self_attn.kv_scale"),
}


def checkpoint_scales(raw_config: dict, num_layers: int, has: Callable[[str], bool],
                      get: Callable[[str], torch.Tensor]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer as vLLM would use them for this checkpoint: the calibrated
    per-tensor scales where the checkpoint has a quantization config and carries them, else 1.0."""
    prefix = "model.layers.{}."
    quantized = bool(raw_config.get("quantization_config") or raw_config.get("compression_config"))
    out = []
    for i in range(num_layers):
        found = {}
        for which, names in _SCALE_NAMES.items():
            name = next((prefix.format(i) + n for n in names if has(prefix.format(i) + n)), None)
            if quantized and name is not None:
                t = get(name)
                if t.numel() != 1:
                    raise ValueError(f"{name} has {t.numel()} elements: only per-tensor FP8 KV scales are supported")
                found[which] = float(t.float().reshape(()))
        k, v = found.get("k", -1.0), found.get("v", -1.0)
        if k > 0 and v > 0:
            out.append((k, v))
        elif k > 0 or v > 0:
            s = max(k, v)
            out.append((s, s))
        else:
            out.append((1.0, 1.0))
    return out


__all__ = ["FP8_FORMATS", "checkpoint_scales", "dequantize", "quantize"]
