"""The one-token MLA step's fused attention middle (Triton interpreter) against the kernels and torch ops it
replaces: ``_mla_prep_absorb_kernel`` (latent prep + q . w_uk) and ``_combine_uv_kernel`` (the splits'
merge + o . w_uv), over shapes of the tiny test models, DeepSeek-V2-Lite and V3 (heads cut to keep the
interpreter quick), with empty splits."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda.mla import _combine_uv_kernel, _mla_prep_absorb_kernel, _mla_prep_kernel

BF = torch.bfloat16


@pytest.mark.parametrize("heads,nope,rope,r", [(2, 16, 16, 32), (4, 128, 64, 512), (3, 32, 16, 64)])
def test_prep_absorb_equals_prep_then_the_bmm(heads, nope, rope, r):
    g = torch.Generator().manual_seed(heads * 7 + r)
    qk = nope + rope
    qkv = torch.randn(1, heads * qk + r + rope, generator=g).to(BF)
    w_uk = (torch.randn(heads, nope, r, generator=g) * nope ** -0.5).to(BF)
    kv_norm = (1 + 0.1 * torch.randn(r, generator=g)).to(BF)
    pos = torch.tensor([5], dtype=torch.int32)
    ang = torch.rand(16, rope // 2, generator=g) * 6
    cos, sin = ang.cos().to(BF), ang.sin().to(BF)
    cache_a, cache_b = torch.zeros(16, r + rope, dtype=BF), torch.zeros(16, r + rope, dtype=BF)
    q_pe_a, q_pe_b = torch.zeros(1, heads, rope, dtype=BF), torch.zeros(1, heads, rope, dtype=BF)
    q_c = torch.zeros(heads, 1, r, dtype=BF)
    br = min(128, r)
    _mla_prep_absorb_kernel[(heads + 1, r // br)](qkv, q_pe_a, q_c, w_uk, cache_a, kv_norm, pos, cos, sin, 1e-6,
                                                  NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r, BLOCK_R=br)
    _mla_prep_kernel[(1, heads + 1)](qkv, q_pe_b, cache_b, kv_norm, pos, cos, sin, qkv.stride(0), 1e-6,
                                     NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r)
    assert torch.equal(q_pe_a, q_pe_b) and torch.equal(cache_a, cache_b)
    assert cache_a[5].abs().sum() > 0 and cache_a[4].abs().sum() == 0
    q_nope = qkv[:, :heads * qk].view(1, heads, qk)[..., :nope]
    want = (q_nope.transpose(0, 1).float() @ w_uk.float()).to(BF)  # [Hq, 1, r], one rounding
    assert (q_c.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


@pytest.mark.parametrize("heads,splits,r,v,empty", [(2, 4, 32, 24, ()), (4, 16, 512, 128, (3, 9)), (3, 8, 64, 40, (0,))])
def test_combine_uv_equals_the_merge_then_the_bmm(heads, splits, r, v, empty):
    g = torch.Generator().manual_seed(heads + splits + r)
    part_o = torch.randn(heads, splits, r, generator=g)
    m = torch.randn(heads, splits, generator=g) * 3
    l = torch.rand(heads, splits, generator=g) + 0.5
    for s in empty:  # a split past the sequence: no keys, max -inf, sum 0
        m[:, s], l[:, s], part_o[:, s] = float("-inf"), 0.0, 0.0
    part_ml = torch.stack([m, l], dim=-1).contiguous()
    w_uv_t = (torch.randn(heads, r, v, generator=g) * r ** -0.5).to(BF)
    out = torch.zeros(heads, 1, v, dtype=BF)
    bv = min(32, 1 << (v - 1).bit_length())
    _combine_uv_kernel[(heads, -(-v // bv))](part_o, part_ml, w_uv_t, out, NUM_SPLITS=splits, R=r, V=v, BLOCK_V=bv,
                                             CHUNK_R=min(128, r))
    w = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp2(m - m.max(dim=1, keepdim=True).values))
    o_lat = ((part_o * w[..., None]).sum(1) / (w * l).sum(1, keepdim=True)).to(BF)  # the merge kernel's bf16 output
    want = (o_lat.float()[:, None] @ w_uv_t.float()).to(BF)
    assert (out.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()
