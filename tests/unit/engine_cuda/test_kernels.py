"""The fast path's Triton kernels (run by Triton's interpreter on CPU) against their torch twins.

Each kernel must compute its twin's function with the same bf16 rounding points: results agree to
fp32 summation order (bit-equal here, where both sum in the same precision on one CPU).
"""

from __future__ import annotations

import pytest
import torch
import triton

from services.decode.engine.cuda import gemv
from services.decode.engine.cuda import moe
from services.decode.engine.cuda import smallops
from services.decode.engine.cuda import reference
from services.decode.engine.cuda.attention import DecodeAttention

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def named_tiles(monkeypatch):
    """Each launch here runs the tile the test names (the engine's interpreted launches widen their row tiles:
    gemv.interpreted_rows, held to these tiles by test_widened_row_tiles_compute_the_named_tiles_bits)."""
    monkeypatch.setattr(gemv, "INTERPRETED_PROGRAMS", 0)


def rand(*shape, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * std).to(BF)


def close(a, b, tol=1e-6):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() <= tol


@pytest.mark.parametrize("norm,residual,block_n,block_k,stages", [
    (False, False, 8, 32, 1), (True, False, 16, 64, 3), (False, True, 4, 32, 2), (True, True, 8, 128, 1),
])
def test_gemv_matches_twin(norm, residual, block_n, block_k, stages):
    x, w, nw, res = rand(96), rand(40, 96, std=0.1), 1 + rand(96, std=0.1), rand(40)
    out = torch.full((40,), float("nan"), dtype=BF)
    gemv.gemv(x, w, out, norm_w=nw if norm else None, eps=1e-5, residual=res.clone() if residual else None,
              block_n=block_n, block_k=block_k, stages=stages)
    xin = reference.rms_norm(x, nw, 1e-5) if norm else x
    ref = reference.linear(xin, w)
    close(out, res + ref if residual else ref)


def test_gemv_argmax_parts_and_greedy_finish_pick_lowest_tied_row():
    x, w = rand(64), rand(50, 64, std=0.1)
    w[11] = w[37] = x * 0.5  # an exact tie for the maximum, in different blocks
    logits, nparts = torch.empty(50), 7
    vals, idx = torch.empty(nparts), torch.empty(nparts, dtype=torch.int32)
    gemv.gemv(x, w, logits, block_n=8, block_k=32, argmax_parts=(vals, idx))
    assert int(torch.argmax(logits)) == 11 and logits[11] == logits[37]
    embed = rand(50, 16)
    token, out_tokens = torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    step, pos, h = torch.tensor([2]), torch.tensor([9], dtype=torch.int32), torch.zeros(16, dtype=BF)
    gemv.greedy_finish(vals, idx, nparts, token, out_tokens, step, pos, embed, h)
    assert int(token) == 11 and out_tokens.tolist() == [0, 0, 11, 0]
    assert int(step) == 3 and int(pos) == 10 and torch.equal(h, embed[11])


def test_gemv_silu_matches_twin():
    x, w, nw = rand(64), rand(2 * 24, 64, std=0.2), 1 + rand(64, std=0.1)
    out = torch.empty(24, dtype=BF)
    gemv.gemv_silu(x, w, out, norm_w=nw, eps=1e-5, block_n=8, block_k=32, stages=2)
    close(out, reference.silu_mul(reference.linear(reference.rms_norm(x, nw, 1e-5), w)))


