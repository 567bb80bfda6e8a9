"""Block-scaled FP8 weights (DeepSeek-V3's ``fp8`` format) in the DeepSeek-family GEMVs, under Triton's interpreter.

``gemv_rows`` and the grouped expert kernels read the FP8 bytes and apply the block scales (and, where the checkpoint
quantizes activations, vLLM's per-group FP8 rounding of the input) in the kernel; their torch twin is the engine's
reference linear (engine/fp8.py: x rounded per group, the weight dequantized, float32 sums). Stacked projections
with their own scales (q LoRA's wkv_a | wq_a) keep their bytes with finer scale rows.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import fp8 as engine_fp8
from services.decode.engine.cuda import fp8block, moe, reference
from services.decode.engine.cuda.fp8block import BlockFp8, cat_rows, linear_reference, quantize, split_experts

BF = torch.bfloat16


def rand(*shape, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * std).to(BF)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("t,act,norm,residual", [
    (1, True, True, False), (1, False, False, True), (3, True, False, True), (4, False, True, False),
])
def test_gemv_rows_reads_block_fp8(t, act, norm, residual):
    # 48 rows in 16-row blocks, K = 80: a partial last column block (the reference pads it with zeros)
    w = quantize(rand(48, 80, std=0.2), (16, 32), act=act)
    x, nw, res = rand(t, 80), 1 + rand(80, std=0.1), rand(t, 48)
    out = res.clone() if residual else torch.full((t, 48), float("nan"), dtype=BF)
    moe.gemv_rows(x, w, out, norm_w=nw if norm else None, residual=out if residual else None, block_n=8, block_k=32)
    xin = reference.rms_norm(x, nw, 1e-6) if norm else x
    want = linear_reference(xin, w).to(BF)
    assert rel(out, res + want if residual else want) <= 1e-2 / 4  # one bf16 rounding apart at most
    # and the linear the engine's reference step runs on the same bytes: with activations rounded (W8A8, the
    # DeepSeek-V3 checkpoints' scheme) or weight-only (the weight dequantized to bf16)
    wt = w.w.clone()
    wt.scale, wt.block, wt.act = w.scale, (16, 32), 32 if act else None
    if act:
        assert torch.equal(linear_reference(xin, w).to(BF), engine_fp8.linear(xin, wt))
    else:  # the bf16 matmul the reference runs sums in its own order
        assert rel(linear_reference(xin, w).to(BF), engine_fp8.linear(xin, wt)) <= 1e-2 / 4


@pytest.mark.parametrize("widen", [2, 4])
def test_wider_one_token_fp8_tiles_compute_the_same(monkeypatch, widen):
    # fp8block.FMA_WIDEN (the one-token tile's K width over FP8 weights, a GPU run's choice): same function
    monkeypatch.setattr(fp8block, "FMA_WIDEN", widen)
    assert fp8block.tile(quantize(rand(16, 64), (16, 32)), 8, 64, dot=False) == (16, 64 * widen)  # rows: a scale row
    w = quantize(rand(48, 200, std=0.2), (16, 32), act=True)
    x, out = rand(1, 200), torch.empty(1, 48, dtype=BF)
    moe.gemv_rows(x, w, out, block_n=8, block_k=32)
    assert rel(out, linear_reference(x, w).to(BF)) <= 1e-2 / 4


@pytest.mark.parametrize("act,block_n,block_k,act_rows,want", [
    (True, 8, 512, None, (32, 512)),  # grouped activations: FMA_ACT_BLOCK_N rows at least, K kept near ACC_ELEMS
    (True, 8, 128, 128, (128, 128)),  # Fp8GqaDecoder's gate/up: 128 rows over one 128-wide block
    (True, 8, 512, 64, (64, 256)),  # 64 rows: K cut to 256 (ACC_ELEMS)
    (True, 8, 512, 8, (8, 512)),  # a floor under the default
    (True, 8, 512, 256, (128, 128)),  # rows never past a scale row
    (False, 8, 512, 64, (8, 512)),  # weight-only: no floor
])
def test_one_token_block_fp8_tile_rows(act, block_n, block_k, act_rows, want):
    # fp8block.tile's rows a program (gemv_rows' fp8_rows) over 128 x 128 blocks
    w = quantize(rand(256, 512, std=0.2), (128, 128), act=act)
    assert fp8block.tile(w, block_n, block_k, dot=False, act_rows=act_rows) == want


@pytest.mark.parametrize("fp8_rows", [8, 64])
def test_gemv_rows_fewest_rows_compute_the_same(fp8_rows):
    # gemv_rows(fp8_rows=...): another tiling of the same function (48 rows in 16-row scale blocks: 64 is cut to 16)
    w = quantize(rand(48, 200, std=0.2), (16, 32), act=True)
    x, nw, out = rand(1, 200), 1 + rand(200, std=0.1), torch.empty(1, 48, dtype=BF)
    moe.gemv_rows(x, w, out, norm_w=nw, block_n=8, block_k=64, fp8_rows=fp8_rows)
    assert rel(out, linear_reference(reference.rms_norm(x, nw, 1e-6), w).to(BF)) <= 1e-2 / 4


@pytest.mark.parametrize("k,norm,residual,heads", [
    (200, True, False, False),  # K past the last whole tile, a partial last group
    (256, False, True, False),
    (256, False, True, True),  # the value projection's [heads, T, D] input
])
def test_grouped_one_token_tiles_compute_what_flat_tiles_do(monkeypatch, k, norm, residual, heads):
    # fp8block.GROUPED: one token over grouped activations in [rows, groups, cols] tiles, the same arithmetic and
    # rounding order per element as the [rows, K] tiles (only the fp32 sum's order differs); against the twin too
    w = quantize(rand(64, k, std=0.2), (32, 32), act=True)
    x, nw, res = rand(1, k), 1 + rand(k, std=0.1), rand(1, 64)
    xin = x.view(k // 64, 1, 64) if heads else x
    assert fp8block.groups(w, 1, False, 128) == 4 and fp8block.groups(w, 2, False, 128) == 0
    outs = {}
    for grouped in (True, False):
        monkeypatch.setattr(fp8block, "GROUPED", grouped)
        out = res.clone() if residual else torch.full((1, 64), float("nan"), dtype=BF)
        moe.gemv_rows(xin, w, out, norm_w=nw if norm else None, residual=out if residual else None, block_n=8,
                      block_k=128, heads=heads)
        outs[grouped] = out
    assert rel(outs[True], outs[False]) <= 1e-2 / 4
    want = linear_reference(reference.rms_norm(x, nw, 1e-6) if norm else x, w).to(BF)
    assert rel(outs[True], res + want if residual else want) <= 1e-2 / 4


@pytest.mark.parametrize("k,norm,block_n,block_k", [
    (256, True, 16, 64),  # 2 groups a K step, two gate scale rows in one 32-row scale block
    (200, False, 32, 128),  # K past the last whole tile, a partial last group; a program's rows a whole scale row
])
def test_block_fp8_gate_up_silu_in_one_launch_equals_gemv_rows_then_torch_silu(k, norm, block_n, block_k):
    # fp8.gemv_fp8block_silu (the block-scaled Llama/Qwen step's gate/up): gate rows and their up rows in one program,
    # the input rounded once for both, SiLU . up in the epilogue; bit-equal to gemv_rows over the same K tile and
    # reference.silu_mul, and near the twin. Rows scaled per 32-row block by 1/4, 1 or 4, so that up rows read
    # with gate's scale row (or a neighbour's) change the output
    from services.decode.engine.cuda import fp8

    inter = 64
    wf = rand(2 * inter, k, std=0.2) * torch.tensor([0.25, 1.0, 4.0]).repeat(2)[:, None].repeat_interleave(32, 0)[:2 * inter]
    w = quantize(wf, (32, 32), act=True)
    x, nw = rand(k), 1 + rand(k, std=0.1)
    got = torch.full((inter,), float("nan"), dtype=BF)
    fp8.gemv_fp8block_silu(x, w, got, norm_w=nw if norm else None, block_n=block_n, block_k=block_k)
    gu = torch.empty(1, 2 * inter, dtype=BF)
    moe.gemv_rows(x.view(1, -1), w, gu, norm_w=nw if norm else None, block_n=8, block_k=block_k, fp8_rows=32)
    assert torch.equal(got, reference.silu_mul(gu[0]))
    xin = reference.rms_norm(x, nw, 1e-6) if norm else x
    assert rel(got, reference.silu_mul(linear_reference(xin.view(1, -1), w).to(BF))[0]) <= 2e-2


@pytest.mark.parametrize("k,norm", [(256, True), (200, False)])
def test_an_input_rounded_once_gives_the_gemvs_their_values(k, norm):
    # fp8.quant_groups rounds a GEMV input per group once (norm first), as round_groups does inside each GEMV
    # program: FP8 values and a scale a group equal to the twin's; gemv_fp8block_xq and gemv_fp8block_silu(xs=...)
    # over it are bit-equal to gemv_rows and the SiLU kernel rounding it themselves (same K tile)
    from services.decode.engine.cuda import fp8

    x, nw = rand(k, seed=5), 1 + rand(k, std=0.1, seed=6)
    groups = -(-k // 32)
    q, xs = torch.zeros(k, dtype=torch.float8_e4m3fn), torch.full((groups,), float("nan"))
    fp8.quant_groups(x, q, xs, 32, norm_w=nw if norm else None)
    xin = reference.rms_norm(x, nw, 1e-6) if norm else x
    twin = fp8block.quantize_groups(xin.view(1, -1), 32)[0]
    assert torch.equal(q.float() * xs.repeat_interleave(32)[:k], twin)
    # a row set in each of three scale rows scaled 1/4, 1 and 4 (scale rows read for the wrong rows show)
    wf = rand(96, k, std=0.2, seed=7) * torch.tensor([0.25, 1.0, 4.0]).repeat_interleave(32)[:, None]
    w = quantize(wf, (32, 32), act=True)
    res = rand(96, seed=8)
    got = fp8.gemv_fp8block_xq(q, xs, w, torch.empty(96, dtype=BF), residual=res.clone(), block_n=16, block_k=64)
    want = torch.empty(1, 96, dtype=BF)
    moe.gemv_rows(x.view(1, -1), w, want, norm_w=nw if norm else None, residual=res.view(1, -1).clone(), block_n=8,
                  block_k=64, fp8_rows=32)
    assert torch.equal(got, want[0])
    wg = quantize(rand(64, k, std=0.2, seed=9), (32, 32), act=True)
    silu_q, silu_x = torch.empty(32, dtype=BF), torch.empty(32, dtype=BF)
    down_q, down_xs = torch.zeros(32, dtype=torch.float8_e4m3fn), torch.zeros(2)
    fp8.gemv_fp8block_silu(q, wg, silu_q, xs=xs, block_n=16, block_k=64, quant=(down_q, down_xs))
    fp8.gemv_fp8block_silu(x, wg, silu_x, norm_w=nw if norm else None, block_n=16, block_k=64)
    assert torch.equal(silu_q, silu_x)
    # and (quant=...) its output rounded in groups of a program's 16 rows, as quant_groups rounds it for down
    want_q, want_xs = torch.zeros(32, dtype=torch.float8_e4m3fn), torch.zeros(2)
    fp8.quant_groups(silu_q, want_q, want_xs, 16)
    assert torch.equal(down_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(down_xs, want_xs)
    with pytest.raises(ValueError, match="2 groups: 1 of 32"):
        fp8.gemv_fp8block_silu(q, wg, silu_q, xs=xs, block_n=32, block_k=64, quant=(down_q, down_xs))


def test_the_attention_merge_rounds_o_s_input_a_head_at_a_time():
    # DecodeAttention(quant=(q, xs)): the merge also rounds each head's output (one 32-wide activation group of the
    # o GEMV here) to FP8: the values quant_groups makes of attn_out
    from services.decode.engine.cuda import fp8
    from services.decode.engine.cuda.attention import DecodeAttention

    hq, hkv, d, t, pos = 4, 2, 32, 40, 33
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=4, block_s=16,
                           one_launch=False)
    q_in = rand(hq * d, seed=1)
    kc, vc = rand(t, hkv, d, seed=2), rand(t, hkv, d, seed=3) * torch.arange(1, hkv + 1).to(BF)[None, :, None]
    out, q, xs = torch.zeros(hq * d, dtype=BF), torch.zeros(hq * d, dtype=torch.float8_e4m3fn), torch.zeros(hq)
    attn(q_in, kc, vc, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d,
         quant=(q, xs))
    want_q, want_xs = torch.zeros_like(q), torch.zeros(hq)
    fp8.quant_groups(out, want_q, want_xs, d)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xs, want_xs)
    assert len(set(xs.tolist())) == hq  # a scale a head
    with pytest.raises(ValueError, match="two-launch"):
        DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=4, block_s=16)(
            q_in, kc, vc, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d,
            quant=(q, xs))


@pytest.mark.parametrize("kv_fp8,block", [(False, (32, 32)), (True, (16, 32))])
def test_block_fp8_qkv_rope_is_the_gemv_then_the_rope_kernel(kv_fp8, block):
    # gemv_fp8block_xq_qkv_rope stores q and this position's K/V exactly as gemv_fp8block_xq + rope_cache_write do;
    # 16-row scale blocks put a head's halves (16 rows each) in different scale rows
    from services.decode.engine.cuda import fp8, smallops
    from services.decode.engine.cuda.kvfp8 import kv_fmt

    hq, hkv, d, h, t, pos = 4, 2, 32, 128, 8, 5
    n = (hq + 2 * hkv) * d
    x, nw = rand(h, seed=11), 1 + rand(h, std=0.1, seed=12)
    w = quantize(rand(n, h, std=0.2, seed=13) * (1 + torch.arange(n) // 16 % 3)[:, None], block, act=True)
    q, xs = torch.zeros(h, dtype=torch.float8_e4m3fn), torch.zeros(h // 32)
    fp8.quant_groups(x, q, xs, 32, norm_w=nw)
    cos, sin = rand(t, d // 2, seed=1), rand(t, d // 2, seed=2)
    p = torch.tensor([pos], dtype=torch.int32)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    kv = dict(kv_fmt=kv_fmt("fp8_e4m3"), inv_k=1 / 0.05, inv_v=1 / 0.02) if kv_fp8 else {}
    cdt = torch.uint8 if kv_fp8 else BF
    outs = []
    for fused in (True, False):
        kc, vc, qo = torch.zeros(t, hkv, d, dtype=cdt), torch.zeros(t, hkv, d, dtype=cdt), torch.zeros(hq * d, dtype=BF)
        if fused:
            fp8.gemv_fp8block_xq_qkv_rope(q, xs, w, qo, kc, vc, p, cos, sin, **heads, block_n=8, block_k=64, **kv)
        else:
            qkv = fp8.gemv_fp8block_xq(q, xs, w, torch.zeros(n, dtype=BF), block_n=8, block_k=64)
            smallops.rope_cache_write(qkv, qo, kc, vc, p, cos, sin, **heads, **kv)
        outs.append((qo, kc, vc))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][1][pos].any() and not outs[0][1][:pos].any()


def test_block_fp8_gate_up_silu_refuses_what_it_cannot_tile():
    from services.decode.engine.cuda import fp8

    with pytest.raises(ValueError, match="weight-only"):
        fp8.gemv_fp8block_silu(rand(64), quantize(rand(64, 64), (16, 16), act=False), torch.empty(32, dtype=BF))
    with pytest.raises(ValueError, match="multiple of 16 rows"):  # 24 gate rows, programs of 16
        fp8.gemv_fp8block_silu(rand(64), quantize(rand(48, 64), (16, 16), act=True), torch.empty(24, dtype=BF))


def one_token_experts(**kw):
    """A one-token FP8 MoE case (32 x 32 blocks, 8 experts top-2 and a shared one): a function of GroupedMoe's
    settings (``kw``: its keyword arguments) returning the layer's output over a fixed residual."""
    h, e, inter, k = 128, 8, 64, 2
    xn, router_w, bias = rand(1, h, seed=1), rand(e, h, std=0.3, seed=2), torch.zeros(e)
    ids, wts = torch.zeros(1, k, dtype=torch.int32), torch.zeros(1, k)
    moe.router(xn, router_w, bias, ids, wts, k, 2.5)
    parts = [quantize(rand(*shape, std=0.2, seed=seed), (32, 32), True)
             for shape, seed in (((e, 2 * inter, h), 3), ((e, h, inter), 4), ((1, 2 * inter, h), 5), ((1, h, inter), 6))]

    def run():
        hbuf = rand(1, h, seed=9)
        moe.GroupedMoe(num_tokens=1, top_k=k, num_shared=1, hidden=h, inter=inter, device="cpu",
                       tiles=((8, 64, 4, 1), (8, 64, 4, 1)), **kw)(xn, ids, wts, *parts, hbuf)
        return hbuf
    return run


