"""FP8 KV cache in the fast path's kernels: vLLM's FP8 bytes (engine/kvquant.py), written and read in Triton.

``KV_FMT`` (a kernel's constexpr): 0 the model dtype, 1 float8_e4m3fn, 2 float8_e5m2 (:func:`kv_fmt`).
- :func:`fp8_kv_bits`: the byte kvquant.quantize stores for an fp32 value (a bf16 number) and the
  layer's fp32 ``1 / scale``: ``x * inv_scale`` clamped to the format's max, truncated toward zero,
  in integer arithmetic (E4M3: the bits of ``v * 2^-120`` with the IEEE round-to-nearest-even of its
  subnormal range spelled out, so no flush-to-zero of the compiled multiply can change a byte).
- :func:`fp8_kv_unpack` (compiled kernels) / :func:`fp8_kv_load` (the same values, Triton's interpreter):
  the cache bytes as their exact FP8 values in fp16 (every E4M3 and E5M2 value is an fp16 number), for
  the attention's fp16 tensor-core dots (cuda/attention.py: ``qk_operand``, ``pv_dot``); the caller
  multiplies by the layer's scale (folded into the softmax scale for K and into the output for V, as
  vLLM's CPU attention does). Unpack is one ``cvt.rn.f16x2.e4m3x2`` per two bytes on the tile as loaded:
  bf16 would take two more conversions per element, and Triton's own conversion gathers the V operand
  byte by byte from shared memory; either held the FP8-KV attention below the bf16-KV one at 32K (run K4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FORMATS = {None: 0, "fp8_e4m3": 1, "fp8_e5m2": 2}


def kv_fmt(kv_format: str | None) -> int:
    """The kernels' KV_FMT of a cache's kv_format (None: K/V in the model dtype)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"KV format {kv_format!r}: the fast path reads {', '.join(map(str, KV_FORMATS))}")
    return KV_FORMATS[kv_format]


def inv_scales(scales: list[tuple[float, float]] | None, num_layers: int) -> list[tuple[float, float]]:
    """Per layer (1 / k_scale, 1 / v_scale) as Python floats (the kernels take them as fp32, as
    kvquant.quantize rounds its inverse), (1.0, 1.0) without scales."""
    scales = scales if scales is not None else [(1.0, 1.0)] * num_layers
    return [(1.0 / k, 1.0 / v) for k, v in scales]


def kv_cache_setup(kv_format: str | None, kv_scales: list[tuple[float, float]] | None, num_layers: int,
                   k_caches: list[torch.Tensor]) -> tuple[int, list[tuple[float, float]], list[tuple[float, float]]]:
    """A decode step's KV cache format: (KV_FMT, per-layer (k_scale, v_scale), their inverses); an FP8 format
    needs uint8 caches (the FP8 bytes)."""
    fmt = kv_fmt(kv_format)
    scales = list(kv_scales) if kv_scales is not None else [(1.0, 1.0)] * num_layers
    if fmt and k_caches[0].dtype != torch.uint8:
        raise ValueError(f"KV format {kv_format}: the caches must be uint8 (FP8 bytes), got {k_caches[0].dtype}")
    return fmt, scales, inv_scales(scales, num_layers)


