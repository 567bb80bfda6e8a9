"""The MLA step's ``_combine_uv_kernel`` (the attention splits' merge + o . w_uv in one launch; Triton
interpreter) against the merge kernel's arithmetic and the torch matmul it replaces, over shapes of the tiny
test models and DeepSeek-V2-Lite/V3 (heads cut to keep the interpreter quick), with empty splits, in latent
chunks and in one; with ``_absorb_kernel`` for one token and for a batch's rows (each row its own slot's
partials and query), and the latent prep with it in one launch for one row or several."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda.kvfp8 import kv_fmt
from services.decode.engine.cuda.mla import _absorb_kernel, _combine_uv_kernel, _mla_prep_kernel, _prep_absorb_kernel

BF = torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("heads,splits,r,v,empty,chunk", [
    (2, 4, 32, 24, (), 32),  # the tiny test models: a value width that is not a power of two
    (4, 16, 512, 128, (3, 9), 512),  # V2-Lite/V3 latent and values, the product's one chunk, empty splits
    (4, 16, 512, 128, (), 128),  # ... in four chunks
    (3, 8, 64, 40, (0,), 32),
])
def test_combine_uv_equals_the_merge_then_the_bmm(heads, splits, r, v, empty, chunk, rows):
    # partial rows t * heads + h (the attention's batch layout), out [heads, rows, v] (the wo GEMV's heads input)
    g = torch.Generator().manual_seed(heads + splits + r)
    part_o = torch.randn(rows * heads, splits, r, generator=g)
    m = torch.randn(rows * heads, splits, generator=g) * 3
    l = torch.rand(rows * heads, splits, generator=g) + 0.5
    for s in empty:  # a split past the sequence: no keys, max -inf, sum 0
        m[:, s], l[:, s], part_o[:, s] = float("-inf"), 0.0, 0.0
    part_ml = torch.stack([m, l], dim=-1).contiguous()
    w_uv_t = (torch.randn(heads, r, v, generator=g) * r ** -0.5).to(BF)
    out = torch.zeros(heads, rows, v, dtype=BF)
    bv = min(32, 1 << (v - 1).bit_length())
    _combine_uv_kernel[(heads, -(-v // bv), rows)](part_o, part_ml, w_uv_t, out, NUM_SPLITS=splits, R=r, V=v,
                                                   BLOCK_V=bv, CHUNK_R=chunk, T=rows, NUM_HEADS=heads)
    w = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp2(m - m.max(dim=1, keepdim=True).values))
    o_lat = ((part_o * w[..., None]).sum(1) / (w * l).sum(1, keepdim=True)).to(BF)  # the merge kernel's bf16 output
    o_lat = o_lat.view(rows, heads, r).transpose(0, 1)  # [heads, rows, r]
    want = (o_lat.float() @ w_uv_t.float()).to(BF)
    assert (out.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,hidden,rows", [
    (8, 2, 1, 1, 32, 1),  # the tiny test models
    (64, 6, 1, 1, 256, 1),  # DeepSeek-V2-Lite's routing (hidden cut)
    (256, 8, 8, 4, 256, 1),  # DeepSeek-V3's group-limited routing
    (384, 8, 1, 1, 128, 1),  # Kimi-K2's expert count, not a power of two
    (64, 6, 1, 1, 256, 3),  # a batch's (or a verify's) rows: each its own norm, GEMV and top-k
    (256, 8, 8, 4, 128, 4),
])
def test_fused_router_equals_norm_then_router(experts, top_k, n_group, topk_group, hidden, rows):
    """router(norm_w=...) (norm + GEMV + top-k of every row in one launch, each row's last program picking)
    gives the experts, weights and normed input of rmsnorm_rows + the two-launch router, and leaves its
    counts at 0."""
    from services.decode.engine.cuda import smallops
    from services.decode.engine.cuda.moe import router

    g = torch.Generator().manual_seed(experts + hidden + rows)
    h = torch.randn(rows, hidden, generator=g).to(BF)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF)
    w = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(BF)
    bias = torch.randn(experts, generator=g) * 0.1
    xn_a, xn_b = torch.zeros(rows, hidden, dtype=BF), torch.zeros(rows, hidden, dtype=BF)
    ids_a, ids_b = torch.zeros(rows, top_k, dtype=torch.int32), torch.zeros(rows, top_k, dtype=torch.int32)
    wts_a, wts_b = torch.zeros(rows, top_k), torch.zeros(rows, top_k)
    count = torch.zeros(rows, dtype=torch.int32)
    router(h, w, bias, ids_a, wts_a, top_k, 2.5, n_group=n_group, topk_group=topk_group, norm_w=norm_w, eps=1e-6,
           xn_out=xn_a, count=count)
    smallops.rmsnorm_rows(h, norm_w, xn_b, 1e-6)
    router(xn_b, w, bias, ids_b, wts_b, top_k, 2.5, n_group=n_group, topk_group=topk_group)
    assert torch.equal(xn_a, xn_b) and torch.equal(ids_a, ids_b) and torch.equal(wts_a, wts_b)
    assert count.eq(0).all() and all(len(set(r)) == top_k for r in ids_a.tolist())
    if rows > 1:  # the rows route differently (else a row-offset slip could pass)
        assert len({tuple(r) for r in ids_a.tolist()}) > 1
    with pytest.raises(ValueError, match="count of"):
        router(h, w, bias, ids_a, wts_a, top_k, 2.5, norm_w=norm_w, xn_out=xn_a, count=count[:rows - 1])


@pytest.mark.parametrize("heads,nope,rope,r,block_r,early,rows", [
    (2, 16, 8, 32, 32, False, 1), (4, 128, 64, 512, 64, False, 1), (3, 32, 16, 64, 16, True, 1),
    (2, 16, 8, 32, 32, True, 4),  # a batch's rows: each row's query, the w_uk tile read once for them
    (3, 32, 16, 64, 16, False, 3)])
def test_absorb_kernel_is_the_bmm(heads, nope, rope, r, block_r, early, rows, pdl_interpreted):
    # q_c[h, t] = q_nope[t, h] @ w_uk[h] from the QKV GEMV's rows ([q_nope | q_pe] per head), one bf16 rounding
    # of the fp32 sums as torch's bf16 bmm; the EARLY variant (w_uk's tile before the wait) the same
    g = torch.Generator().manual_seed(heads + r)
    qkv = torch.randn(rows, heads * (nope + rope) + 40, generator=g).to(BF)
    w_uk = (torch.randn(heads, nope, r, generator=g) * nope ** -0.5).to(BF)
    out = torch.full((heads, rows, r), float("nan"), dtype=BF)
    _absorb_kernel[(heads, r // block_r)](qkv, w_uk, out, w_uk.stride(0), w_uk.stride(1), NOPE=nope, QK=nope + rope,
                                          R=r, BLOCK_R=block_r, PDL=early, EARLY=early, T=rows,
                                          stride_qkv=qkv.stride(0))
    q_nope = qkv[:, :heads * (nope + rope)].view(rows, heads, nope + rope)[..., :nope]
    want = (q_nope.float().transpose(0, 1) @ w_uk.float()).to(BF)  # [H, rows, r]
    assert torch.equal(out, want) or ((out.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7)


@pytest.mark.parametrize("heads,nope,rope,r,block_r,early,fp8", [
    (2, 16, 8, 32, 32, False, False),  # the tiny test models
    (4, 128, 64, 512, 64, True, False),  # V2-Lite / V3 heads' shapes (heads cut), w_uk's tile before the wait
    (3, 32, 16, 64, 16, True, True),  # an FP8 latent cache
])
def test_prep_and_absorb_in_one_launch_write_what_the_two_kernels_write(heads, nope, rope, r, block_r, early, fp8,
                                                                        pdl_interpreted):
    # _prep_absorb_kernel (one token): q_pe roped, the latent row normed + roped into the cache at pos, and q . w_uk,
    # bit for bit as _mla_prep_kernel then _absorb_kernel
    g = torch.Generator().manual_seed(heads + r)
    qkv = torch.randn(1, heads * (nope + rope) + r + rope, generator=g).to(BF)
    w_uk = (torch.randn(heads, nope, r, generator=g) * nope ** -0.5).to(BF)
    nw = (1 + 0.1 * torch.randn(r, generator=g)).to(BF)
    cos, sin = torch.randn(16, rope // 2, generator=g).to(BF), torch.randn(16, rope // 2, generator=g).to(BF)
    pos = torch.tensor([5], dtype=torch.int32)
    fmt = dict(KV_FMT=kv_fmt("fp8_e4m3", nearest=True), inv_scale=20.0) if fp8 else {}
    got = []
    for one in (True, False):
        cache = torch.zeros(16, r + rope, dtype=torch.uint8 if fp8 else BF)
        q_pe = torch.zeros(1, heads, rope, dtype=BF)
        q_c = torch.full((heads, 1, r), float("nan"), dtype=BF)
        if one:
            _prep_absorb_kernel[(heads + 1 + heads * (r // block_r),)](
                qkv, q_pe, cache, nw, pos, cos, sin, qkv.stride(0), 1e-6, w_uk, q_c, w_uk.stride(0), w_uk.stride(1),
                NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r, BLOCK_R=block_r, PDL=early, EARLY=early, **fmt)
        else:
            _mla_prep_kernel[(1, heads + 1)](qkv, q_pe, cache, nw, pos, cos, sin, qkv.stride(0), 1e-6,
                                             NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r, **fmt)
            _absorb_kernel[(heads, r // block_r)](qkv, w_uk, q_c, w_uk.stride(0), w_uk.stride(1), NOPE=nope,
                                                  QK=nope + rope, R=r, BLOCK_R=block_r, PDL=False, EARLY=False)
        got.append((q_pe, cache, q_c))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert got[0][1][5].any() and not got[0][1][:5].any() and not torch.isnan(got[0][2].float()).any()


@pytest.mark.parametrize("rows,batch,fp8", [
    (4, True, False),  # a batch: each row its own slot's token at its own position
    (3, False, False),  # a verify: one slot's consecutive tokens
    (2, True, True),  # a batch over an FP8 latent cache
])
def test_prep_and_absorb_of_several_rows_in_one_launch_write_what_the_two_kernels_write(rows, batch, fp8,
                                                                                        pdl_interpreted):
    # _prep_absorb_kernel over T rows: every row's q_pe, latent row and q . w_uk, bit for bit as _mla_prep_kernel's
    # T x (heads + 1) programs then _absorb_kernel's over the T rows; nothing else in the cache is written
    heads, nope, rope, r, block_r = 3, 32, 16, 64, 16
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, heads * (nope + rope) + r + rope, generator=g).to(BF)
    w_uk = (torch.randn(heads, nope, r, generator=g) * nope ** -0.5).to(BF)
    nw = (1 + 0.1 * torch.randn(r, generator=g)).to(BF)
    cos, sin = torch.randn(16, rope // 2, generator=g).to(BF), torch.randn(16, rope // 2, generator=g).to(BF)
    if batch:
        pos = torch.tensor([5, 9, 2, 7][:rows], dtype=torch.int32)
        slots = torch.tensor([2, 0, 3, 1][:rows], dtype=torch.int32)
    else:
        pos, slots = torch.tensor([5], dtype=torch.int32), None
    fmt = dict(KV_FMT=kv_fmt("fp8_e4m3", nearest=True), inv_scale=20.0) if fp8 else {}
    got = []
    for one in (True, False):
        cache = torch.zeros(4, 16, r + rope, dtype=torch.uint8 if fp8 else BF)
        view = cache if batch else cache[0]
        rows_at = dict(slot_ptr=slots if batch else pos, stride_cs=cache.stride(0) if batch else 0, BATCH=batch)
        q_pe = torch.zeros(rows, heads, rope, dtype=BF)
        q_c = torch.full((heads, rows, r), float("nan"), dtype=BF)
        if one:
            _prep_absorb_kernel[(rows * (heads + 1) + heads * (r // block_r),)](
                qkv, q_pe, view, nw, pos, cos, sin, qkv.stride(0), 1e-6, w_uk, q_c, w_uk.stride(0), w_uk.stride(1),
                NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r, BLOCK_R=block_r, PDL=True, EARLY=True, T=rows, **rows_at,
                **fmt)
        else:
            _mla_prep_kernel[(rows, heads + 1)](qkv, q_pe, view, nw, pos, cos, sin, qkv.stride(0), 1e-6,
                                                NUM_HEADS=heads, NOPE=nope, ROPE=rope, R=r, **rows_at, **fmt)
            _absorb_kernel[(heads, r // block_r)](qkv, w_uk, q_c, w_uk.stride(0), w_uk.stride(1), NOPE=nope,
                                                  QK=nope + rope, R=r, BLOCK_R=block_r, PDL=False, EARLY=False,
                                                  T=rows, stride_qkv=qkv.stride(0))
        got.append((q_pe, cache, q_c))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    written = {(int(s), int(p)) for s, p in zip(slots, pos)} if batch else {(0, 5 + i) for i in range(rows)}
    cache = got[0][1]
    assert {(s, p) for s in range(4) for p in range(16) if cache[s, p].any()} == written
    assert not torch.isnan(got[0][2].float()).any() and got[0][0].abs().sum(dim=(1, 2)).gt(0).all()


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,hidden,inter,shared,tile", [
    (8, 2, 1, 1, 32, 24, 1, (8, 16, 4, 1)),  # the tiny test models
    (64, 6, 1, 1, 256, 40, 2, (16, 64, 4, 2)),  # V2-Lite's routing and two shared experts; a partial row block
    (256, 8, 8, 4, 128, 32, 1, (8, 512, 4, 3)),  # V3's group-limited routing; K in one tile
])
@pytest.mark.parametrize("pdl", [False, True])
def test_shared_experts_in_the_router_launch_equal_their_gate_up_launch(experts, top_k, n_group, topk_group,
                                                                       hidden, inter, shared, tile, pdl,
                                                                       pdl_interpreted):
    """router(shared=...) runs the shared experts' gate/up + SiLU beside the router (moe.SharedGateUp), and the
    grouped gate/up launch then covers the routed pairs only: the experts, the act rows and the MoE's output equal
    the router + a gate/up launch over every pair, bit for bit; the router's count is back at 0."""
    from services.decode.engine.cuda.moe import GroupedMoe, router

    g = torch.Generator().manual_seed(experts + hidden + inter)
    h0 = torch.randn(1, hidden, generator=g).to(BF)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF)
    w = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(BF)
    bias = torch.randn(experts, generator=g) * 0.1
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(BF)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(BF)
    sg = (torch.randn(shared, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(BF)
    sd = (torch.randn(shared, hidden, inter, generator=g) * inter ** -0.5).to(BF)
    out = {}
    for together in (False, True):
        moe = GroupedMoe(num_tokens=1, top_k=top_k, num_shared=shared, hidden=hidden, inter=inter, device="cpu",
                         tiles=(tile, (8, 32, 4, 1)), pdl=pdl)
        h, xn = h0.clone(), torch.zeros(1, hidden, dtype=BF)
        ids, wts, count = torch.zeros(1, top_k, dtype=torch.int32), torch.zeros(1, top_k), torch.zeros(1, dtype=torch.int32)
        sh = moe.shared_gate_up(sg) if together else None
        assert (sh is not None) == together
        router(h, w, bias, ids, wts, top_k, 2.5, n_group=n_group, topk_group=topk_group, norm_w=norm_w, eps=1e-6,
               xn_out=xn, count=count, pdl=pdl, shared=sh)
        moe(xn, ids, wts, gate_up, down, sg, sd, h, shared_done=together)
        assert count.eq(0).all()
        out[together] = (ids, wts, xn, moe.act.clone(), h)
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)
    assert out[True][4].ne(h0).any()  # the MoE added something