@pytest.mark.parametrize("fused_reduce", [True, False])
def test_grouped_one_token_expert_tiles_compute_what_flat_tiles_do(monkeypatch, fused_reduce):
    run, outs = one_token_experts(fused_reduce=fused_reduce), {}
    for grouped in (True, False):
        monkeypatch.setattr(fp8block, "GROUPED", grouped)
        outs[grouped] = run()
    assert rel(outs[True], outs[False]) <= 1e-2 / 4


@pytest.mark.parametrize("rows", [{}, {"gate_up": 16}, {"down": 16}, {"gate_up": 16, "down": 32}])
def test_expert_rows_a_program_compute_the_same(monkeypatch, rows):
    # GroupedMoe.FP8_ROWS (the fewest rows a program of the one-token FP8 experts' gate/up and down, a GPU run's
    # choice per projection): each reaches its kernel's tile, and the function stays the flat tiles' one
    asked, tile, run = [], moe.fp8_tile, one_token_experts()

    def spy(w, block_n, block_k, dot, accumulators=1, act_rows=None):
        asked.append(act_rows)
        return tile(w, block_n, block_k, dot, accumulators, act_rows)

    monkeypatch.setattr(moe, "fp8_tile", spy)
    outs = []
    for fp8_rows in ({}, rows):
        monkeypatch.setattr(moe.GroupedMoe, "FP8_ROWS", fp8_rows)
        outs.append(run())
    assert asked[2:] == [rows.get("gate_up"), rows.get("down")]
    assert rel(outs[1], outs[0]) <= 1e-2 / 4
    if not rows:
        assert torch.equal(outs[1], outs[0])


