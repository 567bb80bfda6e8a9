"""FP8 KV cache in the fast path's kernels: vLLM's FP8 bytes (engine/kvquant.py), written and read in Triton.

``KV_FMT`` (a kernel's constexpr): 0 the model dtype, 1 float8_e4m3fn, 2 float8_e5m2, each written truncated
toward zero as vLLM's CPU cache writer does; 3 / 4 the same formats written rounded to nearest as vLLM's CUDA
cache writers do (``reshape_and_cache_flash``, ``concat_and_cache_mla``) (:func:`kv_fmt`; readers see 1 and 3,
2 and 4 alike).
- :func:`fp8_kv_bits`: the byte kvquant.quantize stores for an fp32 value (a bf16 number) and the
  layer's fp32 ``1 / scale``: ``x * inv_scale`` clamped to the format's max, truncated toward zero or
  rounded to nearest (ties to even), in integer arithmetic (E4M3 truncated: the bits of ``v * 2^-120`` with
  the IEEE round-to-nearest-even of its subnormal range spelled out, so no flush-to-zero of the compiled
  multiply can change a byte).
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
NEAREST = 2  # added to an FP8 format's KV_FMT: its bytes written rounded to nearest, not truncated


def kv_fmt(kv_format: str | None, nearest: bool = False) -> int:
    """The kernels' KV_FMT of a cache's kv_format (None: K/V in the model dtype); ``nearest``: written rounded
    to nearest (engine/kvquant.quantize's ``nearest``)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"KV format {kv_format!r}: the fast path reads {', '.join(map(str, KV_FORMATS))}")
    code = KV_FORMATS[kv_format]
    return code + NEAREST if code and nearest else code


def inv_scales(scales: list[tuple[float, float]] | None, num_layers: int) -> list[tuple[float, float]]:
    """Per layer (1 / k_scale, 1 / v_scale) as Python floats (the kernels take them as fp32, as
    kvquant.quantize rounds its inverse), (1.0, 1.0) without scales."""
    scales = scales if scales is not None else [(1.0, 1.0)] * num_layers
    return [(1.0 / k, 1.0 / v) for k, v in scales]


def kv_cache_setup(kv_format: str | None, kv_scales: list[tuple[float, float]] | None, num_layers: int,
                   k_caches: list[torch.Tensor], nearest: bool = False
                   ) -> tuple[int, list[tuple[float, float]], list[tuple[float, float]]]:
    """A decode step's KV cache format: (KV_FMT, per-layer (k_scale, v_scale), their inverses); an FP8 format
    needs uint8 caches (the FP8 bytes)."""
    fmt = kv_fmt(kv_format, nearest)
    scales = list(kv_scales) if kv_scales is not None else [(1.0, 1.0)] * num_layers
    if fmt and k_caches[0].dtype != torch.uint8:
        raise ValueError(f"KV format {kv_format}: the caches must be uint8 (FP8 bytes), got {k_caches[0].dtype}")
    return fmt, scales, inv_scales(scales, num_layers)


@triton.jit
def _scaled_fields(x, inv_scale, E4M3: tl.constexpr):
    # x * inv_scale clamped to the format's max, as fp32 bits: (bits, sign byte 0x80 or 0, biased exponent, mantissa)
    if E4M3:
        v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    else:
        v = tl.minimum(tl.maximum(x * inv_scale, -57344.0), 57344.0)
    bits = v.to(tl.int32, bitcast=True)
    return bits, (bits >> 24) & 0x80, (bits >> 23) & 0xFF, bits & 0x7FFFFF


@triton.jit
def fp8_kv_bits(x, inv_scale, FMT: tl.constexpr):
    # uint8 bytes of fp32 x (values of bf16 numbers) / scale, as kvquant.quantize writes them
    if FMT > 2:
        return _fp8_nearest_bits(x, inv_scale, FMT == 3)
    bits, sign, e, mant = _scaled_fields(x, inv_scale, FMT == 1)
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
def _round_half_even(full, sh):
    # full >> sh rounded to nearest, ties to even (non-negative int32 full, 1 <= sh <= 30)
    r = full >> sh
    rest = full - (r << sh)
    half = 1 << (sh - 1)
    return r + ((rest > half) | ((rest == half) & ((r & 1) == 1))).to(tl.int32)


@triton.jit
def _fp8_nearest_bits(x, inv_scale, E4M3: tl.constexpr):
    # uint8 bytes of fp32 x * inv_scale rounded to nearest (ties to even), saturated at the format's max, sign of
    # zero kept: kvquant.quantize(nearest=True), as vLLM's CUDA cache writers store them, in integer arithmetic.
    # A normal FP8 value keeps the top mantissa bits with the dropped ones rounded (a carry rolls into the
    # exponent; the clamp keeps it off the format's NaN / inf codes); a subnormal one counts units of its
    # smallest step (E4M3 2^-9, E5M2 2^-16): full * 2^(e - 150) / unit, rounded (shift capped at 30: int32)
    bits, sign, e, mant = _scaled_fields(x, inv_scale, E4M3)
    full = tl.where(e > 0, mant | 0x800000, mant)
    if E4M3:  # normal from 2^-6 (e >= 121): 3 mantissa bits of 23
        normal = _round_half_even(((e - 120) << 23) | mant, 20)
        sub = _round_half_even(full, tl.minimum(tl.maximum(141 - e, 21), 30))
        out = tl.where(e >= 121, normal, sub)
    else:  # normal from 2^-14 (e >= 113): 2 mantissa bits of 23
        normal = _round_half_even(((e - 112) << 23) | mant, 21)
        sub = _round_half_even(full, tl.minimum(tl.maximum(134 - e, 22), 30))
        out = tl.where(e >= 113, normal, sub)
    return (sign | out).to(tl.uint8)


@triton.jit
def fp8_kv_unpack(raw, FMT: tl.constexpr):
    # FP8 bytes -> fp16 on a CUDA device, four bytes (one register) per instance, in the layout the tile was
    # loaded in (rows contiguous). E4M3: the register's two halves widened by one cvt each (sm_89+: the engine
    # keeps E4M3 caches of older GPUs off the fast path, fastpath.engine_reason); FMT 0: returned as they are
    if FMT == 0:
        return raw
    elif FMT % 2 == 1:  # E4M3 (1, 3)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:  # E5M2 (2, 4): an E5M2 byte is the high byte of the fp16 with its value: byte placement, any GPU
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;",
            "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)


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
    if FMT == 0:
        return raw
    elif FMT % 2 == 1:  # E4M3 (1, 3)
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:  # E5M2 (2, 4)
        return raw.to(tl.float8e5, bitcast=True).to(tl.float16)


@triton.jit
def kv_store_row(ptr, x, inv_scale, dt, FMT: tl.constexpr, mask=None):
    # store fp32 x (values of model-dtype numbers) into a cache row: as dt, or as FP8 bytes
    if FMT == 0:
        tl.store(ptr, x.to(dt), mask=mask)
    else:
        tl.store(ptr, fp8_kv_bits(x, inv_scale, FMT), mask=mask)
