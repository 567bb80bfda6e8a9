"""FP8 weights in the engine: how they are held and the reference step's dequantizing linear.

A quantized engine parameter ``name`` (a linear weight [N, K] or stacked experts [E, N, K]) is
stored in ``torch.float8_e4m3fn`` and its scale as the float32 parameter ``name + "_scale"``:

- per output channel: ``[N]`` (``[E, N]``) -- compressed-tensors "channel" scales, and "tensor"
  scales widened to every row, so q/k/v or gate/up with their own per-tensor scales fuse exactly;
- per block: ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]``) with ``(bn, bk)`` the checkpoint's block.

``w = fp8 * scale``. :func:`attach` hangs the scale (``.scale``), the block (``.block``, None for
channel scales) and the activation quantization (``.act``) on the model's weight so the reference
step's :func:`linear` and the expert matmuls (:func:`expert`, :func:`expert_matmul`) dequantize in
torch just before use: the FP8 bytes stay in memory and CI covers the numerics on CPU.

Activations: where the checkpoint's scheme quantizes them dynamically (compressed-tensors
FP8_DYNAMIC: per token; block-scaled weights: per 128 features), vLLM's prefill runs W8A8, so the
engine passes x through the same FP8 rounding (:func:`quantize_activations`, vLLM's formula) and
computes in float32; the decode then picks vLLM's tokens where a near tie would otherwise part
them. Otherwise (weight-only, or static input scales, which are not applied) the weight is
dequantized to x's dtype: a dequantized bf16 checkpoint's numerics exactly.
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


ACT_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic activation scales


def quantize_activations(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x through vLLM's dynamic FP8 activation quantization and back, in float32: one scale per
    token (``group`` None) or per ``group`` consecutive features (block-scaled checkpoints)."""
    shape, k = x.shape, x.shape[-1]
    xf = x.float()
    if group is not None:  # a last partial group (k not a multiple) is padded with zeros
        xf = F.pad(xf, (0, -k % group)).reshape(*shape[:-1], -1, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=ACT_MIN_SCALE)
    q = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(*shape[:-1], -1)[..., :k]


def weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A model weight ready for a matmul in ``dtype``: dequantized when it is FP8 (see :func:`attach`)."""
    return dequantize(w, w.scale, w.block, dtype) if is_fp8(w) else w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that reads an FP8 weight (dequantized to x's dtype) as well as a plain one;
    where the checkpoint quantizes activations dynamically (``w.act``), x goes through FP8 too."""
    if not is_fp8(w):
        return F.linear(x, w, b)
    if w.act is not None:
        xq = quantize_activations(x, w.act if w.act > 0 else None)
        return F.linear(xq, dequantize(w, w.scale, w.block), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, weight(w, x.dtype), b)


def expert(w: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e`` of stacked experts ``w`` [E, N, K], for :func:`linear`."""
    if not is_fp8(w):
        return w[e]
    out = w[e]
    out.scale, out.block, out.act = w.scale[e], w.block, w.act
    return out


def expert_matmul(equation: str, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``einsum(equation, x, w[ids])`` over gathered experts, as :func:`linear` computes an FP8 one."""
    if not is_fp8(w):
        return torch.einsum(equation, x, w[ids])
    if w.act is None:
        return torch.einsum(equation, x, dequantize(w[ids], w.scale[ids], w.block, x.dtype))
    xq = quantize_activations(x, w.act if w.act > 0 else None)
    return torch.einsum(equation, xq, dequantize(w[ids], w.scale[ids], w.block)).to(x.dtype)


def activation_group(spec) -> int | None:
    """``.act`` of a checkpoint's FP8 weights (see :func:`attach`) from its QuantSpec: vLLM
    quantizes activations dynamically per token, or per block column for block-scaled weights;
    static input scales are not applied (weight-only)."""
    if spec is None or spec.activations != "dynamic":
        return None
    return spec.block[1] if spec.strategy == "block" else 0


def attach(model: torch.nn.Module, scales: dict[str, torch.Tensor], block: tuple[int, int] | None,
           act: int | None = None) -> None:
    """Register each ``<param>_scale`` on the parameter's module (a buffer, so the fast path finds
    it by name) and hang it on the parameter as ``.scale`` with ``.block`` (None: channel scales)
    and ``.act`` (activations: None unquantized, 0 per token, n > 0 per n features)."""
    for name, scale in scales.items():
        owner, _, attr = name[: -len(SCALE_SUFFIX)].rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module.register_buffer(attr + SCALE_SUFFIX, scale, persistent=True)
        param = getattr(module, attr)
        if not is_fp8(param):
            raise ValueError(f"{name} scales {owner}.{attr}, which is {param.dtype}, not float8")
        per_channel = scale.shape == param.shape[:-1]
        param.scale, param.block, param.act = scale, None if per_channel else block, act
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