@pytest.mark.parametrize("fused,pos_early", [(True, False), (True, True), (False, False)])
def test_qkv_rope_cache_write_matches_twin(fused, pos_early):
    hq, hkv, d, h, pos = 4, 2, 16, 64, 5
    x, w, nw = rand(h), rand((hq + 2 * hkv) * d, h, std=0.2), 1 + rand(h, std=0.1)
    cos, sin = rand(12, d // 2), rand(12, d // 2)
    q = torch.empty(hq * d, dtype=BF)
    kc, vc = torch.zeros(12, hkv, d, dtype=BF), torch.zeros(12, hkv, d, dtype=BF)
    p = torch.tensor([pos], dtype=torch.int32)
    if fused:
        gemv.gemv_qkv_rope(x, w, nw, 1e-5, q, kc, vc, p, cos, sin, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                           block_n=4, block_k=32, pos_early=pos_early)
    else:
        qkv = reference.linear(reference.rms_norm(x, nw, 1e-5), w)
        smallops.rope_cache_write(qkv, q, kc, vc, p, cos, sin, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    qkv = reference.linear(reference.rms_norm(x, nw, 1e-5), w).view(-1, d)
    close(q.view(hq, d), reference.rope(qkv[:hq], cos[pos], sin[pos]))
    close(kc[pos], reference.rope(qkv[hq:hq + hkv], cos[pos], sin[pos]))
    close(vc[pos], qkv[hq + hkv:])
    assert kc[pos + 1:].abs().sum() == 0 and kc[:pos].abs().sum() == 0  # only row pos written


def test_small_ops_match_twins():
    x, w = rand(3, 40), 1 + rand(40, std=0.1)
    out = torch.empty(3, 40, dtype=BF)
    smallops.rmsnorm_rows(x, w, out, 1e-6)
    close(out, reference.rms_norm(x, w, 1e-6))
    gu, act = rand(2 * 70), torch.empty(70, dtype=BF)
    smallops.silu_mul(gu, act, block=32)
    close(act, reference.silu_mul(gu))


@pytest.mark.parametrize("hq,hkv,t,pos,splits,block_s", [
    (8, 2, 1, 50, 4, 16),  # GQA decode
    (8, 2, 1, 2, 8, 16),  # more splits than tokens: empty splits merge to nothing
    (4, 4, 2, 30, 4, 16),  # two query tokens, causal between them
    (8, 2, 1, 100, 2, 16),  # several blocks per split (the first loaded before the wait)
    (8, 2, 1, 16, 4, 16),  # row pos first of its split, no earlier row in it
])
@pytest.mark.parametrize("one_launch", [True, False])
def test_gqa_attention_matches_twin(hq, hkv, t, pos, splits, block_s, one_launch):
    d = 32
    q, k, v = rand(t, hq, d), rand(pos + t + 3, hkv, d, seed=1), rand(pos + t + 3, hkv, d, seed=2)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_tokens=t, num_splits=splits,
                           block_s=block_s, one_launch=one_launch)
    out = torch.full((t, hq, d), float("nan"), dtype=BF)
    for _ in range(2):  # one launch for one token: the last split merges, its counters back to 0 for the next call
        attn(q, k, v, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d)
        close(out, reference.attention(q, k, v, pos, d ** -0.5), tol=1e-5)
        assert attn.one_launch == (t == 1 and one_launch) and not attn.count.any()


@pytest.mark.parametrize("v_is_k,v_chunks", [(True, 1), (False, 2)])
def test_mla_attention_latent_is_value_and_rope_part_separate(v_is_k, v_chunks):
    hq, r, rope, t, pos = 8, 32, 16, 3, 21
    q_c, q_pe, lat = rand(hq, t, r), rand(t, hq, rope, seed=3), rand(pos + t + 2, 1, r + rope, seed=4)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_tokens=t,
                           num_splits=4, block_s=16, v_is_k=v_is_k, v_chunks=v_chunks)
    out = torch.full((t, hq, r), float("nan"), dtype=BF)
    attn(q_c, lat, lat, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
         rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=t * r)
    ref = reference.attention(torch.cat([q_c.transpose(0, 1), q_pe], -1), lat, lat[..., :r], pos, (r + rope) ** -0.5)
    close(out, ref, tol=1e-5)


