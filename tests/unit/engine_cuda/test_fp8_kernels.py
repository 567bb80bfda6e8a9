"""The FP8 GEMV kernels (Triton interpreter on CPU) against their torch twins and the engine's
reference-step numerics (engine/fp8.linear: dequantize, FP8 activations, matmul in float32).

Weights are float8_e4m3fn with per-row float32 scales; the kernels agree with the twins to fp32
summation order, with and without the fused RMSNorm, bias, residual and dynamic FP8 activations.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import fp8 as engine_fp8
from services.decode.engine.cuda import fp8, reference

BF = torch.bfloat16


def rand(*shape, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g) * std


def quantized(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = rand(n, k, std=0.1, seed=seed)
    scale = w.abs().amax(dim=1) / 448.0
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def close(a, b, tol=1e-5):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() <= tol


@pytest.mark.parametrize("norm,residual,bias,act,block_n,block_k", [
    (False, False, False, False, 8, 32), (True, False, False, True, 16, 64), (False, True, False, True, 4, 32),
    (True, True, True, True, 8, 128), (True, False, True, False, 8, 64),
])
def test_gemv_fp8_matches_twin_and_engine_linear(norm, residual, bias, act, block_n, block_k):
    x, nw, res, b = rand(96).to(BF), (1 + rand(96, std=0.1)).to(BF), rand(40).to(BF), rand(40, std=0.1).to(BF)
    w, scale = quantized(40, 96)
    out = torch.full((40,), float("nan"), dtype=BF)
    kw = dict(norm_w=nw if norm else None, eps=1e-5, bias=b if bias else None, act=act)
    fp8.gemv_fp8(x, w, scale, out, residual=res.clone() if residual else None, block_n=block_n, block_k=block_k, **kw)
    want = fp8.gemv_fp8_reference(x, w, scale, residual=res if residual else None, **kw)
    close(out, want)
    # the engine's reference step computes the same projection
    ew = torch.nn.Parameter(w, requires_grad=False)
    ew.scale, ew.block, ew.act = scale, None, 0 if act else None
    xin = reference.rms_norm(x, nw, 1e-5) if norm else x
    y = engine_fp8.linear(xin, ew, b if bias else None)
    close(out, res + y if residual else y, tol=1e-2)  # bf16 rounding of the unfused path's output only


@pytest.mark.parametrize("norm,act,block_n,block_k", [(True, True, 8, 64), (False, False, 16, 32), (True, False, 4, 128)])
def test_gemv_fp8_silu_matches_twin(norm, act, block_n, block_k):
    x, nw = rand(96).to(BF), (1 + rand(96, std=0.1)).to(BF)
    w, scale = quantized(64, 96, seed=3)
    out = torch.full((32,), float("nan"), dtype=BF)
    kw = dict(norm_w=nw if norm else None, eps=1e-5, act=act)
    fp8.gemv_fp8_silu(x, w, scale, out, block_n=block_n, block_k=block_k, **kw)
    close(out, fp8.gemv_fp8_silu_reference(x, w, scale, **kw))


@pytest.mark.parametrize("qk_norm,kv_fp8,act,bias", [(False, False, True, False), (False, True, True, True),
                                                     (True, False, False, False)])
def test_fp8_qkv_rope_is_the_gemv_then_the_rope_kernel(qk_norm, kv_fp8, act, bias):
    # the fused FP8 QKV GEMV stores q and this position's K/V exactly as gemv_fp8 + rope_cache_write do
    # (Qwen3: without rope, the attention normalises and rotates; compared with the GEMV's rows as stored)
    from services.decode.engine.cuda import smallops
    from services.decode.engine.cuda.kvfp8 import kv_fmt

    hq, hkv, d, h, t, pos = 4, 2, 32, 128, 8, 5
    n = (hq + 2 * hkv) * d
    x, nw = rand(h).to(BF), (1 + rand(h, std=0.1)).to(BF)
    w, scale = quantized(n, h, seed=7)
    b = rand(n, std=0.1).to(BF) if bias else None
    cos, sin = rand(t, d // 2, seed=1).to(BF), rand(t, d // 2, seed=2).to(BF)
    p = torch.tensor([pos], dtype=torch.int32)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    kv = dict(kv_fmt=kv_fmt("fp8_e4m3"), inv_k=1 / 0.05, inv_v=1 / 0.02) if kv_fp8 else {}
    cdt = torch.uint8 if kv_fp8 else BF
    got, want = [], []
    for fused in (True, False):
        kc, vc, q = torch.zeros(t, hkv, d, dtype=cdt), torch.zeros(t, hkv, d, dtype=cdt), torch.zeros(hq * d, dtype=BF)
        if fused:
            fp8.gemv_fp8_qkv_rope(x, w, scale, nw, 1e-5, q, kc, vc, p, cos, sin, **heads, bias=b, rope=not qk_norm,
                                  act=act, block_n=8, block_k=64, **kv)
            got = [q, kc, vc]
        else:
            qkv = fp8.gemv_fp8(x, w, scale, torch.zeros(n, dtype=BF), norm_w=nw, eps=1e-5, bias=b, act=act,
                               block_n=8, block_k=64)
            if qk_norm:  # as projected
                q.copy_(qkv[: hq * d])
                kc[pos].copy_(qkv[hq * d: (hq + hkv) * d].view(hkv, d))
                vc[pos].copy_(qkv[(hq + hkv) * d:].view(hkv, d))
            else:
                smallops.rope_cache_write(qkv, q, kc, vc, p, cos, sin, **heads, **kv)
            want = [q, kc, vc]
    for a, b_ in zip(got, want):
        assert torch.equal(a, b_)
    assert got[1][pos].any() and not got[1][:pos].any()


@pytest.mark.parametrize("h", [96, 128, 80])  # K a power of two or not (round_token's one program masks past K)
def test_a_token_rounded_once_feeds_the_silu_and_qkv_gemvs_the_values_their_prologue_makes(h):
    # FastOptions.fp8_round_once: round_token's FP8 values and scale, read by the per-channel SiLU and QKV + rope
    # GEMVs, give what the GEMVs give when each program norms and rounds the input itself, bit for bit
    x, nw = (rand(h) * 3).to(BF), (1 + rand(h, std=0.1)).to(BF)
    q, xs = torch.zeros(h, dtype=torch.float8_e4m3fn), torch.zeros(1)
    xq = fp8.round_token(x, q, xs, norm_w=nw, eps=1e-5)
    assert xq[0].float().abs().max() <= 448 and xq[1].item() > 0
    w, scale = quantized(64, h, seed=5)
    outs = [torch.full((32,), float("nan"), dtype=BF) for _ in range(2)]
    fp8.gemv_fp8_silu(x, w, scale, outs[0], norm_w=nw, eps=1e-5, act=True, block_n=8, block_k=32)
    fp8.gemv_fp8_silu(x, w, scale, outs[1], act=True, block_n=8, block_k=32, xq=xq)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    hq, hkv, d, t, pos = 2, 1, 16, 8, 3
    wq, sq = quantized((hq + 2 * hkv) * d, h, seed=9)
    cos, sin = rand(t, d // 2, seed=1).to(BF), rand(t, d // 2, seed=2).to(BF)
    got = []
    for rounded in (None, xq):
        kc, vc, qo = torch.zeros(t, hkv, d, dtype=BF), torch.zeros(t, hkv, d, dtype=BF), torch.zeros(hq * d, dtype=BF)
        fp8.gemv_fp8_qkv_rope(x, wq, sq, nw, 1e-5, qo, kc, vc, torch.tensor([pos], dtype=torch.int32), cos, sin,
                              num_q_heads=hq, num_kv_heads=hkv, head_dim=d, act=True, block_n=8, block_k=32,
                              xq=rounded)
        got.append((qo, kc, vc))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert got[0][1][pos].any()


@pytest.mark.parametrize("k,block_k", [(96, 32), (80, 32), (128, 64)])  # K a power of two or not
def test_an_input_amax_left_by_its_writer_gives_the_gemv_its_own_scale(k, block_k):
    # FastOptions.fp8_amax_carry: each SiLU GEMV program stores the largest |value| of its rows, and the o / down
    # GEMV takes its activation scale from the max of those parts instead of reducing its whole input in every
    # program: bit for bit the same outputs, the residual and bias included
    x, nw = (rand(k) * 3).to(BF), (1 + rand(k, std=0.1)).to(BF)
    wgu, sgu = quantized(2 * 48, k, seed=7)
    act, parts = torch.full((48,), float("nan"), dtype=BF), torch.full((7,), float("nan"))
    fp8.gemv_fp8_silu(x, wgu, sgu, act, norm_w=nw, eps=1e-5, act=True, block_n=8, block_k=block_k, amax_out=parts)
    assert torch.equal(parts[:6], act.float().abs().view(6, 8).amax(dim=1)) and parts[6].isnan()
    wd, sd = quantized(24, 48, seed=11)
    res, b = rand(24).to(BF), rand(24, std=0.1).to(BF)
    outs = [torch.full((24,), float("nan"), dtype=BF) for _ in range(2)]
    fp8.gemv_fp8(act, wd, sd, outs[0], residual=res, bias=b, act=True, block_n=8, block_k=16)
    fp8.gemv_fp8(act, wd, sd, outs[1], residual=res, bias=b, act=True, block_n=8, block_k=16, amax=parts[:6])
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    with pytest.raises(ValueError, match="un-normed"):
        fp8.gemv_fp8(act, wd, sd, outs[1], norm_w=nw[:48], act=True, amax=parts[:6])
    with pytest.raises(ValueError, match="programs"):
        fp8.gemv_fp8_silu(x, wgu, sgu, act, act=True, block_n=8, block_k=block_k, amax_out=parts[:5])


def test_the_attention_merge_leaves_each_heads_amax():
    # the two-launch attention's merge stores each output row's largest |value| (o's input scale parts)
    from services.decode.engine.cuda.attention import DecodeAttention

    hq, hkv, d, pos = 8, 2, 32, 40
    q, k, v = rand(1, hq, d).to(BF), rand(pos + 4, hkv, d, seed=1).to(BF), rand(pos + 4, hkv, d, seed=2).to(BF)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_tokens=1, num_splits=4,
                           block_s=16, one_launch=False)
    out, parts = torch.full((1, hq, d), float("nan"), dtype=BF), torch.full((hq,), float("nan"))
    attn(q, k, v, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d, amax=parts)
    assert torch.equal(parts, out.float().abs().view(hq, d).amax(dim=1))
    one = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_tokens=1, num_splits=4,
                          block_s=16, one_launch=True)
    with pytest.raises(ValueError, match="two-launch"):
        one(q, k, v, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d, amax=parts)