def test_the_mla_stack_asks_its_projections_rows_a_program():
    # MlaStack.FP8_ROWS by projection reaches gemv_rows as fp8_rows (None where a projection has none)
    from types import SimpleNamespace

    from services.decode.engine.cuda import mla

    stack = SimpleNamespace(tiles=dict(mla.MlaStack.PLAIN_TILES), pdl=False, early=False,
                            FP8_ROWS={"wo": 64, "wq_b": 128})
    assert mla.MlaStack._tile(stack, "wo")["fp8_rows"] == 64
    assert mla.MlaStack._tile(stack, "wq_b")["fp8_rows"] == 128
    assert mla.MlaStack._tile(stack, "wqkv_a")["fp8_rows"] is None
    assert mla.MlaStack.FP8_ROWS == {"wo": 64, "wq_b": 128}  # the product's (run G48)


def test_block_fp8_activations_are_rounded_per_group():
    # one huge feature in the first 32-wide group must not coarsen the second group's rounding (the output reads
    # the second group only: the first group's weights are zero)
    wf = rand(16, 64, std=0.2)
    wf[:, :32] = 0
    w = quantize(wf, (16, 32), act=True)
    x = rand(1, 64, std=0.01)
    x[0, 3] = 300.0
    out = torch.empty(1, 16, dtype=BF)
    moe.gemv_rows(x, w, out, block_n=8, block_k=64)
    assert rel(out, linear_reference(x, w).to(BF)) <= 1e-2 / 4
    per_token = engine_fp8.quantize_activations(x) @ w.dequantize(torch.float32).T
    assert rel(out, per_token.to(BF)) > 1e-2  # the per-token form rounds the small group coarsely


