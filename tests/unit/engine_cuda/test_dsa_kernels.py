"""Sparse attention's decode kernels (cuda/dsa.py, attention.py ``sparse=``), interpreted on CPU (conftest.py).

- The indexer's scores equal the reference step's formula (engine/deepseek.py ``_selected``): weighted
  ReLU of the per-head dot products, -inf past pos, whole blocks past pos included.
- The top-k list holds exactly the rows the reference step selects.
- MLA attention over a listed set of rows (any order, rows past pos masked) equals attention over those
  rows alone; with every visible row listed it equals dense attention.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine.cuda import reference
from services.decode.engine.cuda.attention import DecodeAttention
from services.decode.engine.cuda.dsa import RadixTopK, SparseSelect, indexer_scores, indexer_scores_reference
from tests.unit.engine_cuda.test_kernels import BF, close, rand


@pytest.mark.parametrize("pos,rows,block_t", [(37, 64, 16), (5, 48, 16), (63, 64, 32)])
def test_indexer_scores_match_the_reference_formula(pos, rows, block_t):
    h, d = 16, 32
    q, k = rand(h, d, seed=1), rand(rows, d, seed=2)
    w = rand(h, seed=3).float() * h ** -0.5
    out = torch.full((rows,), float("nan"))
    indexer_scores(q, w, k, torch.tensor([pos], dtype=torch.int32), out, block_t=block_t)
    ref = indexer_scores_reference(q, w, k, pos)
    assert torch.isinf(out[pos + 1:]).all() and (out[pos + 1:] < 0).all()
    torch.testing.assert_close(out[:pos + 1], ref[:pos + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos,top_k", [(60, 8), (5, 8)])  # a short context: every visible row, the rest masked
def test_top_k_lists_the_rows_the_reference_selects(pos, top_k):
    h, d, rows = 16, 32, 64
    q, k = rand(h, d, seed=4), rand(rows, d, seed=5)
    w = rand(h, seed=6).float().abs()
    sel = SparseSelect(max_tokens=rows, top_k=top_k, device="cpu", block_t=16)
    idx, count = sel(q, w, k, torch.tensor([pos], dtype=torch.int32))
    ref = indexer_scores_reference(q, w, k, pos).topk(min(top_k, pos + 1)).indices
    chosen = {int(i) for i in idx if i <= pos}
    assert chosen == {int(i) for i in ref} and int(count) == top_k


def _mla(hq=8, r=32, rope=16, rows=80):
    q_c, q_pe, lat = rand(hq, 1, r), rand(1, hq, rope, seed=7), rand(rows, 1, r + rope, seed=8)
    return q_c, q_pe, lat


def _run_sparse(q_c, q_pe, lat, pos, idx, splits=4):
    hq, _, r = q_c.shape
    rope = q_pe.shape[-1]
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_tokens=1,
                           num_splits=splits, block_s=16, v_chunks=2)
    out = torch.full((1, hq, r), float("nan"), dtype=BF)
    attn(q_c, lat, lat, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
         rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=r,
         sparse=(idx.to(torch.int32), torch.tensor([idx.numel()], dtype=torch.int32)))
    return out


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_mla_attention_is_attention_over_the_listed_rows(splits):
    q_c, q_pe, lat = _mla()
    pos, r = 70, q_c.shape[-1]
    idx = torch.tensor([69, 3, 41, 70, 12, 0, 55, 28, 77, 79, 33])  # any order; 77 and 79 are past pos
    out = _run_sparse(q_c, q_pe, lat, pos, idx, splits)
    rows = torch.tensor(sorted(int(i) for i in idx if i <= pos))
    q = torch.cat([q_c.transpose(0, 1), q_pe], -1)
    picked = lat[rows]
    ref = reference.attention(q, picked, picked[..., :r], rows.numel() - 1, (r + q_pe.shape[-1]) ** -0.5)
    close(out, ref, tol=1e-5)


def test_listing_every_visible_row_is_dense_attention():
    q_c, q_pe, lat = _mla()
    pos, r = 50, q_c.shape[-1]
    out = _run_sparse(q_c, q_pe, lat, pos, torch.randperm(pos + 1, generator=torch.Generator().manual_seed(0)))
    q = torch.cat([q_c.transpose(0, 1), q_pe], -1)
    close(out, reference.attention(q, lat, lat[..., :r], pos, (r + q_pe.shape[-1]) ** -0.5), tol=1e-5)


def test_sparse_needs_one_token_of_one_slot():
    attn = DecodeAttention(num_q_heads=8, num_kv_heads=1, d_main=32, d_v=32, d_rope=16, num_tokens=2)
    q = rand(8, 2, 32)
    with pytest.raises(ValueError, match="one query token"):
        attn(q, q, q, torch.tensor([3], dtype=torch.int32), q, stride_kt=48, stride_vt=48,
             sparse=(torch.zeros(4, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)))


@pytest.mark.parametrize("n,k,ties", [(300, 16, False), (300, 16, True), (100, 100, False), (257, 1, False)])
def test_radix_top_k_is_the_set_of_the_k_largest(n, k, ties):
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(n, generator=g) * 3
    if ties:  # many equal scores at the boundary, and negative, zero and -inf ones
        scores[::3] = 1.25
        scores[1::7] = float("-inf")
        scores[2::11] = 0.0
    top = RadixTopK(n, k, "cpu", block=64, num_warps=4)
    for _ in range(2):  # its histograms and counters reset themselves for the next call
        idx = torch.full((k,), -1, dtype=torch.int32)
        top(scores, idx)
        assert len(set(idx.tolist())) == k and (idx >= 0).all()
        kth = scores.topk(k).values[-1]
        picked = scores[idx.long()]
        assert (picked >= kth).all()  # nothing below the k-th largest
        assert int((scores > kth).sum()) <= int((picked > kth).sum())  # everything above it


def test_select_with_the_radix_top_k_lists_the_reference_rows():
    h, d, rows, pos, top_k = 16, 32, 128, 100, 8
    q, k = rand(h, d, seed=9), rand(rows, d, seed=10)
    w = rand(h, seed=11).float().abs()
    sel = SparseSelect(max_tokens=rows, top_k=top_k, device="cpu", block_t=16, radix=True)
    idx, _ = sel(q, w, k, torch.tensor([pos], dtype=torch.int32))
    ref = indexer_scores_reference(q, w, k, pos).topk(top_k).indices
    assert set(idx.tolist()) == set(ref.tolist())