@pytest.mark.parametrize("pos,splits,min_chunk", [
    (0, 4, 16),  # the first token: no earlier row, only row pos (split 0)
    (64, 4, 16),  # 64 earlier rows fill 4 splits of 16 exactly: row pos joins the last split's softmax
    (37, 4, 16),  # row pos in the last active split's block
    (20, 8, 16),  # a short context: later splits empty, row pos in the second
    (70, 2, 16),  # several blocks a split
])
@pytest.mark.parametrize("v_chunks", [1, 2])
def test_mla_attention_with_row_pos_after_the_loop(pos, splits, min_chunk, v_chunks):
    # pos_last: the splits walk rows 0..pos-1 and row pos joins after the loop; the same attention as the twin's
    hq, r, rope = 16, 64, 16
    q_c, q_pe, lat = rand(hq, 1, r), rand(1, hq, rope, seed=3), rand(pos + 3, 1, r + rope, seed=4)
    ref = reference.attention(torch.cat([q_c.transpose(0, 1), q_pe], -1), lat, lat[..., :r], pos, (r + rope) ** -0.5)
    outs = {}
    for last in (True, False):
        attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_splits=splits,
                               block_s=16, v_chunks=v_chunks, min_chunk=min_chunk, pos_last=last)
        out = outs[last] = torch.full((1, hq, r), float("nan"), dtype=BF)
        attn(q_c, lat, lat, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
             rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=r)
        close(out, ref, tol=1e-5)
        # the splits that saw a key: with pos_last the rows 0..pos-1 spread over them and row pos joins the split
        # it falls in (at 64 = 4 x 16 rows: all 4 splits, the last with 17 keys, not 3 splits of 32)
        rows = pos if last else pos + 1
        chunk = max(-(-(-(-rows // splits)) // 16) * 16, min_chunk)
        want = {i for i in range(splits) if i * chunk < rows}
        if last:
            want.add(min(pos // chunk, splits - 1))
        seen = attn.part_ml.view(hq, splits, 2)[0, :, 0] > float("-inf")
        assert {i for i in range(splits) if seen[i]} == want


@pytest.mark.parametrize("t,norm,residual", [(1, True, False), (3, False, True), (4, True, True)])
def test_gemv_rows_matches_twin(t, norm, residual):
    x, w, nw, res = rand(t, 48), rand(20, 48, std=0.2), 1 + rand(48, std=0.1), rand(t, 20)
    out = res.clone() if residual else torch.empty(t, 20, dtype=BF)
    moe.gemv_rows(x, w, out, norm_w=nw if norm else None, residual=out if residual else None, block_n=8, block_k=16)
    ref = reference.linear(reference.rms_norm(x, nw, 1e-6) if norm else x, w)
    close(out, res + ref if residual else ref)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_gemv_rows_reads_a_per_head_output_in_place(t):
    x, w, res = rand(3, t, 16), rand(20, 48, std=0.2), rand(t, 20)  # x: [heads, T, D] as a bmm writes it
    out = res.clone()
    moe.gemv_rows(x, w, out, residual=out, heads=True, block_n=8, block_k=16)
    close(out, res + reference.linear(x.transpose(0, 1).reshape(t, 48), w))
    with pytest.raises(ValueError, match="norm_w"):
        moe.gemv_rows(x, w, out, norm_w=rand(48), heads=True)


# (tokens, experts, groups, groups kept, top-k): V3's 256 experts / 8 groups / 4 kept / top-8 scaled down,
# a one-group model, all groups kept (plain top-k), expert counts not a power of two (Kimi-K2: 384)
GROUPED_ROUTING = [(3, 8, 2, 1, 2), (2, 16, 4, 2, 3), (2, 64, 8, 4, 8), (2, 8, 1, 1, 2), (2, 8, 2, 2, 3),
                   (2, 12, 1, 1, 3), (2, 24, 4, 2, 4)]


@pytest.mark.parametrize("t,e,n_group,topk_group,k", GROUPED_ROUTING)
def test_group_limited_router_matches_twin_and_engine_route(t, e, n_group, topk_group, k):
    from types import SimpleNamespace

    from services.decode.engine.deepseek import route

    h = 32
    xn, router_w, bias = rand(t, h, seed=e), rand(e, h, std=0.3, seed=e), rand(e, std=0.1, seed=k).float()
    gs, grouped = e // n_group, topk_group < n_group
    if grouped:  # token 0: the best expert (0) sits in a group whose second best is poor; every other
        xn[0] = 0  # group has two good ones (distinct values: no ties)
        bias[:] = -0.2
        bias[0] = 0.5
        for g in range(1, n_group):
            bias[g * gs], bias[g * gs + 1] = 0.40 + 0.01 * g, 0.403 + 0.01 * g
    ids, wts = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k)
    moe.router(xn, router_w, bias, ids, wts, k, 2.5, n_group=n_group, topk_group=topk_group)
    rid, rw = reference.router(xn, router_w, bias, k, 2.5, n_group, topk_group)
    assert torch.equal(ids.long(), rid)
    close(wts, rw)
    if grouped:
        assert 0 not in rid[0].tolist() and 0 in reference.router(xn, router_w, bias, k, 2.5)[0][0].tolist()
        groups = rid // gs
        assert all(len(set(row)) <= topk_group for row in groups.tolist())
    cfg = SimpleNamespace(num_experts=e, n_group=n_group, topk_group=topk_group, num_experts_per_tok=k,
                          norm_topk_prob=True, routed_scaling_factor=2.5)
    eid, ew = route(cfg, SimpleNamespace(router=router_w, router_bias=bias), xn)  # the engine's reference step
    order = eid.argsort(dim=-1)
    assert torch.equal(eid.gather(1, order), rid.sort(dim=-1)[0])
    close(ew.gather(1, order), rw.gather(1, rid.argsort(dim=-1)))


def test_router_and_grouped_moe_read_each_expert_once_and_match_twin():
    t, h, e, k, inter, shared = 3, 32, 8, 2, 16, 2
    xn, router_w, bias = rand(t, h), rand(e, h, std=0.3), torch.zeros(e)
    bias[5] = 10.0  # every token picks expert 5: three pairs name it, one program computes it
    ids, wts = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k)
    moe.router(xn, router_w, bias, ids, wts, k, 2.5)
    rid, rw = reference.router(xn, router_w, bias, k, 2.5)
    assert torch.equal(ids.long(), rid) and (ids[:, 0] == 5).all()
    close(wts, rw)
    gate_up, down = rand(e, 2 * inter, h, std=0.2), rand(e, h, inter, std=0.2)
    sg, sd = rand(shared, 2 * inter, h, std=0.2), rand(shared, h, inter, std=0.2)
    hbuf = rand(t, h, seed=9)
    grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=shared, hidden=h, inter=inter, device="cpu",
                             tiles=((8, 16, 4, 1), (8, 16, 4, 1)))
    before = hbuf.clone()
    grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)
    full_sg = torch.cat([sg[:, :inter].reshape(-1, h), sg[:, inter:].reshape(-1, h)])
    full_sd = torch.cat(list(sd), dim=1)
    ref = reference.moe(xn, rid, rw, gate_up, down, full_sg, full_sd)
    close(hbuf, before + ref, tol=1e-2 / 8)  # shared halves summed in fp32 before rounding: 1 ulp at most


@pytest.mark.parametrize("t,k,shared,dot", [(1, 2, 2, False), (3, 2, 2, False), (4, 3, 1, True), (2, 0, 1, True)])
def test_grouped_moe_fused_reduce_is_the_reduce_launch(t, k, shared, dot):
    # the down kernel's last program of each column block adds the weighted pairs' rows into h (FUSED_REDUCE):
    # the same h, bit for bit, as the reduce kernel's launch, with rows sharing an expert (a dense MLP: k = 0),
    # on the one-token FMA path and the tensor-core path; its counts go back to 0 for the next call
    h, e, inter = 32, 8, 16
    xn, router_w, bias = rand(t, h, seed=t), rand(e, h, std=0.3, seed=k + 1), torch.zeros(e)
    bias[3] = 10.0  # every token picks expert 3
    ids, wts = torch.zeros(t, max(k, 1), dtype=torch.int32), torch.zeros(t, max(k, 1))
    if k:
        moe.router(xn, router_w, bias, ids, wts, k, 2.5)
    gate_up, down = rand(e, 2 * inter, h, std=0.2, seed=3), rand(e, h, inter, std=0.2, seed=4)
    sg, sd = rand(shared, 2 * inter, h, std=0.2, seed=5), rand(shared, h, inter, std=0.2, seed=6)
    tiles = ((16, 16, 4, 1), (16, 16, 4, 1)) if dot else ((8, 16, 4, 1), (8, 16, 4, 1))
    out = {}
    for fused in (False, True):
        hbuf = rand(t, h, seed=9)
        grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=shared, hidden=h, inter=inter, device="cpu",
                                 tiles=tiles, fused_reduce=fused)
        grouped.DOWN_ROWS_TILE = None  # the down kernel by pairs (one token takes the rows kernel by default)
        assert grouped.dot == (t > 1)
        for _ in range(2):  # twice: the counts were reset by the first call
            grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)
        out[fused] = hbuf
        assert grouped.count.eq(0).all()
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize("t,k,shared,h,dtype", [
    (3, 2, 2, 32, torch.float32), (4, 3, 1, 48, torch.bfloat16),  # H not a power of two: masked columns
    (2, 0, 1, 32, torch.bfloat16)])  # a dense MLP (the one shared expert)