def test_stacked_projections_keep_their_bytes_with_finer_scale_rows():
    a, b = quantize(rand(24, 64, std=0.2, seed=1), (16, 32)), quantize(rand(32, 64, std=0.2, seed=2), (16, 32))
    with pytest.raises(ValueError, match="reference step serves"):  # 8-row scale rows < MIN_ROWS, and the
        cat_rows([a, b])  # activation rounding has no bf16 form
    wa, wb = (quantize(rand(n, 64, std=0.2, seed=n), (16, 32), act=False) for n in (24, 32))
    both = cat_rows([wa, wb])  # weight-only: dequantized, its reference numerics
    assert not isinstance(both, BlockFp8) and torch.equal(both, torch.cat([wa.dequantize(), wb.dequantize()]))
    a = quantize(rand(48, 64, std=0.2, seed=1), (32, 32))
    both = cat_rows([a, b])
    assert isinstance(both, BlockFp8) and both.rows == 16 and both.scale.shape == (5, 2)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    x, out = rand(2, 64), torch.empty(2, 80, dtype=BF)
    for t in (1, 2):
        moe.gemv_rows(x[:t], both, out[:t], block_n=8, block_k=32)
        assert rel(out[:t], linear_reference(x[:t], both).to(BF)) <= 1e-2 / 4


