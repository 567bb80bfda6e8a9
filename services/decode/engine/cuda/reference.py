"""Torch twins of the fast path's kernels: the same math with the same rounding points, in plain torch.

CPU tests run the kernels under Triton's interpreter against these, the GPU benchmark checks the
compiled kernels with them, and the whole-step references (``llama.reference_step``,
``mla_decoder.reference_forward``) are built from them. The engine's reference step (layers.py)
uses ``rms_norm`` and ``silu_mul`` from here: one definition of each. Shapes: single vectors or
rows ``[..., K]``; weights ``[N, K]``. Needs torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics, rounded to the input dtype, times the weight (as HF transformers)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one op where nothing is rounded between the steps: the same values as the four below (tested), a third
        # of a tiny CPU step's norm time
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def matmul_f32(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T in float32; a block-scaled FP8 W (fp8block.BlockFp8, which has ``matmul_f32``) as the engine's
    reference linear computes it."""
    if hasattr(w, "matmul_f32"):
        return w.matmul_f32(x)
    return x.float() @ w.float().T


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T with fp32 accumulation, rounded to the input dtype."""
    return matmul_f32(x, w).to(x.dtype)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2*I] projection, each op rounded like eager torch (into ``out`` when given:
    the block-scaled FP8 steps' SiLU after their gate/up GEMV)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rope on x [..., H, D] with cos/sin [..., D/2] already in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on interleaved pairs (DeepSeek's k_pe / q_pe), de-interleaved on output, as the MLA kernel writes it."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, Dqk], k [S, Hkv, Dqk], v [S, Hkv, Dv] (S >= pos + T); causal from pos; fp32 math."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    n = pos + t
    kf = k[:n].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
    vf = v[:n].float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * sm_scale
    mask = torch.arange(n)[None, :] <= (pos + torch.arange(t))[:, None]
    scores = scores.masked_fill(~mask.to(scores.device)[None], float("-inf"))
    p = scores.softmax(-1)
    return torch.einsum("hts,shd->thd", p, vf).to(q.dtype)


def fp8_latent_bytes(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """uint8 E4M3 bytes of x / k_scale rounded to nearest, saturated (vLLM's CUDA MLA writer; the fast path's
    kvfp8.fp8_kv_bits of E4M3 + NEAREST; engine/kvquant.quantize(nearest=True))."""
    v = x.float() * torch.tensor(1.0 / k_scale, dtype=torch.float32).item()
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_latent_values(q: torch.Tensor, k_scale: float) -> torch.Tensor:
    """fp32 values of E4M3 latent bytes times k_scale (what the MLA attention reads)."""
    return q.view(torch.float8_e4m3fn).float() * k_scale


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Biased expert scores [N, E] with every expert outside the ``topk_group`` best of ``n_group``
    groups set to -inf; a group scores the sum of its two best (noaux_tc, deepseek.route)."""
    n, e = choice.shape
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0).bool()
    return choice.masked_fill(~kept.repeat_interleave(e // n_group, dim=1), float("-inf"))


def router(xn: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float, n_group: int = 1,
           topk_group: int = 1):
    """(ids [T, k] best first, weights [T, k] fp32): sigmoid, + bias for the choice, normalised, scaled.

    Group-limited (``topk_group < n_group``, deepseek.route): a group scores the sum of its two best
    biased scores; only the experts of the ``topk_group`` best groups are chosen from."""
    scores = (xn.float() @ w.float().T).sigmoid()
    choice = scores + bias.float()
    if n_group > 1 and topk_group < n_group:
        choice = limit_to_groups(choice, n_group, topk_group)
    ids = choice.topk(top_k, dim=-1, sorted=True)[1]
    wts = scores.gather(1, ids)
    return ids, wts / (wts.sum(-1, keepdim=True) + 1e-20) * scale


def moe(xn: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
        shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None):
    """Routed experts (rounded outputs, bf16-weighted, summed) plus the shared MLP, as eager torch does."""
    out = None
    if ids.shape[1]:
        y = torch.stack([torch.stack([linear(silu_mul(linear(xn[t], w_gate_up[e])), w_down[e])
                                      for e in ids[t].tolist()]) for t in range(xn.shape[0])])  # [T, k, H]
        out = (y * wts[..., None].to(y.dtype)).sum(dim=1)
    if shared_gate_up is not None:
        shared = linear(silu_mul(linear(xn, shared_gate_up)), shared_down)
        out = shared if out is None else out + shared
    return out
