"""DeepSeek-V3.2 sparse attention (DSA) of one layer at 128K context on one GPU, against dense MLA attention.

    python3 bench/decode_gpu_dsa.py [--ctx 131072] [--out decode_gpu_dsa.json]

One decode token (batch 1) of a DeepSeek-V3.2 attention layer's shapes (128 query heads, latent 512 +
rope 64, the indexer's 64 heads of 128, top-k 2048), random bf16 caches full to ``--ctx`` rows:
- dense: the fast path's MLA attention (attention.DecodeAttention as mla.MlaStack configures it: the
  absorbed query against every latent row), split counts swept, the best kept;
- sparse: the indexer's scores over every row (dsa.indexer_scores) + ``torch.topk`` (dsa.SparseSelect) +
  the same attention kernel over the 2048 listed rows (``sparse=``), each piece and the whole, swept.
Each timed thing is one CUDA graph, replayed (median of CUDA-event timings). Correctness on the device:
the indexer's scores against the float32 formula, the list against torch's top-k of those scores, the
sparse attention against float32 attention over the listed rows.

Writes ``dsv32_attn_ctx128k_us`` (indexer + top-k + sparse attention), ``dsv32_dense_attn_ctx128k_us``,
their ratio, the pieces, and the bytes each reads. The whole step's roofline fraction with these pieces in
the MLA decoder (``dsv32_shape_ctx128k_frac_roofline``) is ``bench/decode_gpu.py --parts dsv32``'s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch
import triton

from decode_gpu import capture, load_cuda_pkg, log, time_graph  # bench/ is on sys.path when run as a script

V32 = dict(heads=128, r=512, rope=64, index_heads=64, index_dim=128, top_k=2048)


def run(ctx: int) -> dict:
    load_cuda_pkg()
    attention = importlib.import_module("xl_cuda.attention")
    dsa = importlib.import_module("xl_cuda.dsa")
    s = V32
    hq, r, rope, hi, di, k = s["heads"], s["r"], s["rope"], s["index_heads"], s["index_dim"], s["top_k"]
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    lat = torch.randn(ctx, 1, r + rope, device=dev, dtype=bf, generator=g)
    idx_k = torch.randn(ctx, di, device=dev, dtype=bf, generator=g)
    q_c = torch.randn(hq, 1, r, device=dev, dtype=bf, generator=g) * (r + rope) ** -0.25
    q_pe = torch.randn(1, hq, rope, device=dev, dtype=bf, generator=g) * (r + rope) ** -0.25
    q_i = torch.randn(hi, di, device=dev, dtype=bf, generator=g)
    w_i = torch.randn(hi, device=dev, generator=g) * hi ** -0.5
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device=dev)
    sm_scale = (r + rope) ** -0.5
    out = torch.empty(1, hq, r, device=dev, dtype=bf)
    res: dict = {"ctx": ctx, "shape": s, "device": torch.cuda.get_device_name()}

    def mla_attn(splits: int, block_s: int = 32):
        return attention.DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope,
                                         num_tokens=1, num_splits=splits, block_s=block_s, sm_scale=sm_scale,
                                         num_warps=4, v_chunks=r // 128, device=dev)

    def call(attn, sparse=None):
        return attn(q_c, lat, lat, pos, out, stride_kt=r + rope, stride_vt=r + rope, rope_offset=r, q_pe=q_pe,
                    stride_qt=r, stride_qh=r, sparse=sparse)

    # dense
    dense = {}
    for splits in (16, 32, 64, 128):  # powers of two (the merge kernel spans them)
        attn = mla_attn(splits)
        dense[splits] = time_graph(capture(lambda a=attn: call(a)), iters=30) * 1000
        log(f"dense MLA attention, {splits} splits: {dense[splits]:.1f} us")
    res["dense_us_by_splits"] = dense
    res["dsv32_dense_attn_ctx128k_us"] = min(dense.values())

    # sparse: selection, then attention over the list
    select_us, best = {}, None
    for block_t in (64, 128):
        for radix in (True, False):
            sel = dsa.SparseSelect(max_tokens=ctx, top_k=k, device=dev, block_t=block_t, radix=radix)
            scores_us = time_graph(capture(lambda x=sel: dsa.indexer_scores(q_i, w_i, idx_k, pos, x.scores,
                                                                            x.block_t)), iters=30) * 1000
            whole_us = time_graph(capture(lambda x=sel: x(q_i, w_i, idx_k, pos)), iters=30) * 1000
            name = f"block_t{block_t}_{'radix' if radix else 'torch_topk'}"
            select_us[name] = {"indexer_scores_us": scores_us, "select_us": whole_us,
                               "topk_us": whole_us - scores_us}
            log(f"indexer {name}: scores {scores_us:.1f} us, scores + top-k {whole_us:.1f} us")
            if best is None or whole_us < best[0]:
                best = (whole_us, sel, name)
    res["select"] = select_us
    res["select_best"] = best[2]
    sel = best[1]
    res["radix"] = radix_pieces(dsa, sel.scores, k, dev)
    # the whole with the best radix tile of the sweep (the select above used RadixTopK's default)
    tiles = {key: us for key, us in res["radix"].items() if key.startswith("whole_")}
    block, warps = (int(x) for x in min(tiles, key=tiles.get)[6:-4].split("x"))
    sel = dsa.SparseSelect(max_tokens=ctx, top_k=k, device=dev, block_t=128, radix=True)
    sel.radix = dsa.RadixTopK(sel.scores.numel(), k, dev, block=block, num_warps=warps)
    res["select_used"] = f"block_t128_radix_{block}x{warps}w"
    sel(q_i, w_i, idx_k, pos)
    torch.cuda.synchronize()
    sparse_attn = {}
    for splits in (4, 8, 16, 32):
        for block_s in (16, 32, 64):
            attn = mla_attn(splits, block_s)
            try:
                us = time_graph(capture(lambda a=attn: call(a, (sel.idx, sel.count))), iters=30) * 1000
            except Exception as exc:  # a tile that does not fit (shared memory): skipped, said so
                log(f"sparse MLA attention, {splits} splits of {block_s}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            sparse_attn[f"{splits}x{block_s}"] = us
            log(f"sparse MLA attention over {k} rows, {splits} splits of {block_s}-row blocks: {us:.1f} us")
    res["sparse_attn_us_by_splits_x_block"] = sparse_attn
    best = min(sparse_attn, key=sparse_attn.get)
    res["sparse_attn_best"] = best
    attn = mla_attn(*(int(x) for x in best.split("x")))

    def whole():
        idx, count = sel(q_i, w_i, idx_k, pos)
        call(attn, (idx, count))

    res["one_per_graph"] = {"sparse_us": time_graph(capture(whole), iters=30) * 1000,
                            "dense_us": res["dsv32_dense_attn_ctx128k_us"]}
    # the headline figures: 8 calls in one graph, per call (as a step's layers run, back to back): one call a
    # graph carries the graph launch's own ~15-18 us floor, which is not the attention's
    dense_attn = mla_attn(min(dense, key=dense.get))
    res["dsv32_dense_attn_ctx128k_us"] = time_graph(capture(lambda: call(dense_attn), steps_per_replay=8),
                                                    iters=30) * 1000 / 8
    res["dsv32_attn_ctx128k_us"] = time_graph(capture(whole, steps_per_replay=8), iters=30) * 1000 / 8
    res["dsv32_sparse_over_dense_speedup"] = res["dsv32_dense_attn_ctx128k_us"] / res["dsv32_attn_ctx128k_us"]
    log(f"one call a graph: sparse {res['one_per_graph']['sparse_us']:.1f} us, dense "
        f"{res['one_per_graph']['dense_us']:.1f} us ({res['one_per_graph']['dense_us'] / res['one_per_graph']['sparse_us']:.2f}x)")
    res["bytes"] = {"dense_latent": ctx * (r + rope) * 2, "indexer_keys": ctx * di * 2,
                    "sparse_latent": k * (r + rope) * 2}
    log(f"sparse (indexer + top-k + attention): {res['dsv32_attn_ctx128k_us']:.1f} us; dense "
        f"{res['dsv32_dense_attn_ctx128k_us']:.1f} us: {res['dsv32_sparse_over_dense_speedup']:.2f}x")

    # correctness (float32 references)
    whole()
    torch.cuda.synchronize()
    ref_scores = dsa.indexer_scores_reference(q_i, w_i, idx_k, ctx - 1)
    res["indexer_scores_max_rel_err"] = float(((sel.scores[:ctx] - ref_scores).abs().max()
                                               / ref_scores.abs().max()).item())
    ref_top = set(ref_scores.topk(k).indices.tolist())
    res["topk_overlap"] = len(ref_top & set(sel.idx.tolist())) / k
    rows = sel.idx.long().sort().values
    picked = lat[rows, 0].float()  # [k, r + rope]
    q = torch.cat([q_c[:, 0], q_pe[0]], -1).float()  # [Hq, r + rope]
    p = (q @ picked.T * sm_scale).softmax(-1)
    ref = p @ picked[:, :r]
    res["sparse_attn_max_abs_err"] = float((out[0].float() - ref).abs().max().item())
    res["sparse_attn_ref_max_abs"] = float(ref.abs().max().item())
    log(f"correctness: indexer rel err {res['indexer_scores_max_rel_err']:.2e}, top-k overlap "
        f"{res['topk_overlap']:.4f}, attention max abs err {res['sparse_attn_max_abs_err']:.2e} "
        f"(|ref| max {res['sparse_attn_ref_max_abs']:.2f})")
    return res


def radix_pieces(dsa, scores: torch.Tensor, k: int, dev) -> dict:
    """The radix top-k's launches timed one by one (each its own graph), and its tile swept."""
    out: dict = {}
    idx = torch.zeros(k, dtype=torch.int32, device=dev)
    for block, warps in ((2048, 8), (1024, 4), (512, 4), (512, 2), (256, 2)):
        top = dsa.RadixTopK(scores.numel(), k, dev, block=block, num_warps=warps)
        try:
            out[f"whole_{block}x{warps}w_us"] = time_graph(capture(lambda t=top: t(scores, idx)), iters=30) * 1000
        except Exception as exc:
            log(f"radix top-k {block} rows x {warps} warps: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        log(f"radix top-k, {block} rows a program, {warps} warps: {out[f'whole_{block}x{warps}w_us']:.1f} us")
    top = dsa.RadixTopK(scores.numel(), k, dev)
    top(scores, idx)  # a consistent state (the k-th key) for the pieces below
    grid = (triton.cdiv(top.n, top.block),)
    big = torch.zeros(top.n + 64 * k, dtype=torch.int32, device=dev)  # the list pass alone, replayed without
    # the scan that resets its counters, appends ~k rows a replay
    bits, hist = dsa.ROUND_BITS[0], top.hists[0]
    out["hist_round0_us"] = time_graph(capture(lambda: dsa._hist_kernel[grid](
        scores, top.st, hist, top.n, ROUND=0, BITS=bits, SHIFT=32 - bits, BLOCK=top.block,
        num_warps=top.num_warps)), iters=30) * 1000
    out["scan_us"] = time_graph(capture(lambda: dsa._scan_kernel[(1,)](
        top.st, hist, top.cnt, ROUND=0, BITS=bits, K=k, num_warps=top.num_warps)), iters=30) * 1000
    top(scores, idx)  # the pieces above left an inconsistent state: the k-th key again
    out["list_us"] = time_graph(capture(lambda: dsa._list_kernel[grid](
        scores, top.st, top.cnt, big, top.n, K=k, BLOCK=top.block, num_warps=top.num_warps)), iters=30) * 1000
    # the floor of this way of timing: one trivial kernel in a graph of its own
    out["empty_graph_kernel_us"] = time_graph(capture(lambda: top.cnt.add_(0)), iters=30) * 1000
    log(f"radix pieces: hist {out['hist_round0_us']:.1f} us, scan {out['scan_us']:.1f}, list {out['list_us']:.1f}, "
        f"a trivial kernel {out['empty_graph_kernel_us']:.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--out", default="decode_gpu_dsa.json")
    args = p.parse_args()
    t0 = time.time()
    res = run(args.ctx)
    res["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