def test_reduce_that_norms_h_writes_what_the_reduce_and_the_norm_launch_write(t, k, shared, h, dtype,
                                                                               pdl_interpreted):
    # GroupedMoe(next_norm=...) of several tokens: its reduce launch, one program a row, also writes RMSNorm(h) * w
    # (the next block's attention input): h and that output bit for bit as the reduce launch then
    # smallops.rmsnorm_rows, rows of a wider buffer included (a strided output)
    e, inter = 8, 16
    xn, router_w, bias = rand(t, h, seed=t).to(dtype), rand(e, h, std=0.3, seed=k + 1), torch.zeros(e)
    ids, wts = torch.zeros(t, max(k, 1), dtype=torch.int32), torch.zeros(t, max(k, 1))
    if k:
        moe.router(xn.float(), router_w, bias, ids, wts, k, 2.5)
    gate_up, down = rand(e, 2 * inter, h, std=0.2, seed=3).to(dtype), rand(e, h, inter, std=0.2, seed=4).to(dtype)
    sg, sd = rand(shared, 2 * inter, h, std=0.2, seed=5).to(dtype), rand(shared, h, inter, std=0.2, seed=6).to(dtype)
    nw = (1 + 0.1 * rand(h, seed=7)).to(dtype)
    out = {}
    for fold in (False, True):
        hbuf = rand(t, h, seed=9).to(dtype)
        xn_out = torch.full((t, h + 8), float("nan"), dtype=dtype)[:, :h]
        grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=shared, hidden=h, inter=inter, device="cpu",
                                 tiles=((16, 16, 4, 1), (16, 16, 4, 1)), pdl=True)
        if fold:
            assert grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf, next_norm=(nw, xn_out, 1e-6))
        else:
            assert not grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)
            smallops.rmsnorm_rows(hbuf, nw, xn_out, 1e-6)
        out[fold] = (hbuf, xn_out)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    assert not torch.isnan(out[True][1].float()).any()


