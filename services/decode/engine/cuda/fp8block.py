"""Block-scaled FP8 weights on the fast path (the ``fp8`` method's checkpoints: DeepSeek-V3 / R1 and Qwen's FP8
releases, 128 x 128 blocks), for the DeepSeek family's GEMVs and through them the Llama family's block-scaled step.

A :class:`BlockFp8` is a weight's float8_e4m3fn bytes ``w`` [..., N, K] and its float32 dequantization
multipliers ``scale`` [..., ceil(N / rows), ceil(K / cols)] (``w = fp8 * scale`` blockwise, engine/fp8.py):
``rows`` is the checkpoint's block height, or a divisor of it where projections with their own scales are
stacked (the fused wkv_a | wq_a of q LoRA: wkv_a's 576 rows put wq_a's first row mid-block, so the stack keeps
64-row scale rows). ``act``: the checkpoint quantizes activations dynamically per ``cols`` features (vLLM's W8A8
block path), and the kernels round each input group to FP8 the same way.

The GEMV kernels (moe.py: ``gemv_rows``, the grouped experts) read the FP8 bytes and apply the scales in the
kernel: a program's rows lie in one scale row (its ``BLOCK_N`` divides ``rows``), so on the one-token FMA path each
input column is multiplied by its block's scale once per program (:func:`fp8_fma`) and the weight streams as
bytes; on the tensor-core path (several tokens) the K loop steps one block at a time and scales each block's partial
dot (:func:`fp8_block_dot`). The Llama family's one-token step rounds each GEMV input once instead (fp8.py,
:func:`round_groups`' values, read by :func:`fp8_fma_rounded`). The weight is never widened in memory: a step reads
half the bytes of bf16. Numerics are the engine's reference linear's (engine/fp8.py): with ``act`` the input rounded
per group and the weight's exact FP8 values times its scales; weight-only, the weight dequantized to bf16 (a
dequantized checkpoint). Blocks are powers of two of 16 or more (the tensor-core tiles' least side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kernel_helpers import act_round, act_scale, rnd_bf16

FP8_MAX = 448.0
ACT_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic activation scales

# the fewest weight rows (and columns) a scale block may cover: the tensor-core tiles' least side; a stack whose
# parts would need finer scale rows takes plain() (weight-only: dequantized to bf16, the reference's numerics)
MIN_ROWS = 16


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``w`` [..., N, K] times its block scales, in float32, returned in ``dtype`` (engine/fp8.dequantize's
    twin: this package imports nothing from the engine)."""
    n, k = w.shape[-2], w.shape[-1]
    full = scale.float().repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return (w.float() * full).to(dtype)


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through vLLM's dynamic FP8 rounding per ``group`` consecutive features and back, in float32 (a last partial
    group padded with zeros; engine/fp8.quantize_activations' twin)."""
    shape, k = x.shape, x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -k % group)).reshape(*shape[:-1], -1, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=ACT_MIN_SCALE)
    q = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(*shape[:-1], -1)[..., :k]