@triton.jit
def fp8_kv_bits(x, inv_scale, FMT: tl.constexpr):
    # uint8 bytes of fp32 x (values of bf16 numbers) / scale, as kvquant.quantize writes them
    if FMT == 1:
        v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    else:
        v = tl.minimum(tl.maximum(x * inv_scale, -57344.0), 57344.0)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = (bits >> 23) & 0xFF  # biased exponent
    mant = bits & 0x7FFFFF
    if FMT == 1:
        # bits [26:20] of w = v * 2^-120: normal w (e > 120) keeps v's mantissa with exponent e - 120;
        # subnormal w holds round-to-nearest-even(|v| * 2^29) in units of 2^-149
        normal = ((e - 120) << 3) | (mant >> 20)
        full = tl.where(e > 0, mant | 0x800000, mant)
        sh = tl.minimum(121 - e, 25)
        sh = tl.maximum(sh, 1)
        r = full >> sh
        rem = full - (r << sh)
        half = 1 << (sh - 1)
        r = r + ((rem > half) | ((rem == half) & ((r & 1) == 1))).to(tl.int32)
        payload = tl.where(e > 120, normal, (r >> 20) & 0x7F)
        out = sign | tl.minimum(payload, 0x7E)
    else:
        ex = e - 127
        normal = sign | (tl.minimum(tl.maximum(ex + 15, 0), 31) << 2) | ((bits >> 21) & 0x03)
        shift = tl.maximum(-14 - ex, 0)
        m2 = (0x800000 | mant) >> tl.minimum(shift + 21, 31)
        sub = tl.where(shift + 21 >= 32, sign, sign | tl.minimum(m2, 3))
        out = tl.where(ex < -14, sub, normal)
    out = tl.where((e == 0) & (mant == 0), 0, out)
    return out.to(tl.uint8)


@triton.jit
def fp8_e4m3_nearest_bits(x, inv_scale):
    # uint8 E4M3 bytes of fp32 x * inv_scale rounded to nearest (ties to even), saturated at 448, sign of zero
    # kept: kvquant.quantize_nearest, the MLA latent as vLLM's CUDA cache writer stores it, in integer arithmetic
    v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = (bits >> 23) & 0xFF  # biased exponent
    mant = bits & 0x7FFFFF
    # normal E4M3 (|v| >= 2^-6, e >= 121): 3 mantissa bits kept, the 20 dropped rounded; a carry rolls into the
    # exponent (448 = 0x7E is the largest value the clamp lets through, so none reaches 0x7F)
    base = ((e - 120) << 3) | (mant >> 20)
    rem = mant & 0xFFFFF
    normal = base + ((rem > 0x80000) | ((rem == 0x80000) & ((base & 1) == 1))).to(tl.int32)
    # subnormal E4M3: |v| in units of 2^-9 is full * 2^(e - 141), rounded (1 << 31 of e = 0 would overflow: 30)
    full = tl.where(e > 0, mant | 0x800000, mant)
    sh = tl.minimum(tl.maximum(141 - e, 21), 30)
    r = full >> sh
    rest = full - (r << sh)
    half = 1 << (sh - 1)
    r = r + ((rest > half) | ((rest == half) & ((r & 1) == 1))).to(tl.int32)
    return (sign | tl.where(e >= 121, normal, r)).to(tl.uint8)


@triton.jit
def fp8_kv_unpack(raw, FMT: tl.constexpr):
    # FP8 bytes -> fp16 on a CUDA device, four bytes (one register) per instance, in the layout the tile was
    # loaded in (rows contiguous). E4M3: the register's two halves widened by one cvt each (sm_89+: the engine
    # keeps E4M3 caches of older GPUs off the fast path, fastpath.engine_reason); FMT 0: returned as they are
    if FMT == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    elif FMT == 2:  # an E5M2 byte is the high byte of the fp16 with its value: byte placement, any GPU
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;",
            "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return raw


@triton.jit
def fp8_kv_read(raw, FMT: tl.constexpr, INTERPRETED: tl.constexpr):
    # a loaded cache tile as fp16 values: unpacked in PTX when compiled, Triton's conversion under the interpreter
    if INTERPRETED:
        return fp8_kv_load(raw, FMT)
    else:
        return fp8_kv_unpack(raw, FMT)


@triton.jit
def fp8_kv_load(raw, FMT: tl.constexpr):
    # cache elements as loaded -> fp16 values (FMT 0: returned as they are)
    if FMT == 1:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FMT == 2:
        return raw.to(tl.float8e5, bitcast=True).to(tl.float16)
    else:
        return raw


@triton.jit
def kv_store_row(ptr, x, inv_scale, dt, FMT: tl.constexpr, mask=None):
    # store fp32 x (values of model-dtype numbers) into a cache row: as dt, or as FP8 bytes
    if FMT == 0:
        tl.store(ptr, x.to(dt), mask=mask)
    else:
        tl.store(ptr, fp8_kv_bits(x, inv_scale, FMT), mask=mask)
