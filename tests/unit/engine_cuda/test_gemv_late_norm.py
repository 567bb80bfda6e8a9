"""The QKV and gate/up GEMVs with their RMSNorm folded into the weight stream (``FastOptions.norm_late``).

Kernels interpreted on CPU (conftest.py). The late form computes W @ (x * nw) and sum(x^2) in one loop and
scales the sums by 1 / rms after it: equal to an fp32 twin of that arithmetic up to summation order, within
bf16 rounding of the HF-rounded form, and a decoder on it follows the reference step's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda import FastOptions, GqaDecoder, gemv, reference, reference_step
from tests.unit.engine_cuda.test_fast_path_families import TILES, _gen, _rand, _tables, tiny_model

BF = torch.bfloat16


def _late_twin(x, w, nw, eps):
    """fp32 W @ round(x * nw) / rms(x), one rounding at the end (the late form's arithmetic)."""
    xf = x.float()
    inv = 1.0 / torch.sqrt((xf * xf).mean() + eps)
    return (w.float() @ (xf * nw.float()).to(x.dtype).float()) * inv


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("k,block_k", [(64, 32), (96, 32), (128, 128)])
def test_late_norm_silu_is_its_fp32_twin_and_near_the_hf_rounded_form(k, block_k):
    g = _gen(3)
    x, w, nw = _rand(g, k, std=3.0), _rand(g, 2 * 24, k, std=0.2), (1 + 0.1 * torch.randn(k, generator=g)).to(BF)
    late, early = torch.empty(24, dtype=BF), torch.empty(24, dtype=BF)
    gemv.gemv_silu(x, w, late, norm_w=nw, eps=1e-5, block_n=8, block_k=block_k, stages=2, norm_late=True)
    gemv.gemv_silu(x, w, early, norm_w=nw, eps=1e-5, block_n=8, block_k=block_k, stages=2)
    gu = _late_twin(x, w, nw, 1e-5).to(BF)
    twin = reference.silu_mul(gu)
    assert _rel(late, twin) <= 1e-6
    assert _rel(late, early) <= 2e-2  # bf16 rounding points apart, not more
    assert not torch.equal(late, early)  # the two forms really differ: the flag reaches the kernel


def test_late_norm_qkv_writes_rotated_q_and_the_cache_row_near_the_hf_form():
    hq, hkv, d, h, pos = 4, 2, 16, 64, 5
    g = _gen(4)
    x, w, nw = _rand(g, h, std=2.0), _rand(g, (hq + 2 * hkv) * d, h, std=0.2), (1 + 0.1 * torch.randn(h, generator=g)).to(BF)
    cos, sin = _tables(12, d)
    p = torch.tensor([pos], dtype=torch.int32)
    outs = []
    for late in (True, False):
        q = torch.empty(hq * d, dtype=BF)
        kc, vc = torch.zeros(12, hkv, d, dtype=BF), torch.zeros(12, hkv, d, dtype=BF)
        gemv.gemv_qkv_rope(x, w, nw, 1e-5, q, kc, vc, p, cos.to(BF), sin.to(BF), num_q_heads=hq, num_kv_heads=hkv,
                           head_dim=d, block_n=4, block_k=32, norm_late=late)
        outs.append((q, kc, vc))
        assert kc[:pos].abs().sum() == 0 and kc[pos + 1:].abs().sum() == 0  # only row pos written
    (ql, kl, vl), (qe, ke, ve) = outs
    assert _rel(ql, qe) <= 2e-2 and _rel(kl[pos], ke[pos]) <= 2e-2
    v_twin = _late_twin(x, w, nw, 1e-5)[(hq + hkv) * d:].to(BF).view(hkv, d)  # v: no rope, as projected
    assert _rel(vl[pos], v_twin) <= 1e-6


def test_a_decoder_with_the_late_norm_follows_the_reference_step():
    m, n, ctx, steps, d = tiny_model(False, False, False), 40, 20, 4, 16
    g = _gen(1)
    kc = [_rand(g, n, 2, d) for _ in m.layers]
    vc = [_rand(g, n, 2, d) for _ in m.layers]
    kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = _tables(n, d)
    dec = GqaDecoder(m, kc, vc, cos, sin, FastOptions(tiles=TILES, num_splits=4, block_s=16, norm_late=True),
                     max_steps=8)
    dec.set_state(3, ctx)
    tok = 3
    for i in range(steps):
        ref = reference_step(m, kr, vr, cos, sin, tok, ctx + i, norm_late=True)
        hf = reference_step(m, [k.clone() for k in kr], [v.clone() for v in vr], cos, sin, tok, ctx + i)
        dec.step()
        tok = int(ref.argmax())
        assert _rel(dec.logits, ref) <= 1e-6  # the folded form's twin
        assert _rel(dec.logits, hf) <= 3e-2  # and within the model dtype's rounding of HF's form
        assert int(dec.out_tokens[i]) == tok
        for layer in range(2):
            assert torch.equal(kc[layer][ctx + i], kr[layer][ctx + i])
            assert torch.equal(vc[layer][ctx + i], vr[layer][ctx + i])


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_batched_gemv_folds_the_norm_as_the_one_token_gemv(mode):
    """The batched step's folded norm: norm_late_rows (round(x * nw) and 1 / rms of each row, once a step), then
    rows_gemv scaling each row's sums by its 1 / rms. Over 3 rows each gate/up output equals the one-token late
    GEMV's on that row (the batched step decodes a row as it decodes alone) and differs from the norm-first form;
    the QKV form with its bias added after the scale is the folded form's fp32 twin within a bf16 rounding."""
    from services.decode.engine.cuda.batch import rows_gemv
    from services.decode.engine.cuda.llama import _norm_linear
    from services.decode.engine.cuda.smallops import norm_late_rows

    k, inter = 96, 24
    g = _gen(5)
    x, w = _rand(g, 3, k, std=2.0), _rand(g, 2 * inter, k, std=0.2)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(BF)
    bias = _rand(g, 2 * inter, std=0.1)
    xn, inv = torch.empty(3, k, dtype=BF), torch.empty(3, dtype=torch.float32)
    norm_late_rows(x, nw, xn, inv, 1e-5)
    xf = x.float()
    assert torch.equal(xn, (xf * nw.float()).to(BF))
    assert torch.allclose(inv, torch.rsqrt(xf.pow(2).mean(-1) + 1e-5), rtol=1e-6)
    late, early = torch.empty(3, inter, dtype=BF), torch.empty(3, inter, dtype=BF)
    rows_gemv(xn, w, late, silu=True, row_scale=inv, block_n=8, block_k=32, stages=1, mode=mode)
    rows_gemv(x, w, early, norm_w=nw, eps=1e-5, silu=True, block_n=8, block_k=32, stages=1, mode=mode)
    for r in range(3):
        one = torch.empty(inter, dtype=BF)
        gemv.gemv_silu(x[r], w, one, norm_w=nw, eps=1e-5, block_n=8, block_k=32, stages=2, norm_late=True)
        assert torch.equal(late[r], one), r
    assert not torch.equal(late, early)
    qkv = torch.empty(3, 2 * inter, dtype=BF)
    rows_gemv(xn, w, qkv, bias=bias, row_scale=inv, block_n=8, block_k=32, stages=1, mode=mode)
    for r in range(3):
        twin = _norm_linear(x[r], nw, w, bias, 1e-5, True)
        assert torch.allclose(qkv[r].float(), twin.float(), rtol=2 ** -7, atol=1e-6), r