def test_shared_experts_split_with_their_scales():
    inter, h, s = 16, 64, 2
    gu, dn = quantize(rand(2 * s * inter, h, std=0.2), (16, 16)), quantize(rand(h, s * inter, std=0.2), (16, 16))
    sg, sd = split_experts(gu, dn, inter)
    full_g, full_u = gu.dequantize().view(2, s, inter, h).unbind(0)
    for e in range(s):
        assert torch.equal(sg[e].dequantize(), torch.cat([full_g[e], full_u[e]]))
        assert torch.equal(sd[e].dequantize(), dn.dequantize()[:, e * inter:(e + 1) * inter])
    assert split_experts(gu, quantize(rand(h, s * inter, std=0.2), (16, 32)), inter) is None  # 16 % 32: no split


@pytest.mark.parametrize("t,k,act", [(1, 2, True), (1, 3, False), (3, 2, True)])
def test_grouped_moe_reads_block_fp8_experts(t, k, act):
    h, e, inter, shared = 64, 8, 32, 1
    xn, router_w, bias = rand(t, h, seed=t), rand(e, h, std=0.3, seed=k), torch.zeros(e)
    bias[2] = 10.0  # every token picks expert 2: one program serves them all
    ids, wts = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k)
    moe.router(xn, router_w, bias, ids, wts, k, 2.5)
    gate_up = quantize(rand(e, 2 * inter, h, std=0.2, seed=3), (16, 32), act)
    down = quantize(rand(e, h, inter, std=0.2, seed=4), (16, 32), act)
    sg = quantize(rand(shared, 2 * inter, h, std=0.2, seed=5), (16, 32), act)
    sd = quantize(rand(shared, h, inter, std=0.2, seed=6), (16, 32), act)
    hbuf = rand(t, h, seed=9)
    before = hbuf.clone()
    tiles = ((16, 64, 4, 1), (32, 64, 4, 1)) if t > 1 else ((8, 64, 4, 1), (8, 32, 4, 1))
    grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=shared, hidden=h, inter=inter, device="cpu",
                             tiles=tiles)
    grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)

    def lin(x, w):  # the engine's reference linear on one expert, rounded as eager bf16
        return linear_reference(x, w).to(BF)

    y = torch.stack([torch.stack([lin(reference.silu_mul(lin(xn[i:i + 1], gate_up[j])), down[j])[0]
                                  for j in ids[i].tolist()]) for i in range(t)])
    routed = (y * wts[..., None].to(BF)).sum(dim=1)
    shared_out = lin(reference.silu_mul(lin(xn, sg[0])), sd[0])
    assert rel(hbuf - before, routed + shared_out) <= 2e-2