@dataclass
class BlockFp8:
    w: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32 [..., ceil(N / rows), ceil(K / cols)]
    rows: int
    cols: int
    act: bool = False

    def __post_init__(self):
        if not is_fp8(self.w) or self.scale.dtype != torch.float32:
            raise ValueError(f"BlockFp8 takes float8_e4m3fn weights and float32 scales, got {self.w.dtype} / "
                             f"{self.scale.dtype}")
        for v in (self.rows, self.cols):
            if v < MIN_ROWS or v & (v - 1):
                raise ValueError(f"block scales of {self.rows} x {self.cols}: the kernels need powers of two of "
                                 f"{MIN_ROWS} or more")
        want = (*self.w.shape[:-2], -(-self.w.shape[-2] // self.rows), -(-self.w.shape[-1] // self.cols))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"scale {tuple(self.scale.shape)} does not cover {tuple(self.w.shape)} in "
                             f"{self.rows} x {self.cols} blocks ({want})")

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def device(self) -> torch.device:
        return self.w.device

    def __getitem__(self, i) -> "BlockFp8":
        """One expert (or a leading-dim slice) of stacked weights; ``[None]``: one leading dim more (a dense MLP
        as the one shared expert)."""
        if i is None:
            return BlockFp8(self.w[None], self.scale[None], self.rows, self.cols, self.act)
        return BlockFp8(self.w[i], self.scale[i], self.rows, self.cols, self.act)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.w, self.scale, (self.rows, self.cols), dtype)

    def nbytes(self) -> int:
        return self.w.numel() + self.scale.numel() * 4

    def matmul_f32(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ w^T in float32 as the reference step computes it (:func:`linear_reference`): the torch
        twins (reference.py) call this on weights that have it."""
        return linear_reference(x, self)


def weight_of(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
              act: int | None) -> "torch.Tensor | BlockFp8":
    """An engine parameter as the fast path reads it: a plain tensor, or BlockFp8 where it is block-scaled FP8
    (``act``: engine/fp8.attach's activation group, which for block scales is the block's width)."""
    if not is_fp8(w):
        return w
    if block is None or scale is None:
        raise ValueError("per-channel FP8 weights on the DeepSeek-family fast path: only block scales are read here")
    if act is not None and act != block[1]:
        raise ValueError(f"activations quantized per {act} features over {block[1]}-wide weight blocks")
    return BlockFp8(w, scale, block[0], block[1], act is not None)


def plain(w: "torch.Tensor | BlockFp8", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``w`` as a bf16 weight for the bf16 kernels: only a weight-only FP8 one, whose reference numerics are its
    dequantized bf16 weight; activations rounded to FP8 have no bf16 form (ValueError: the reference step serves it)."""
    if not isinstance(w, BlockFp8):
        return w
    if w.act:
        raise ValueError(f"block-scaled FP8 weights {tuple(w.shape)} in {w.rows} x {w.cols} blocks cannot keep their "
                         "bytes in this layout (stacked parts whose boundaries split a block, or experts of a size "
                         "the blocks do not divide), and their activation rounding has no bf16 form: the reference "
                         "step serves this checkpoint")
    return w.dequantize(dtype)


def cat_rows(parts: list["torch.Tensor | BlockFp8"]) -> "torch.Tensor | BlockFp8":
    """Weights stacked on their output rows (dim -2). FP8 parts with the same block width keep their bytes, with
    scale rows of the largest height that divides every part's boundary (rows repeated where finer); otherwise
    (a bf16 part among them, or boundaries finer than MIN_ROWS) every part as :func:`plain` gives it."""
    fp8 = [p for p in parts if isinstance(p, BlockFp8)]
    if not fp8:
        return torch.cat(parts).contiguous()
    if len(fp8) == len(parts) and len({(p.cols, p.act) for p in fp8}) == 1:
        g = math.gcd(*(p.rows for p in fp8), *(p.shape[-2] for p in fp8[:-1]))
        if g >= MIN_ROWS:
            scales = [p.scale.repeat_interleave(p.rows // g, dim=-2)[..., :-(-p.shape[-2] // g), :] for p in fp8]
            return BlockFp8(torch.cat([p.w for p in fp8], dim=-2), torch.cat(scales, dim=-2).contiguous(), g,
                            fp8[0].cols, fp8[0].act)
    return torch.cat([plain(p) for p in parts], dim=-2).contiguous()


def split_experts(gate_up: "torch.Tensor | BlockFp8", down: "torch.Tensor | BlockFp8", inter: int):
    """A shared MLP [2 S I, H] / [H, S I] as S routed-size experts [S, 2I, H] / [S, H, I] (mla.split_shared), the
    scales split with the weights where the blocks allow it (I a multiple of both block sides), else bf16."""
    if isinstance(gate_up, BlockFp8) and isinstance(down, BlockFp8) and inter % gate_up.rows == 0 \
            and inter % down.cols == 0:
        s = gate_up.shape[0] // (2 * inter)
        gw, uw = gate_up.w.view(2, s, inter, -1).unbind(0)
        gs, us = gate_up.scale.view(2, s, inter // gate_up.rows, -1).unbind(0)
        hb = down.scale.shape[0]
        gu = BlockFp8(torch.cat([gw, uw], dim=1).contiguous(), torch.cat([gs, us], dim=1).contiguous(),
                      gate_up.rows, gate_up.cols, gate_up.act)
        dn = BlockFp8(down.w.view(down.shape[0], s, inter).permute(1, 0, 2).contiguous(),
                      down.scale.view(hb, s, inter // down.cols).permute(1, 0, 2).contiguous(),
                      down.rows, down.cols, down.act)
        return gu, dn
    return None


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128), act: bool = True) -> BlockFp8:
    """``w`` [..., N, K] quantized per block as DeepSeek-V3's checkpoints are (scale = block amax / 448), for benches
    and tests."""
    bn, bk = block
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = -(-n // bn), -(-k // bk)
    lead = w.shape[:-2]
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    amax = padded.view(*lead, nb, bn, kb, bk).abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return BlockFp8(q.contiguous(), scale.contiguous(), bn, bk, act)


def linear_reference(x: torch.Tensor, w: BlockFp8) -> torch.Tensor:
    """x [T, K] @ w^T in float32 as the engine's reference step computes a block-scaled FP8 linear (the kernels'
    torch twin): x through vLLM's per-group FP8 rounding and the weight dequantized when ``w.act``; weight-only,
    x against the weight dequantized to bf16."""
    if w.act:
        return quantize_groups(x, w.cols) @ w.dequantize(torch.float32).T
    return x.float() @ w.dequantize(torch.bfloat16).float().T


# the one-token (FMA) tile's K width over FP8 weights as a multiple of the bf16 tile's: 2 keeps a bf16 tile's bytes in
# flight a program (the Llama-family FP8 GEMVs gained from wider tiles, run P1); 1 until a GPU run picks
# (bench/decode_gpu.py --parts dsv3fp8 times both)
FMA_WIDEN = 1


# One token with activations rounded per group: a program rounds its x tile's groups once for all of its rows, so
# more rows a program amortise that work (H100, run G2: the Llama-3-8B gate/up GEMV 122.9 us at 8 rows a program,
# 58.3 us at 32); the accumulators kept near ACC_ELEMS fp32 elements a program, as the bf16 tiles' 8 x 512 x 4 warps
FMA_ACT_BLOCK_N = 32
ACC_ELEMS = 16384
# one token over grouped activations in [BLOCK_N, groups, cols] tiles (:func:`fp8_fma_grouped`); False: the
# [BLOCK_N, BLOCK_K] tiles of :func:`fp8_fma` (the A/B switch of bench/decode_gpu.py --parts dsv3fp8)
GROUPED = True


def tile(w, block_n: int, block_k: int, dot: bool, accumulators: int = 1,
         act_rows: int | None = None) -> tuple[int, int]:
    """(block_n, block_k) of a GEMV tile over ``w``: for BlockFp8 the rows cut to a divisor of its scale rows, and
    K one block at a time on the tensor-core path (each block's dot scaled on its own) or, one token, FMA_WIDEN
    times the bf16 tile's and a whole number of blocks where the activations are grouped, with at least
    ``act_rows`` (default FMA_ACT_BLOCK_N) rows a program and K cut so that the kernel's ``accumulators`` (gate and
    up: 2) stay near ACC_ELEMS elements."""
    if not isinstance(w, BlockFp8):
        return block_n, block_k
    block_n = min(block_n, w.rows)
    if dot:
        return block_n, w.cols
    block_k *= FMA_WIDEN
    if not w.act:
        return block_n, block_k
    block_n = min(max(block_n, FMA_ACT_BLOCK_N if act_rows is None else act_rows), w.rows)
    return block_n, max(w.cols, min(block_k, ACC_ELEMS // (block_n * accumulators)))


def kernel_args(w) -> dict:
    """The GEMV kernels' FP8 arguments for ``w`` (none for a plain weight)."""
    if not isinstance(w, BlockFp8):
        return {}
    return dict(FP8=True, s_ptr=w.scale, KB=w.scale.shape[-1], SG=w.rows, SK=w.cols, ACT=w.act)


def groups(w, t: int, dot: bool, block_k: int) -> int:
    """The GROUPS constexpr of the GEMV kernels: ``block_k // w.cols`` where one token over grouped-activation block
    FP8 takes the FMA path (its tiles [BLOCK_N, GROUPS, cols]: each group's rounding without a reshape of the
    activation tile, 13-19% faster a GEMV than [BLOCK_N, BLOCK_K] tiles on the H100, run G4), else 0."""
    if not isinstance(w, BlockFp8) or not w.act or dot or t != 1 or not GROUPED:
        return 0
    return block_k // w.cols


@triton.jit
def act_groups(x, T_PAD: tl.constexpr, SK: tl.constexpr, ACT: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [T_PAD, BLOCK_K] (bf16 values) in float32, each row's SK-wide groups through vLLM's FP8 rounding when ACT."""
    xf = x.to(tl.float32)
    if ACT:
        g = tl.reshape(xf, (T_PAD, BLOCK_K // SK, SK))
        sx = act_scale(tl.max(tl.abs(g), axis=2))
        q = act_round(g, 1.0 / sx[:, :, None]).to(tl.float32) * sx[:, :, None]
        xf = tl.reshape(q, (T_PAD, BLOCK_K))
    return xf


@triton.jit
def col_scales(s_ptr, srow, k, K, KB, SK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight block scales of columns [k, k + BLOCK_K) in scale row ``srow`` [BLOCK_K]."""
    offs = k + tl.arange(0, BLOCK_K)
    return tl.load(s_ptr + srow * KB + offs // SK, mask=offs < K, other=0.0)


@triton.jit
def fp8_fma(acc, w, x, s_ptr, srow, k, K, KB, T_PAD: tl.constexpr, SK: tl.constexpr, ACT: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """acc [T_PAD, BLOCK_N, BLOCK_K] + the products of an FP8 weight tile w [BLOCK_N, BLOCK_K] (scale row ``srow``,
    columns [k, k + BLOCK_K)) and x [T_PAD, BLOCK_K] (bf16 values), as the engine's reference linear computes them:
    ACT, x rounded per SK group (:func:`act_groups`) and times the block scales (the weight streams as bytes);
    weight-only, the weight dequantized to bf16 (a dequantized checkpoint's weights) times x."""
    sw = col_scales(s_ptr, srow, k, K, KB, SK, BLOCK_K)
    if ACT:
        upd = w.to(tl.float32)[None, :, :] * (act_groups(x, T_PAD, SK, ACT, BLOCK_K) * sw[None, :])[:, None, :]
    else:
        upd = rnd_bf16(w.to(tl.float32) * sw[None, :])[None, :, :] * x.to(tl.float32)[:, None, :]
    return acc + upd


@triton.jit
def group_offs(k, G: tl.constexpr, SK: tl.constexpr):
    """Columns [k, k + G SK) as [G, SK]: one activation group (and weight block column) a row."""
    return k + tl.arange(0, G)[:, None] * SK + tl.arange(0, SK)[None, :]


@triton.jit
def round_groups(x):
    """One token's x [G, SK] (bf16 values) through vLLM's FP8 rounding per group (a row each), back in float32."""
    xf = x.to(tl.float32)
    sx = act_scale(tl.max(tl.abs(xf), axis=1))
    return act_round(xf, 1.0 / sx[:, None]).to(tl.float32) * sx[:, None]


@triton.jit
def fp8_fma_rounded(acc, w, xq, s_ptr, srow, k, K, KB, G: tl.constexpr, SK: tl.constexpr):
    """acc [BLOCK_N, G, SK] + the products of an FP8 weight tile w [BLOCK_N, G, SK] (scale row ``srow``, columns
    :func:`group_offs` (k)) and x already rounded per group (:func:`round_groups`) times the block scales: where
    two row sets in different scale rows read one input (gate and up), x is rounded once."""
    gi = tl.arange(0, G)
    sw = tl.load(s_ptr + srow * KB + k // SK + gi, mask=k + gi * SK < K, other=0.0)
    return acc + w.to(tl.float32) * (xq * sw[:, None])[None, :, :]


@triton.jit
def fp8_fma_grouped(acc, w, x, s_ptr, srow, k, K, KB, G: tl.constexpr, SK: tl.constexpr):
    """acc [BLOCK_N, G, SK] + the products of an FP8 weight tile w [BLOCK_N, G, SK] (scale row ``srow``, columns
    :func:`group_offs` (k)) and one token's x [G, SK] (bf16 values) rounded per group: :func:`fp8_fma`'s ACT
    arithmetic, rounding order included, with each group a row of its own (its amax a row reduction, no reshape)."""
    return fp8_fma_rounded(acc, w, round_groups(x), s_ptr, srow, k, K, KB, G, SK)


@triton.jit
def fp8_block_dot(x, w, acc, sw, ACT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x [M, SK] @ (w [N, SK] * sw)^T over one weight block, fp32 sums (fp32 operands under the interpreter):
    ACT, x rounded to FP8 per row (its scale and the block's applied to the partial dot) against the FP8 bytes
    widened to bf16 (exact); weight-only, the block dequantized to bf16 against x, as the reference linear."""
    xf = x.to(tl.float32)
    if ACT:
        sx = act_scale(tl.max(tl.abs(xf), axis=1))
        xo = act_round(xf, 1.0 / sx[:, None]).to(tl.float32)
        wo = w.to(tl.float32)
        post = sx * sw
    else:
        xo = xf
        wo = rnd_bf16(w.to(tl.float32) * sw)
        post = tl.max(tl.abs(xf), axis=1) * 0.0 + 1.0
    if UPCAST:
        part = tl.dot(xo, tl.trans(wo), input_precision="ieee")
    else:
        part = tl.dot(xo.to(tl.bfloat16), tl.trans(wo.to(tl.bfloat16)))
    return acc + part * post[:, None]
