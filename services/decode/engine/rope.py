"""Rotary position embeddings: inverse frequencies (default, linear, llama3, yarn) and their application.

``rope_tables`` precomputes cos/sin for every position once ([max_pos, dim/2] each, float32); the
hot path only gathers rows by position. Two pairings exist: "neox" rotates the halves of the head
(Llama, Qwen), "interleave" rotates adjacent pairs (DeepSeek with ``rope_interleave``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context scale factor."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    orig = params.get("original_max_position_embeddings") or max_pos
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(params: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low_ff, high_ff = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_freq_and_scale(params: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale of one rope configuration."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        return _yarn(params, dim, base, max_pos)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "llama3":
        inv_freq = _llama3(params, inv_freq)
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    return inv_freq, 1.0


def rope_tables(params: dict[str, Any], dim: int, max_pos: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_pos, dim/2] in float32 (attention scaling folded in)."""
    inv_freq, scale = inv_freq_and_scale(params, dim, max_pos)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)


def rope_factors(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., T, dim/2] as :func:`rotate` takes them: ``[cos | cos]`` and ``[-sin | sin]``, [..., T, 1, dim]
    in ``dtype`` (once a step, not once a layer)."""
    return (torch.cat((cos, cos), dim=-1).unsqueeze(-2).to(dtype),
            torch.cat((-sin, sin), dim=-1).unsqueeze(-2).to(dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate ``x`` [..., T, H, dim] with :func:`rope_factors`' cos/sin (x's dtype): ``x * [cos | cos] +
    [x2 | x1] * [-sin | sin]``, the halves' pairs (neox); ``interleave``: adjacent pairs, their evens and odds laid
    out as halves first (one copy), so the result is rotated evens then rotated odds, as HF transformers returns
    them. The same products and sums as HF's ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` (a - b is a + (-b)
    exactly, in any dtype), in four ops instead of nine (a CPU step's ops cost ~2 us each whatever their size)."""
    if interleave:
        x = x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
