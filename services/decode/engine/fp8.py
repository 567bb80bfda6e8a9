"""FP8 weights in the engine: how they are held and the reference step's dequantizing linear.

A quantized engine parameter ``name`` (a linear weight [N, K] or stacked experts [E, N, K]) is
stored in ``torch.float8_e4m3fn`` and its scale as the float32 parameter ``name + "_scale"``:

- per output channel: ``[N]`` (``[E, N]``) -- compressed-tensors "channel" scales, and "tensor"
  scales widened to every row, so q/k/v or gate/up with their own per-tensor scales fuse exactly;
- per block: ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]``) with ``(bn, bk)`` the checkpoint's block.

``w = fp8 * scale``. :func:`attach` hangs the scale (``.scale``) and the block (``.block``, None
for channel scales) on the model's weight so the reference step's :func:`linear` and the expert
gathers (:func:`expert`, :func:`gather_experts`) dequantize in torch, in the activations' dtype,
just before use: the FP8 bytes stay in memory and CI covers the numerics on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALE_SUFFIX = "_scale"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...], block: tuple[int, int] | None) -> torch.Tensor:
    """The scale broadcast to a weight of ``shape`` ([..., N, K]): [..., N, 1] or [..., N, K]."""
    if block is None:
        return scale[..., None]
    n, k = shape[-2], shape[-1]
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 ``w`` [..., N, K] times its scale, in float32, returned in ``dtype``."""
    return (w.float() * expand_scale(scale.float(), w.shape, block)).to(dtype)


def weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A model weight ready for a matmul in ``dtype``: dequantized when it is FP8 (see :func:`attach`)."""
    return dequantize(w, w.scale, w.block, dtype) if is_fp8(w) else w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that reads an FP8 weight (dequantized to x's dtype) as well as a plain one."""
    return F.linear(x, weight(w, x.dtype), b)


def expert(w: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of stacked experts ``w`` [E, N, K], dequantized when FP8."""
    return dequantize(w[e], w.scale[e], w.block, dtype) if is_fp8(w) else w[e]


def gather_experts(w: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w[ids]`` of stacked experts (ids of any shape), dequantized when FP8."""
    return dequantize(w[ids], w.scale[ids], w.block, dtype) if is_fp8(w) else w[ids]


def attach(model: torch.nn.Module, scales: dict[str, torch.Tensor], block: tuple[int, int] | None) -> None:
    """Register each ``<param>_scale`` on the parameter's module (a buffer, so the fast path finds
    it by name) and hang it on the parameter as ``.scale`` with ``.block`` (None: channel scales)."""
    for name, scale in scales.items():
        owner, _, attr = name[: -len(SCALE_SUFFIX)].rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module.register_buffer(attr + SCALE_SUFFIX, scale, persistent=True)
        param = getattr(module, attr)
        if not is_fp8(param):
            raise ValueError(f"{name} scales {owner}.{attr}, which is {param.dtype}, not float8")
        per_channel = scale.shape == param.shape[:-1]
        param.scale, param.block = scale, None if per_channel else block
        if not per_channel and block is None:
            raise ValueError(f"{name} has block scales {tuple(scale.shape)} but the checkpoint names no block size")


def has_fp8(model: torch.nn.Module) -> bool:
    return any(is_fp8(p) for p in model.parameters())


def fp8_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(FP8 weight bytes, their scales' bytes, every other parameter's bytes) of a model."""
    fp8 = scales = other = 0
    for p in model.parameters():
        if is_fp8(p):
            fp8 += p.numel()
            scales += p.scale.numel() * p.scale.element_size()
        else:
            other += p.numel() * p.element_size()
    return fp8, scales, other