def test_weight_of_reads_the_engine_attributes():
    w = quantize(rand(32, 64, std=0.2), (16, 32))
    assert isinstance(fp8block.weight_of(w.w, w.scale, (16, 32), 32), BlockFp8)
    assert fp8block.weight_of(rand(4, 4), None, None, None).dtype == BF
    with pytest.raises(ValueError, match="only block scales"):
        fp8block.weight_of(w.w, torch.ones(32), None, None)
    with pytest.raises(ValueError, match="powers of two"):
        BlockFp8(w.w, torch.ones(3, 2), 12, 32)
    with pytest.raises(ValueError, match="of 16 or more"):  # the tensor-core tiles' least side
        BlockFp8(w.w, torch.ones(4, 2), 8, 32)


def _blocks(rows: int, cols: int, act: bool) -> fp8block.BlockFp8:
    return fp8block.BlockFp8(torch.zeros(2 * rows, 4 * cols, dtype=torch.float8_e4m3fn), torch.ones(2, 4), rows, cols,
                             act=act)


@pytest.mark.parametrize("rows,cols,act,dot,accumulators,asked,want", [
    (128, 128, True, False, 1, (8, 512), (32, 512)),  # one token, grouped activations: 32 rows a program
    (128, 128, True, False, 2, (8, 512), (32, 256)),  # gate and up in one program: K halved for the registers
    (64, 128, True, False, 1, (8, 512), (32, 512)),  # the fused wkv_a | wq_a stack's 64-row scale rows
    (16, 16, True, False, 1, (8, 64), (16, 64)),  # the tiny test models' blocks: rows cut to a scale row
    (128, 128, True, False, 1, (8, 128), (32, 128)),  # never below one whole group of columns
    (128, 128, False, False, 1, (8, 512), (8, 512)),  # weight-only: the bf16 tile
    (128, 128, True, True, 1, (16, 256), (16, 128)),  # tensor cores: K one block at a time
])
def test_fp8_tiles(rows, cols, act, dot, accumulators, asked, want):
    assert fp8block.tile(_blocks(rows, cols, act), *asked, dot=dot, accumulators=accumulators) == want