@pytest.mark.parametrize("k,shared,inter,tile,pdl", [
    (2, 2, 24, (4, 4, 2), False),  # routed and shared pairs; I not a power of two (a masked tile)
    (6, 2, 40, (8, 4, 3), True),  # V2-Lite's pairs; the first pair's tile before the wait
    (0, 1, 32, (2, 4, 1), True),  # a dense MLP (the one shared expert)
    (3, 1, 16, (16, 4, 2), False),  # rows past H masked (H = 40)
])
def test_down_by_rows_is_the_down_kernel_and_its_reduce(k, shared, inter, tile, pdl, pdl_interpreted):
    # _moe_down_rows_kernel (a program's rows over every pair, the reduce in its epilogue) gives h bit for bit as the
    # down kernel by pairs + the reduce launch, whose K tile here spans I (the same fp32 sums)
    h, e, t = 40, 8, 1
    xn, router_w, bias = rand(t, h, seed=2), rand(e, h, std=0.3, seed=k + 7), torch.zeros(e)
    ids, wts = torch.zeros(t, max(k, 1), dtype=torch.int32), torch.zeros(t, max(k, 1))
    if k:
        moe.router(xn, router_w, bias, ids, wts, k, 2.5)
    gate_up, down = rand(e, 2 * inter, h, std=0.2, seed=3), rand(e, h, inter, std=0.2, seed=4)
    sg, sd = rand(shared, 2 * inter, h, std=0.2, seed=5), rand(shared, h, inter, std=0.2, seed=6)
    bk = 1 << (inter - 1).bit_length()
    out = {}
    for rows in (False, True):
        hbuf = rand(t, h, seed=9)
        grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=shared, hidden=h, inter=inter, device="cpu",
                                 tiles=((8, 16, 4, 1), (8, bk, 4, 1)), fused_reduce=False, pdl=pdl)
        grouped.DOWN_ROWS_TILE = tile if rows else None
        grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)
        out[rows] = hbuf
    assert torch.equal(out[True], out[False])
    assert out[True].ne(rand(t, h, seed=9)).any()


def test_widened_row_tiles_compute_the_named_tiles_bits(monkeypatch):
    # under the interpreter the row-tiled launches take the rows of several programs in one
    # (gemv.interpreted_rows): every output bit as with the tile named, at most INTERPRETED_PROGRAMS programs
    h, inter, e, k, t = 200, 48, 16, 2, 1  # K = 200: another summation order shows in fp32 sums
    x, nw, res = rand(h, seed=1), 1 + rand(h, std=0.1, seed=2), rand(72, seed=3)
    w, w_gu = rand(72, h, std=0.2, seed=4), rand(2 * inter, h, std=0.2, seed=5)
    router_w, bias = rand(e, h, std=0.3, seed=6), torch.zeros(e)
    gate_up, down = rand(e, 2 * inter, h, std=0.2, seed=7), rand(e, h, inter, std=0.2, seed=8)
    sg, sd = rand(1, 2 * inter, h, std=0.2, seed=9), rand(1, h, inter, std=0.2, seed=10)
    launched = []
    grid_call = triton.runtime.interpreter.GridExecutor.__call__

    def count_programs(self, *args, **kwargs):
        launched.append((self.fn.__name__, self.grid))
        return grid_call(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.interpreter.GridExecutor, "__call__", count_programs)
    out = {}
    for programs in (0, 4):
        monkeypatch.setattr(gemv, "INTERPRETED_PROGRAMS", programs)
        launched.clear()
        y, rows, silu = torch.empty(72, dtype=BF), res[None].clone(), torch.empty(inter, dtype=BF)
        sums = torch.empty(1, 72)  # fp32: the sums themselves, unrounded
        gemv.gemv(x, w, y, norm_w=nw, block_n=4, block_k=16)
        moe.gemv_rows(x[None], w, rows, norm_w=nw, residual=rows, block_n=4, block_k=16)
        moe.gemv_rows(x[None], w, sums, block_n=4, block_k=16)
        gemv.gemv_silu(x, w_gu, silu, norm_w=nw, block_n=4, block_k=16)
        xn, ids, wts, logits = torch.empty(t, h, dtype=BF), torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k), \
            torch.empty(t, e)
        hbuf = x[None].clone()
        moe.router(hbuf, router_w, bias, ids, wts, k, 2.5, norm_w=nw, xn_out=xn, logits=logits)
        grouped = moe.GroupedMoe(num_tokens=t, top_k=k, num_shared=1, hidden=h, inter=inter, device="cpu",
                                 tiles=((4, 16, 4, 1), (8, 64, 4, 1)), fused_reduce=False)
        grouped.DOWN_ROWS_TILE = (4, 4, 1)
        grouped(xn, ids, wts, gate_up, down, sg, sd, hbuf)
        out[programs] = (y, rows, sums, silu, logits, ids, hbuf)
        grids = {name: grid[-1] if name == "_moe_gate_up_kernel" else grid[0] for name, grid in launched}
        if programs:  # each launch at most 4 programs, more than one where the rows span several tiles
            assert all(1 < n <= 4 for n in grids.values()), grids
        else:
            assert grids["_gemv_kernel"] == 18 and grids["_router_fused_kernel"] == 8, grids
    for a, b in zip(out[0], out[4]):
        assert torch.equal(a, b)
