"""DeepSeek-V3-family shape on one GPU (DeepSeek-V2-Lite-like, random bf16 weights), for decode_gpu.py.

Plain greedy step vs MTP spec steps (k = 1, 2, 3 drafts + one verify, each one CUDA graph) at context
1K, with the full-vocabulary draft head and with a 32K-id draft vocabulary; tensor-core tile sweeps of
the 4-token verify GEMVs (the best become the run's defaults); graph-timed pieces and per-kernel
profiles of a step; roofline from the bytes a plain step reads (attention weights, the 6 routed experts it picks, the
shared experts, the dense layer, router, lm_head, KV); the same with every token routed to the same
experts (the verify reads no extra experts: what correlated routing would give); correctness: plain
fast path vs the torch reference (teacher-forced) and spec output == plain output. Several slots in one
step (MlaBatchDecoder, 2 / 4 / 8 rows at 1K each): step time over one slot's, and the roofline of the bytes
that step reads (the distinct routed experts its rows touch, every row's KV); ``MLA_BATCH_ONLY=1``: the
plain step and the batched ones alone.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback

import torch

from decode_gpu import capture  # bench/ is on sys.path when run as a script

DSV2_LITE = dict(hidden=2048, layers=27, heads=16, r=512, nope=128, rope=64, v=128, experts=64, top_k=6,
                 moe_inter=1408, shared=2, dense_inter=10944, vocab=102400, eps=1e-6, scale=1.0)
# DeepSeek-V3's layer shapes (q LoRA 1536, 256 experts top-8 in 8 groups of which 4 are kept, one shared
# expert, routed scale 2.5), cut to one dense and two MoE layers (+ the MoE MTP layer): each MoE layer holds
# 22.5 GB of experts, the full 61 layers need eight H200s
DSV3_CUT = dict(hidden=7168, layers=3, heads=128, r=512, nope=128, rope=64, v=128, experts=256, top_k=8,
                moe_inter=2048, shared=1, dense_inter=18432, vocab=129280, eps=1e-6, scale=2.5, q_lora=1536,
                n_group=8, topk_group=4)
# DeepSeek-V3.2: V3's layers plus sparse attention (a 64-head, 128-dim lightning indexer picking 2048 tokens)
DSV32_CUT = dict(DSV3_CUT, index_topk=2048, index_heads=64, index_dim=128)


def log(*a):
    print(*a, flush=True)


def build(X, s: dict, seed: int = 0, fp8: bool = False):
    """The model of shape ``s`` with random weights; ``fp8``: every projection DeepSeek-V3's FP8 checkpoints quantize
    (q/kv/o projections, experts, shared experts, the dense MLP, the MTP block) as block-scaled FP8 in 128 x 128
    blocks with activations rounded per block (fp8block.BlockFp8), kv_b (w_uk, w_uv), router, heads and eh_proj bf16."""
    M = X.mla
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    out_scale = (2 * s["layers"]) ** -0.5

    def wb(*shape, sc=1.0):  # scaled in place: a V3 layer's experts are 22.5 GB, a scaled copy would not fit
        return torch.randn(*shape, device="cuda", dtype=bf, generator=g).mul_(sc * shape[-1] ** -0.5)

    def wq(*shape, sc=1.0):  # a quantized projection: bf16 drawn and quantized a few experts at a time
        if not fp8:
            return wb(*shape, sc=sc)
        BlockFp8, quantize = X.fp8block.BlockFp8, X.fp8block.quantize  # the package the bench loaded (decode_gpu.py)
        if len(shape) == 2:
            return quantize(wb(*shape, sc=sc))
        e, n, k = shape
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(e, -(-n // 128), -(-k // 128), dtype=torch.float32, device="cuda")
        for a in range(0, e, 16):
            q = quantize(wb(min(16, e - a), n, k, sc=sc))
            out[a:a + q.w.shape[0]], scale[a:a + q.w.shape[0]] = q.w, q.scale
            del q
        return BlockFp8(out, scale, 128, 128, True)

    w = wb

    def nw(n):
        return (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(bf)

    h, nh, r, nope, rope, v = s["hidden"], s["heads"], s["r"], s["nope"], s["rope"], s["v"]
    e, i, sh = s["experts"], s["moe_inter"], s["shared"]
    ql = s.get("q_lora", 0)

    ih, idim = s.get("index_heads", 0), s.get("index_dim", 0)

    def layer(idx):
        p = dict(attn_norm=nw(h), wkv_a=wq(r + rope, h), kv_a_norm=nw(r),
                 w_uk=w(nh, nope, r), w_uv=w(nh, v, r), wo=wq(h, nh * v, sc=out_scale), mlp_norm=nw(h))
        if ih:  # sparse attention's indexer
            p.update(idx_wq_b=w(ih * idim, ql), idx_wk=w(idim, h), idx_k_norm=nw(idim),
                     idx_k_norm_bias=(0.1 * torch.randn(idim, device="cuda", generator=g)).to(bf),
                     idx_weights=w(ih, h))
        if ql:
            p.update(wq_a=wq(ql, h), q_a_norm=nw(ql), wq_b=wq(nh * (nope + rope), ql))
        else:
            p["wq"] = wq(nh * (nope + rope), h)
        if idx == 0:
            p.update(w_gate_up=wq(2 * s["dense_inter"], h), w_down=wq(h, s["dense_inter"], sc=out_scale))
        else:
            p.update(router=w(e, h), router_bias=torch.zeros(e, device="cuda"), experts_gate_up=wq(e, 2 * i, h),
                     experts_down=wq(e, h, i, sc=out_scale), shared_gate_up=wq(2 * sh * i, h),
                     shared_down=wq(h, sh * i, sc=out_scale))
        return M.prepare_layer(p, i, sparse=bool(ih))

    dims = M.MlaDims(h, nh, r, nope, rope, v, e, s["top_k"], i, sh, s["scale"], s["eps"], (nope + rope) ** -0.5,
                     q_lora_rank=ql, n_group=s.get("n_group", 1), topk_group=s.get("topk_group", 1),
                     index_topk=s.get("index_topk", 0), index_heads=ih, index_dim=idim)
    layers = [layer(k) for k in range(s["layers"])]
    embed = torch.randn(s["vocab"], h, device="cuda", dtype=bf, generator=g)
    mtp = M.MtpWeights(nw(h), nw(h), w(h, 2 * h), nw(h), w(s["vocab"], h), embed, layer(1))
    return X.mla_decoder.MlaModel(dims, layers, embed, nw(h), w(s["vocab"], h), mtp, s["dense_inter"])


def nbytes(x) -> int:
    """Bytes a step reads of a weight: bf16 elements, or block-scaled FP8 bytes with their float32 scales."""
    if x is None:
        return 0
    return x.nbytes() if hasattr(x, "scale") else x.numel() * x.element_size()


def step_bytes(model, s: dict, ctx: int) -> dict:
    """Bytes one plain step must read, by part (FP8 weights at a byte an element plus their scales)."""
    L, b = model.layers, 2

    def attn_of(l):  # q LoRA's second projection is absent without q LoRA
        return nbytes(l.wqkv_a) + nbytes(l.wq_b) + nbytes(l.w_uk) + nbytes(l.w_uv_t) + nbytes(l.wo)

    attn = sum(attn_of(l) for l in L)
    moe = [l for l in L if l.is_moe]
    per_expert = (nbytes(moe[0].gate_up) + nbytes(moe[0].down)) // s["experts"]
    routed = len(moe) * s["top_k"] * per_expert
    shared = sum(nbytes(l.shared_gate_up) + nbytes(l.shared_down) for l in moe)
    dense = sum(nbytes(l.gate_up) + nbytes(l.down) for l in L if not l.is_moe)
    router = sum(nbytes(l.router) for l in moe)
    lm_head = nbytes(model.lm_head)
    kv = s["layers"] * ctx * (s["r"] + s["rope"]) * b
    mt = model.mtp
    draft = nbytes(mt.eh_proj) + attn_of(mt.layer) + nbytes(mt.layer.router) + s["top_k"] * per_expert \
        + nbytes(mt.layer.shared_gate_up) + nbytes(mt.layer.shared_down) + nbytes(mt.head) + ctx * (s["r"] + s["rope"]) * b
    total = attn + routed + shared + dense + router + lm_head + kv
    return {"attention": attn, "routed_experts": routed, "shared_experts": shared, "dense_mlp": dense,
            "router": router, "lm_head": lm_head, "kv": kv, "total": total, "mtp_draft": draft}


def latent_setup(s: dict, ctx: int):
    """(random latent caches of ctx + 1024 rows for every layer and the MTP layer, rope cos, sin) of shape ``s``."""
    mt = ctx + 1024
    caches = [torch.randn(mt, s["r"] + s["rope"], device="cuda").to(torch.bfloat16) for _ in range(s["layers"] + 1)]
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    return caches, fr.cos(), fr.sin()


def shape_setup(X, s: dict, ctx: int, R: dict, tag: str, what: str, fp8: bool = False):
    """(model, latent caches, cos, sin, step bytes, copy TB/s, roofline ms) of shape ``s`` at ``ctx``, built (``fp8``:
    block-scaled) and logged, its bytes and roofline recorded under ``tag``."""
    t0 = time.time()
    model = build(X, s, fp8=fp8)
    log(f"{what} built in {time.time() - t0:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    caches, cos, sin = latent_setup(s, ctx)
    by = step_bytes(model, s, ctx)
    R[f"{tag}step_bytes"] = by
    bw = R.get("copy_bw_TBps", 4.2)
    roof_ms = by["total"] / (bw * 1e12) * 1e3
    R[f"{tag}roofline_tok_s"] = 1e3 / roof_ms
    return model, caches, cos, sin, by, bw, roof_ms


def time_replays(runner, iters: int) -> float:
    for _ in range(3):
        runner()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def time_plain_step(dec, ctx: int, iters: int = 20):
    """(ms of one plain step, the graph runner): four steps a replay from token 1 at ``ctx``, median of
    ``iters`` replays; the decoder is left at (1, ctx) for the caller's own replays."""
    runner = capture(dec.plain_step, steps_per_replay=4, before_capture=lambda: dec.set_state(1, ctx))
    dec.set_state(1, ctx)
    return time_replays(runner, iters) / 4, runner


DRAFT_VOCAB = 32768  # reduced draft head: the first 32K ids (a third of the 102K vocabulary)


def measure(X, model, caches, cos, sin, ctx: int, tag: str, R: dict, draft_vocab: int | None = None) -> None:
    dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096, draft_vocab=draft_vocab)
    plain_ms, plain = time_plain_step(dec, ctx, 30)
    R[f"{tag}plain_ms"] = plain_ms
    R[f"{tag}tok_s"] = 1e3 / plain_ms
    log(f"  {tag}plain step {plain_ms:.3f} ms ({1e3 / plain_ms:.1f} tok/s)")
    del plain
    for k in (1, 2, 3):
        sp = capture(lambda k=k: dec.spec_step(k), before_capture=lambda: dec.set_state(1, ctx))
        dec.set_state(1, ctx)
        ms = time_replays(sp, 30)
        R[f"{tag}mtp_k{k}_step_ms"] = ms
        R[f"{tag}mtp_k{k}_step_ratio"] = ms / plain_ms
        log(f"  {tag}MTP k={k}: {ms:.3f} ms = {ms / plain_ms:.2f}x plain; at acceptance length 3.2 (k=3): "
            f"{3.2 / (ms / plain_ms):.2f}x plain tok/s" if k == 3 else f"  {tag}MTP k={k}: {ms:.3f} ms = {ms / plain_ms:.2f}x plain")
        del sp
    del dec


def kernel_rows(prof, calls: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches a call, us a call) of a torch profiler over ``calls`` calls, slowest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:70], e.count // calls, round(t / calls, 1)))
    return sorted(rows, key=lambda r: -r[2])


def breakdown(X, model, caches, cos, sin, ctx: int, tag: str, R: dict, draft_vocab: int | None = None) -> None:
    """Graph-timed pieces of a spec step (main forward over 1/2/4 tokens, one block, one draft, the heads)
    and the per-kernel device time of one eager spec_step(3) (torch profiler)."""
    D = X.mla_decoder
    dec = D.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096, draft_vocab=draft_vocab)
    st = lambda: dec.set_state(1, ctx)  # noqa: E731
    pieces = {f"forward{t}": (lambda t=t: dec.forward(t)) for t in (1, 2, 4)}
    for t in (1, 4):
        pieces[f"moe_block{t}"] = lambda t=t: dec.stacks[t].block(model.layers[1], dec.residual[t], caches[1],
                                                                  dec.pos, dec.cos, dec.sin)
        pieces[f"lm_head{t}"] = lambda t=t: X.moe.gemv_rows(dec.hid[t], model.lm_head, dec.logits[t], block_n=16,
                                                            block_k=256)
    pieces["mtp_draft"] = lambda: dec.mtp_draft(0)
    pieces["forward4_fma_projections"] = lambda: (setattr(X.mla.MlaStack, "PROJ_DOT", False), dec.forward(4),
                                                  setattr(X.mla.MlaStack, "PROJ_DOT", True))
    pieces["draft_head"] = lambda: X.moe.gemv_rows(dec.mtp_hidden, dec.draft_head, dec.mtp_logits, block_n=16,
                                                   block_k=256)
    out = {}
    for name, fn in pieces.items():
        try:
            r = capture(fn, before_capture=st)
            st()
            out[name] = round(time_replays(r, 20) * 1e3, 1)
            del r
        except Exception:
            out[name] = traceback.format_exc()[-300:]
    R[f"{tag}pieces_us"] = out
    log(f"  {tag}pieces (us): {out}")
    try:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in (("spec3", lambda: dec.spec_step(3)), ("plain", dec.plain_step),
                         ("forward4", lambda: dec.forward(4)), ("forward1", lambda: dec.forward(1)),
                         ("draft", lambda: dec.mtp_draft(0))):
            st()
            fn()
            torch.cuda.synchronize()
            st()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            rows = kernel_rows(prof, 3)
            R[f"{tag}profile_{name}"] = rows[:25]
            log(f"  {tag}profile {name}: total {sum(r[2] for r in rows):.0f} us in {sum(r[1] for r in rows)} "
                f"kernels; top: " + "; ".join(f"{n} x{c} {t}us" for n, c, t in rows[:14]))
    except Exception:
        log(traceback.format_exc()[-800:])
    del dec


DOT_TILE_CANDIDATES = [((16, 128, 4, 4), (16, 128, 4, 4)), ((16, 256, 4, 4), (16, 256, 4, 4)),
                       ((32, 128, 4, 4), (32, 128, 4, 4)), ((16, 64, 4, 6), (16, 64, 4, 6)),
                       ((16, 128, 4, 6), (32, 128, 4, 4)), ((32, 256, 8, 3), (32, 256, 8, 3))]


GEMV_DOT_CANDIDATES = [(16, 256, 4, 4), (16, 128, 4, 4), (32, 128, 4, 4), (16, 512, 4, 3), (32, 256, 8, 3),
                       (16, 128, 2, 6), (16, 64, 2, 8)]


def gemv_dot_sweep(X, model, caches, cos, sin, ctx: int, R: dict) -> None:
    """The verify's attention projections and lm_head on tensor cores: a 4-token block (wqkv_a, wo) and the
    4-token lm_head per tile candidate; the best of each becomes the default."""
    D, M, A = X.mla_decoder, X.moe, X.mla
    dec = D.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096)
    st = lambda: dec.set_state(1, ctx)  # noqa: E731
    res: dict = {"block4": {}, "lm_head4": {}}
    for cand in GEMV_DOT_CANDIDATES:
        for name, fn in (("block4", lambda c=cand: (setattr(A.MlaStack, "DOT_TILE", c),
                                                     dec.stacks[4].block(model.layers[1], dec.residual[4], caches[1],
                                                                         dec.pos, dec.cos, dec.sin))),
                         ("lm_head4", lambda c=cand: M.gemv_rows(dec.hid[4], model.lm_head, dec.logits[4], dot_tile=c))):
            try:
                r = capture(fn, before_capture=st)
                st()
                res[name][str(cand)] = round(time_replays(r, 20) * 1e3, 1)
                del r
            except Exception as e:
                res[name][str(cand)] = repr(e)[:200]
    for name, attr in (("block4", (A.MlaStack, "DOT_TILE")), ("lm_head4", (D.MlaDecoder, "LM_HEAD_DOT_TILE"))):
        ok = {k: v for k, v in res[name].items() if isinstance(v, float)}
        if ok:
            best = min(ok, key=ok.get)
            setattr(*attr, next(c for c in GEMV_DOT_CANDIDATES if str(c) == best))
            R[f"dsv2lite_gemv_dot_best_{name}"] = best
    R["dsv2lite_gemv_dot_sweep_us"] = res
    log(f"  4-token GEMVs per tensor-core tile (us): {res}")
    del dec


def dot_tile_sweep(X, model, caches, cos, sin, ctx: int, R: dict) -> None:
    """One 4-token MoE block (random routing) per tensor-core tile candidate; the best becomes the default."""
    D, M = X.mla_decoder, X.moe
    dec = D.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096)
    st = lambda: dec.set_state(1, ctx)  # noqa: E731
    res = {}
    for cand in DOT_TILE_CANDIDATES:
        try:
            dec.stacks[4].moe.tiles = cand
            r = capture(lambda: dec.stacks[4].block(model.layers[1], dec.residual[4], caches[1], dec.pos, dec.cos,
                                                    dec.sin), before_capture=st)
            st()
            res[str(cand)] = round(time_replays(r, 20) * 1e3, 1)
            del r
        except Exception as e:
            res[str(cand)] = repr(e)[:200]
    ok = {k: v for k, v in res.items() if isinstance(v, float)}
    if ok:
        best = min(ok, key=ok.get)
        M.GroupedMoe.DOT_TILES = next(c for c in DOT_TILE_CANDIDATES if str(c) == best)
        R["dsv2lite_dot_tiles_best"] = best
    R["dsv2lite_dot_tile_sweep_us"] = res
    log(f"  4-token MoE block per tensor-core tile (us): {res}")
    del dec


def correctness(X, model, caches, cos, sin, ctx: int, steps: int = 48, kv_scales: list | None = None) -> dict:
    """Teacher-forced plain steps against the torch twins (``kv_scales``: uint8 caches hold an FP8 latent), then
    MTP k = 3 output against the plain output."""
    D = X.mla_decoder
    ref_caches = [c.clone() for c in caches]
    dec = D.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096, kv_scales=kv_scales)
    plain = capture(dec.plain_step, before_capture=lambda: dec.set_state(5, ctx))
    dec.set_state(5, ctx)
    tok, mism, max_rel, gaps = 5, 0, 0.0, []
    cb, sb = cos.cuda(), sin.cuda()
    for i in range(steps):
        plain()
        ref, _ = D.reference_forward(model, ref_caches, cb, sb, [tok], ctx + i, kv_scales)
        max_rel = max(max_rel, ((dec.logits[1][0] - ref[0]).abs().max() / ref.abs().max()).item())
        ft = int(dec.tokens[0].item())
        if ft != int(ref[0].argmax().item()):
            mism += 1
            top2 = ref[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        tok = ft
    plain_tokens = dec.out_tokens[:steps].tolist()
    sp = capture(lambda: dec.spec_step(3), before_capture=lambda: dec.set_state(5, ctx))
    dec.set_state(5, ctx)
    replays = 0
    while int(dec.out_idx.item()) < steps:
        sp()
        replays += 1
    spec_tokens = dec.out_tokens[:steps].tolist()
    same = next((i for i, (a, b) in enumerate(zip(spec_tokens, plain_tokens)) if a != b), steps)
    return {"spec_identical_prefix": same, "steps": steps, "plain_vs_reference_mismatches": mism, "mismatch_gaps": gaps[:5],
            "logits_max_rel_err": max_rel, "spec_equals_plain": spec_tokens == plain_tokens,
            "spec_replays": replays, "accepted_drafts": int(dec.accepted.item())}


MOE_GATE_UP_TILES = [(8, 512, 4, 3), (8, 256, 4, 4), (4, 256, 4, 4), (4, 512, 4, 4), (16, 256, 4, 4),
                     (16, 128, 4, 6), (8, 128, 4, 6), (8, 256, 4, 6), (4, 256, 2, 4), (16, 512, 8, 3)]
PROJ_TILES = [(8, 256, 4, 4), (16, 256, 4, 4), (4, 512, 4, 4), (8, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 3),
              (4, 256, 4, 6),
              # a row block's whole K in one tile (V2-Lite's K = 2048): on PDL all of a program's weight loads are
              # issued before its wait, while the kernel before it (the merge + w_uv, the previous layer's down) runs
              (2, 2048, 4, 1), (4, 2048, 4, 1), (8, 2048, 8, 1), (4, 1024, 4, 2)]
DOWN_ROWS_TILES = [(4, 4, 3), (2, 4, 3), (4, 4, 2), (4, 4, 4), (2, 4, 4), (8, 4, 3)]  # GroupedMoe.DOWN_ROWS_TILE


def plain_tile_sweep(X, model, caches, cos, sin, ctx: int, R: dict, tag: str = "dsv2lite_") -> None:
    """The one-token step's tiles, greedily one group at a time (each group's best kept for the next):
    the routed/shared experts' gate/up and down GEMVs, the attention's split count, the attention
    projections (wqkv_a, wo; wq_b with q LoRA). Plain step ms (graph-timed) per candidate under
    ``{tag}plain_tile_sweep``; the best whole as ``{tag}plain_ms_tuned``."""
    S = R[f"{tag}plain_tile_sweep"] = {}
    product = {"gate_up": X.moe.GroupedMoe.PLAIN_TILES[0], "down_rows": X.moe.GroupedMoe.DOWN_ROWS_TILE,
               # (splits, fewest rows a split, value chunks) of the one-token few-heads form: twice the decoder's 16
               "attn": (32, X.mla.MlaStack.FEW_ROWS_ATTN[3], X.mla.MlaStack.FEW_ROWS_ATTN[0]),
               **X.mla.MlaStack.PLAIN_TILES}
    best = dict(product)

    def time_cfg(cfg) -> float:
        splits, min_rows, chunks = cfg["attn"]  # the split count, the fewest latent rows a split takes, value chunks
        st_cls = X.mla.MlaStack
        keep, st_cls.FEW_ROWS_ATTN = st_cls.FEW_ROWS_ATTN, (chunks, 32, 4, min_rows)
        try:  # the one-token stack takes twice the slot's splits
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096,
                                           num_splits=splits // 2)
        finally:
            st_cls.FEW_ROWS_ATTN = keep
        st = dec.stacks[1]
        st.moe.tiles = (cfg["gate_up"], st.moe.tiles[1])
        st.moe.DOWN_ROWS_TILE = cfg["down_rows"]
        st.tiles = {k: cfg[k] for k in ("wqkv_a", "wo", "wq_b")}
        ms, runner = time_plain_step(dec, ctx)
        del runner, dec
        return ms

    base = time_cfg(best)
    S["default"] = base
    log(f"  {tag}plain tiles: product default {base * 1e3:.1f} us")
    groups = [("gate_up", MOE_GATE_UP_TILES), ("down_rows", DOWN_ROWS_TILES),
              ("attn", [(16, 64, 4), (32, 32, 2), (32, 32, 4), (16, 64, 2), (64, 16, 2)]),
              ("wqkv_a", PROJ_TILES), ("wo", PROJ_TILES)]
    if model.layers[-1].wq_b is not None:
        groups.append(("wq_b", PROJ_TILES))
    for name, cands in groups:
        res = {}
        for c in cands:
            try:
                res[str(c)] = time_cfg(dict(best, **{name: c}))
            except Exception as exc:  # a tile that does not compile or fit
                res[str(c)] = f"failed: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
        ok = {k: v for k, v in res.items() if isinstance(v, float)}
        pick = min(ok, key=ok.get)
        best[name] = next(c for c in cands if str(c) == pick)
        S[name] = res
        log(f"  {tag}{name}: best {pick} {ok[pick] * 1e3:.1f} us ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ok.items()) + ")")
    tuned = time_cfg(best)
    R[f"{tag}plain_ms_tuned"], R[f"{tag}plain_tiles_tuned"] = tuned, {k: list(v) if isinstance(v, tuple) else v
                                                                      for k, v in best.items()}
    R[f"{tag}plain_ms_default_same_run"] = time_cfg(product)
    log(f"  {tag}tuned {tuned * 1e3:.1f} us against the default's {R[f'{tag}plain_ms_default_same_run'] * 1e3:.1f} "
        f"(same run): {best}")


FUSED_VARIANTS = {  # (the merge + o . w_uv fused, its (value columns, latent chunk, warps), norm + router + top-k fused)
    "unfused": (False, None, False), "fused": (True, None, True), "uv_only": (True, None, False),
    "router_only": (False, None, True), "uv_four_chunks": (True, (32, 128, 4), True),
}


ONE_TOKEN_VARIANTS = {  # name -> what the run sets: ("mod.Class", attr) class attributes, ("mod", attr) module
    # attributes, ("decoder", kwarg) MlaDecoder arguments; the product's defaults first (MLA_SHARED_AB)
    "product": {},
    "shared_in_experts": {("mla.MlaStack", "SHARED_IN_ROUTER"): False},
    "down_by_pairs": {("moe.GroupedMoe", "DOWN_ROWS_TILE"): None},
}
# run G21 also timed the first shared expert in the experts' launch and the second beside the router, with and without
# the experts' launch asking L2 for its weights before its wait: +47..+63 us (V2-Lite), +6..+7 (V3 cut); G22-G23 the
# prep + absorb launch's last programs asking L2 for wo's, the router's and the shared experts' weights (2-40 MB; bulk
# prefetches of 4 KB-1 MB, or one a 128-byte line): +24..+830 us, no gain from the bytes (2 MB as slow as 24 MB)
# G28 the shared experts' down projections in the routed gate/up launch (its last row of programs, the rows kernel's
# tiles; bit-equal), the rows kernel then walking the routed pairs only: +10..+53 us (V2-Lite), -5 (V3 cut)
# run G17 also timed the router-launch shared experts in (4|16, 512, 3), (8, 256, 4), (8, 1024, 2) tiles: +24..+58 us;
# G20 the rows kernel's pairs unrolled, each tile loaded one pair ahead: +20..+184 us (V2-Lite)
# G40 the router's launch, the routed gate/up and the down kernel synchronised by flags (the top-k's program flagging
# the ids, the act rows counted; each launch triggering its dependents once past its own wait) instead of each
# waiting for the previous grid's end: +54..+61 us (V2-Lite), neutral (V3 cut); with the router's launch waiting on
# wo's counted programs too +77; a nanosleep of 100 / 500 ns between a waiting program's reads +49..+51
ATTN_VARIANTS = {  # the one-token attention's forms (MLA_ATTN_AB). Run G13 also timed one program a split (value
    # chunks 1) at 16, 32 and 64 splits, 16-row key blocks and 8 warps; G14-G18 the merge + w_uv in 16 / 64 value
    # columns, q . w_uk in 32 / 128 latent columns, 32 splits in 4 chunks and in 2 on 8 warps: all slower
    "product": {},
    "splits16_min64_vc4": {("mla.MlaStack", "FEW_ROWS_ATTN"): None},  # the product before run G14
    "pos_row_in_loop": {("mla.MlaStack", "POS_ROW_LAST"): False},  # row pos read by the splits' loops (G18's before)
    "prep_absorb_two_launches": {("mla.MlaStack", "PREP_ABSORB_ONE_LAUNCH"): False},
    "g17_form": {("mla.MlaStack", "POS_ROW_LAST"): False, ("mla.MlaStack", "PREP_ABSORB_ONE_LAUNCH"): False},
}  # runs G16 / G19 also timed the split kernel on 1 and 2 pipeline stages (Triton's default 3): +120 / +164 us; each
# split's first key block loaded before the PDL wait: no gain (V2-Lite 2399-2438 against 2408 us)


def one_token_variants_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str, roof_ms: float,
                          variants: dict | None = None, key: str = "one_token_variants") -> None:
    """The plain step on the product's defaults and on ``variants`` (ONE_TOKEN_VARIANTS: the shared experts'
    gate/up in the experts' launch, the down projections by pairs, the attention's splits), alternated three
    times in one process (best of each), with the greedy tokens of each (``{tag}{key}``)."""
    variants = variants or ONE_TOKEN_VARIANTS
    out: dict = {k: [] for k in variants}
    toks = {}
    for _ in range(3):
        for name, attrs in variants.items():
            keep, kwargs = {}, {}
            try:
                for (mod, attr), v in attrs.items():
                    if mod == "decoder":
                        kwargs[attr] = v
                        continue
                    m, _, c = mod.partition(".")
                    owner = getattr(getattr(X, m), c) if c else getattr(X, m)
                    keep[(owner, attr)] = getattr(owner, attr)
                    setattr(owner, attr, v)
                dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096, **kwargs)
                ms, runner = time_plain_step(dec, ctx)
                out[name].append(ms)
                toks[name] = dec.out_tokens[:8].tolist()
                del runner, dec
            except Exception as exc:  # a tile that does not compile
                out[name].append(float("inf"))
                toks[name] = repr(exc)[:200]
            finally:
                for (owner, attr), v in keep.items():
                    setattr(owner, attr, v)
    best = {k: min(v) for k, v in out.items()}
    R[f"{tag}{key}"] = {"ms": out, "best_ms": best,
                        "frac_roofline": {k: roof_ms / v for k, v in best.items()}, "tokens": toks}
    log(f"  {tag}{key} (best of 3, us; roofline {roof_ms * 1e3:.1f}): "
        + ", ".join(f"{k} {v * 1e3:.1f} ({roof_ms / v:.3f})" for k, v in best.items())
        + f"; tokens equal {len({str(t) for t in toks.values()}) == 1}")


def fused_middle_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str, variants=None) -> None:
    """The one-token step with the attention's merge + o . w_uv and the MLP norm + router + top-k fused or not
    (FUSED_VARIANTS), alternated
    twice in one process (``{tag}fused_middle``: plain step ms of each, best of the two)."""
    out = {k: [] for k in (variants or ("fused", "unfused"))}
    for _ in range(2):
        for name in out:
            uv, tile, rt = FUSED_VARIANTS[name]
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096)
            st = dec.stacks[1]
            st.fused_uv, st.fused_router = uv, rt
            st.uv_tile = tile or st.uv_tile
            ms, runner = time_plain_step(dec, ctx)
            out[name].append(ms)
            del runner, dec
    R[f"{tag}fused_middle"] = res = {k: min(v) for k, v in out.items()}
    log(f"  {tag}plain step by attention-middle variant: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in res.items()))


# (MlaStack.PDL, PDL_EARLY, ABSORB_KERNEL): the product's default first
PDL_VARIANTS = {"pdl_early": (True, True, True), "pdl_early_bmm": (True, True, False), "pdl": (True, False, True),
                "no_pdl": (False, False, True), "no_pdl_bmm": (False, False, False)}


@contextlib.contextmanager
def holding(X, attrs: dict):
    """MlaStack's class attributes ``attrs`` set while the block runs (those read when a step is captured or
    launched, DOT_TILE, as well as those read when a stack is made), the previous values back afterwards."""
    st = X.mla.MlaStack
    saved = {k: getattr(st, k) for k in attrs}
    for k, v in attrs.items():
        setattr(st, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(st, k, v)


def built_with(X, attrs: dict, build):
    """``build()`` with MlaStack's class attributes ``attrs`` set while it runs (its stacks read them when they
    are made), the previous values back afterwards."""
    with holding(X, attrs):
        return build()


def pdl_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str, rounds: int = 3) -> None:
    """The one-token step with the block's kernels on programmatic dependent launch (MlaStack.PDL, the default
    on sm_90) with and without their first weight tiles before the wait (MlaStack.PDL_EARLY), and without
    PDL, each with q_nope . w_uk by the absorb kernel or cuBLAS's bmm (PDL_VARIANTS), alternated ``rounds`` times in one process (``{tag}pdl_ab``: plain step ms of each, best of the
    rounds; ``{tag}pdl_tokens_equal``: all give the same greedy tokens)."""
    out, toks = {k: [] for k in PDL_VARIANTS}, {}
    for _ in range(rounds):
        for name, (pdl, early, absorb) in PDL_VARIANTS.items():
            dec = built_with(X, dict(PDL=pdl, PDL_EARLY=early, ABSORB_KERNEL=absorb),
                             lambda: X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096))
            ms, runner = time_plain_step(dec, ctx)
            out[name].append(ms)
            dec.set_state(1, ctx)
            for _ in range(8):
                runner()
            torch.cuda.synchronize()
            toks[name] = dec.out_tokens[:32].tolist()
            del runner, dec
    R[f"{tag}pdl_ab"] = res = {k: min(v) for k, v in out.items()}
    # PDL only reorders launches: tokens equal among the variants of one q . w_uk form (the two forms round
    # differently, and random weights turn an ulp into another greedy token after a few steps)
    R[f"{tag}pdl_tokens_equal"] = equal = all(toks[k] == toks["no_pdl" if v[2] else "no_pdl_bmm"]
                                              for k, v in PDL_VARIANTS.items())
    log(f"  {tag}plain step: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in res.items()) + f"; tokens equal {equal}")


# the one-token tiles before run T2 (T1's): experts' down and wo, against the product's
T1_TILES = {"down": (32, 256, 4, 3), "wo": (8, 256, 4, 4)}
T2_TILES = {"down": (8, 512, 4, 3), "wo": (4, 512, 4, 4)}  # run T2's, the narrow shapes' defaults


def tiles_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str, rounds: int = 3) -> None:
    """The one-token step on the product's tiles (T2's below GroupedMoe.WIDE_HIDDEN, T1's down and wo from it)
    and on T1_TILES and T2_TILES, alternated in one process (``{tag}tiles_ab``: plain step ms, best of
    ``rounds``)."""
    out = {"product": [], "t1": [], "t2": []}
    for _ in range(rounds):
        for name in out:
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096)
            tiles = {"t1": T1_TILES, "t2": T2_TILES}.get(name)
            for st in ([dec.stacks[1]] if tiles else []):  # the one-token stack
                st.moe.tiles = (st.moe.tiles[0], tiles["down"])
                st.tiles = dict(st.tiles, wo=tiles["wo"])
            ms, runner = time_plain_step(dec, ctx)
            out[name].append(ms)
            del runner, dec
    R[f"{tag}tiles_ab"] = res = {k: min(v) for k, v in out.items()}
    log(f"  {tag}plain step by tiles: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in res.items()))


def verify_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str, rounds: int = 3) -> None:
    """The MTP spec steps (k = 1..3) with the verify's T-row block in its default form and as one PDL chain of
    Triton kernels (``MlaStack.VERIFY_CHAIN``), alternated ``rounds`` times, best of the rounds:
    ``{tag}verify_ab`` = {form: {k: ms}} and each form's k-step over its own plain step
    (``{tag}verify_ab_ratio``); ``{tag}verify_ab_tokens_equal``: the spec steps' tokens of both forms equal."""
    forms = {"bmm": {"VERIFY_CHAIN": False}, "chain": {"VERIFY_CHAIN": True}}
    times = {f: {k: [] for k in (0, 1, 2, 3)} for f in forms}
    tokens = {}
    for _ in range(rounds):
        for name, attrs in forms.items():
            dec = built_with(X, attrs, lambda: X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=3,
                                                                         max_steps=4096))
            ms, plain = time_plain_step(dec, ctx, 30)
            times[name][0].append(ms)
            del plain
            for k in (1, 2, 3):
                sp = capture(lambda k=k: dec.spec_step(k), before_capture=lambda: dec.set_state(1, ctx))
                dec.set_state(1, ctx)
                times[name][k].append(time_replays(sp, 30))
                if k == 3:
                    dec.set_state(1, ctx)
                    for _ in range(4):
                        sp()
                    torch.cuda.synchronize()
                    tokens[name] = dec.out_tokens[:16].tolist() if hasattr(dec, "out_tokens") else None
                del sp
            del dec
            torch.cuda.empty_cache()
    R[f"{tag}verify_ab"] = res = {f: {k: min(v) for k, v in t.items()} for f, t in times.items()}
    R[f"{tag}verify_ab_ratio"] = {f: {k: r[k] / r[0] for k in (1, 2, 3)} for f, r in res.items()}
    R[f"{tag}verify_ab_tokens_equal"] = tokens.get("bmm") == tokens.get("chain")
    for f, r in res.items():
        log(f"  {tag}verify {f}: plain {r[0]:.3f} ms, " + ", ".join(f"k={k} {r[k]:.3f} ms ({r[k] / r[0]:.2f}x)"
                                                                   for k in (1, 2, 3)))
    log(f"  {tag}verify forms' tokens equal: {R[f'{tag}verify_ab_tokens_equal']}")


# the batched block's forms (MLA_BATCH_AB): MlaStack attributes over the product's ("product": the chain of Triton
# kernels on PDL); "bmm": norms + dots + cuBLAS bmms (run MB3's form). Run G15 also timed the one-token stack's
# few-rows attention form for the batch's rows: 4 slots 5.124 against 5.026 ms, 8 slots 7.575 against 7.525
BATCH_VARIANTS = {"product": {}, "bmm": {"BATCH_CHAIN": False},
                  # the latent prep and the absorb in two launches (the form before run G53)
                  "prep_absorb_two_launches": {"PREP_ABSORB_ROWS": False},
                  # the attention's norm written by the MoE reduce, not a launch of its own (run G54: slower)
                  "norm_in_reduce": {"NORM_IN_REDUCE": True},
                  # the attention projections' tensor-core tile that G52 timed best on the H100 (-0.6% at 4 slots)
                  "proj_16x128_w2_s6": {"DOT_TILE": (16, 128, 2, 6)},
                  # the MLP's norm, router GEMV and top-k in three launches (G50-G51: -1% at 4 slots, last in order)
                  "router_3_launches": {"FUSED_ROUTER": False}}


def batch_measure(X, model, s: dict, ctx: int, R: dict, tag: str = "dsv2lite_", sizes=(2, 4, 8),
                  variants=("product",), rounds: int = 1) -> None:
    """Several slots in one step (MlaBatchDecoder), each row at ``ctx`` in its own slot: step time against one
    slot's plain step (``{tag}plain_ms``, measured before in the same run), and its roofline: the step's bytes
    with the routed experts the rows actually touch (distinct experts per MoE layer, counted in an eager step
    before the timed ones) and every row's own KV. ``variants`` (BATCH_VARIANTS' names, the first one the
    published keys'), alternated ``rounds`` times, best of the rounds: ``{tag}batch{b}_variants`` (ms) and
    ``{tag}batch{b}_variants_tokens_equal`` (the chain forms' greedy tokens over 8 steps equal)."""
    n_layers, dev = len(model.layers), "cuda"
    mt = ctx + 1024
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = fr.cos(), fr.sin()
    by = step_bytes(model, s, ctx)
    bw = R.get("copy_bw_TBps", 4.2)
    per_expert = 3 * s["hidden"] * s["moe_inter"] * 2
    for b in sizes:
        caches = [torch.randn(b + 1, mt, s["r"] + s["rope"], device=dev).to(torch.bfloat16) for _ in range(n_layers)]
        toks, slots = [1 + 97 * i for i in range(b)], list(range(b))
        times, tokens, distinct = {v: [] for v in variants}, {}, []
        for _ in range(rounds):
            for name in variants:
                with holding(X, BATCH_VARIANTS[name]):  # through the capture: DOT_TILE is read there
                    dec = X.mla_decoder.MlaBatchDecoder(model, caches, cos, sin, batch=b, max_steps=4096, num_splits=16)
                    dec.set_rows(toks, [ctx] * b, slots)
                    dec._apply_rows()  # an eager step, layer by layer: which experts the rows route to
                    distinct = []
                    for i in range(n_layers):
                        dec.layer(i)
                        if model.layers[i].is_moe:
                            distinct.append(int(dec.stack.ids[:b].unique().numel()))
                    torch.cuda.synchronize()
                    runner = capture(dec.step, steps_per_replay=4,
                                     before_capture=lambda: dec.set_rows(toks, [ctx] * b, slots))
                    dec.set_rows(toks, [ctx] * b, slots)
                    times[name].append(time_replays(runner, 30) / 4)
                    dec.set_rows(toks, [ctx] * b, slots)
                    for _ in range(2):  # 8 steps from the same rows
                        runner()
                    torch.cuda.synchronize()
                    tokens[name] = dec.out_tokens[:b, :8].tolist()
                    del runner, dec
                    torch.cuda.empty_cache()
        ms = min(times[variants[0]])
        mean_distinct = sum(distinct) / max(len(distinct), 1)
        total = by["total"] - by["routed_experts"] + sum(distinct) * per_expert + (b - 1) * by["kv"]
        roof_ms = total / (bw * 1e12) * 1e3
        R[f"{tag}batch{b}_step_ms"] = ms
        R[f"{tag}batch{b}_step_ratio"] = ms / R[f"{tag}plain_ms"] if f"{tag}plain_ms" in R else None
        R[f"{tag}batch{b}_distinct_experts_per_layer"] = mean_distinct
        R[f"{tag}batch{b}_bytes"] = total
        R[f"{tag}batch{b}_frac_roofline"] = roof_ms / ms
        R[f"{tag}batch{b}_tok_s"] = b * 1e3 / ms
        log(f"  {tag}batch {b}: {ms:.3f} ms a step ({b * 1e3 / ms:.0f} tok/s), "
            f"{R[f'{tag}batch{b}_step_ratio'] or float('nan'):.2f}x one slot's plain step; {mean_distinct:.1f} distinct "
            f"experts a layer ({b} x top-{s['top_k']}), {total / 1e9:.2f} GB: {roof_ms / ms:.3f} of roofline")
        if len(variants) > 1:
            R[f"{tag}batch{b}_variants"] = res = {v: min(t) for v, t in times.items()}
            R[f"{tag}batch{b}_variants_frac_roofline"] = {v: roof_ms / t for v, t in res.items()}
            # PDL only reorders launches: the chain's forms give the same tokens (the bmm form rounds q . w_uk and
            # o . w_uv otherwise, and random weights turn an ulp into another greedy token after a few steps)
            chain = [v for v in variants if v.startswith("chain")] or list(variants)
            R[f"{tag}batch{b}_variants_tokens_equal"] = eq = all(tokens[v] == tokens[chain[0]] for v in chain)
            log(f"  {tag}batch {b} forms: " + ", ".join(f"{v} {t:.3f} ms ({roof_ms / t:.3f})" for v, t in res.items())
                + f"; tokens equal {eq}")
        del caches
        torch.cuda.empty_cache()



BATCH_SPEC_PLANS = ((2, 1), (2, 3), (4, 1), (4, 3), (8, 1))  # (slots, drafts each): batched drafting graphs (<= 16 rows)


def batch_spec_measure(X, model, s: dict, ctx: int, R: dict, tag: str = "dsv2lite_", plans=BATCH_SPEC_PLANS) -> None:
    """Slots that draft together (MlaBatchSpecDecoder: each slot's k MTP drafts, one verify of its k + 1 tokens, the
    MTP layer over them, one graph), each row at ``ctx`` in its own slot: the step's time against the plain batched
    step of as many slots measured before in the same run (``{tag}batch{b}_step_ms``): ``{tag}batch{b}_mtp_k{k}_
    step_ms`` / ``_step_ratio`` (the acceptance length a slot needs to break even), and the greedy tokens of such
    steps driven from the host against the plain batched step's from the same rows (``_tokens_equal``, the first
    8 of each slot; random weights: a rounding difference may flip a near tie, ``_first_difference`` says where)."""
    n_layers, dev = len(model.layers), "cuda"
    mt = ctx + 1024
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = fr.cos(), fr.sin()
    for b, k in plans:
        caches = [torch.randn(b + 1, mt, s["r"] + s["rope"], device=dev).to(torch.bfloat16)
                  for _ in range(n_layers + 1)]
        toks, slots = [1 + 97 * i for i in range(b)], list(range(b))
        plain = X.mla_decoder.MlaBatchDecoder(model, caches[:n_layers], cos, sin, batch=b, max_steps=64, num_splits=16)
        plain.set_rows(toks, [ctx] * b, slots)
        for _ in range(8):
            plain.step()
        want = plain.out_tokens[:b, :8].tolist()
        del plain
        dec = X.mla_decoder.MlaBatchSpecDecoder(model, caches, cos, sin, batch=b, k=k, num_splits=16)
        runner = capture(dec.step, steps_per_replay=1,
                         before_capture=lambda: dec.set_rows(toks, [ctx] * b, slots, [k] * b))
        dec.set_rows(toks, [ctx] * b, slots, [k] * b)
        ms = time_replays(runner, 30)
        got, cur, pos = [[] for _ in range(b)], list(toks), [ctx] * b
        dec.mtp_hidden.zero_()
        while min(len(g) for g in got) < 8:
            dec.set_rows(cur, pos, slots, [k] * b)
            runner()
            for r, row in enumerate(dec.out[:b].tolist()):
                kept = row[1:row[0] + 2]
                got[r] += kept
                cur[r], pos[r] = kept[-1], pos[r] + len(kept)
        got = [g[:8] for g in got]
        plain_ms = R.get(f"{tag}batch{b}_step_ms")
        key = f"{tag}batch{b}_mtp_k{k}"
        R[f"{key}_step_ms"] = ms
        R[f"{key}_step_ratio"] = ms / plain_ms if plain_ms else None
        R[f"{key}_tokens_equal"] = got == want
        R[f"{key}_first_difference"] = next((i for r in range(b) for i in range(8) if got[r][i] != want[r][i]), None)
        log(f"  {tag}batch {b}, {k} drafts a slot: {ms:.3f} ms a step = {R[f'{key}_step_ratio'] or float('nan'):.2f}x "
            f"the plain batched step (a slot breaks even at that acceptance length; all {k} accepted: "
            f"{(k + 1) / (R[f'{key}_step_ratio'] or float('nan')):.2f}x its tok/s); tokens equal {got == want}")
        del runner, dec, caches
        torch.cuda.empty_cache()

# (name, MlaStack / GroupedMoe class attributes, MlaBatchDecoder arguments) of the batched step's sweep: the
# grouped experts' tiles (gate/up, down: run SW1 swept both together, SW2 down alone), the projections'
# tensor-core tile, the attention's splits
_GU = (32, 128, 4, 4)
BATCH_TILE_VARIANTS = [
    ("default", {}, {}, {}),
    ("down_16x128", {}, {"DOT_TILES": (_GU, (16, 128, 4, 4))}, {}),
    ("down_64x128", {}, {"DOT_TILES": (_GU, (64, 128, 4, 4))}, {}),
    ("down_32x64_s6", {}, {"DOT_TILES": (_GU, (32, 64, 4, 6))}, {}),
    ("down_32x128_s6", {}, {"DOT_TILES": (_GU, (32, 128, 4, 6))}, {}),
    ("down_32x256_s3", {}, {"DOT_TILES": (_GU, (32, 256, 4, 3))}, {}),
    ("down_64x64_s6", {}, {"DOT_TILES": (_GU, (64, 64, 4, 6))}, {}),
    ("down_16x64_s8", {}, {"DOT_TILES": (_GU, (16, 64, 4, 8))}, {}),
    ("down_32x128_w8", {}, {"DOT_TILES": (_GU, (32, 128, 8, 4))}, {}),
    ("down_64x128_w8", {}, {"DOT_TILES": (_GU, (64, 128, 8, 4))}, {}),
    ("splits_8", {}, {}, {"num_splits": 8}),
    ("splits_32", {}, {}, {"num_splits": 32}),
    ("router_3_launches", {"FUSED_ROUTER": False}, {}, {}),  # norm, router GEMV, top-k as before SW2
    ("reduce_launch", {}, {"FUSED_REDUCE": False}, {}),  # the experts' reduce in a launch of its own
    # the attention projections' tensor-core tile (MlaStack.DOT_TILE, read when the step is captured)
    ("proj_16x128", {"DOT_TILE": (16, 128, 4, 4)}, {}, {}),
    ("proj_16x512_s3", {"DOT_TILE": (16, 512, 4, 3)}, {}, {}),
    ("proj_32x256", {"DOT_TILE": (32, 256, 4, 4)}, {}, {}),
    ("proj_16x256_w8", {"DOT_TILE": (16, 256, 8, 4)}, {}, {}),
    ("proj_16x128_w2_s6", {"DOT_TILE": (16, 128, 2, 6)}, {}, {}),
    ("proj_32x128", {"DOT_TILE": (32, 128, 4, 4)}, {}, {}),
]


def plain_reduce_ab(X, model, caches, cos, sin, ctx: int, R: dict, tag: str = "dsv2lite_", rounds: int = 3) -> None:
    """The one-token plain step with the experts' reduce in the down kernel's last programs (GroupedMoe's
    FUSED_REDUCE, the default) and as a launch of its own, alternated: ``{tag}plain_reduce_ab`` (ms, best)."""
    moe_cls = X.moe.GroupedMoe
    times: dict = {"fused": [], "launch": []}
    for _ in range(rounds):
        for name in times:
            saved = moe_cls.FUSED_REDUCE
            moe_cls.FUSED_REDUCE = name == "fused"
            try:
                dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096)
            finally:
                moe_cls.FUSED_REDUCE = saved
            ms, runner = time_plain_step(dec, ctx, 30)
            times[name].append(ms)
            del runner, dec
            torch.cuda.empty_cache()
    R[f"{tag}plain_reduce_ab"] = res = {k: min(v) for k, v in times.items()}
    log(f"  {tag}plain step, experts' reduce: " + ", ".join(f"{k} {v:.3f} ms" for k, v in res.items()))


def batch_sweep(X, model, s: dict, ctx: int, R: dict, b: int = 4, tag: str = "dsv2lite_") -> None:
    """The b-slot step (the product's default form) under each of BATCH_TILE_VARIANTS, two rounds, best of
    the rounds (``{tag}batch{b}_tiles``, ms), then the per-kernel device time of an eager b-slot step with
    PDL off, so that each kernel's time is its own (``{tag}batch{b}_profile``: name, launches, us a step)."""
    n_layers, dev = len(model.layers), "cuda"
    mt = ctx + 1024
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = fr.cos(), fr.sin()
    caches = [torch.randn(b + 1, mt, s["r"] + s["rope"], device=dev).to(torch.bfloat16) for _ in range(n_layers)]
    toks, slots = [1 + 97 * i for i in range(b)], list(range(b))
    moe_cls = X.moe.GroupedMoe
    times: dict = {}
    for _ in range(2):
        for name, stack_attrs, moe_attrs, kwargs in BATCH_TILE_VARIANTS:
            saved = {k: getattr(moe_cls, k) for k in moe_attrs}
            st_cls = X.mla.MlaStack
            st_saved = {k: getattr(st_cls, k) for k in stack_attrs}
            try:
                for k, v in moe_attrs.items():
                    setattr(moe_cls, k, v)
                for k, v in stack_attrs.items():  # set through the capture: some are read when the step runs
                    setattr(st_cls, k, v)
                dec = X.mla_decoder.MlaBatchDecoder(model, caches, cos, sin, batch=b, max_steps=4096,
                                                   **{"num_splits": 16, **kwargs})
                runner = capture(dec.step, steps_per_replay=4,
                                 before_capture=lambda: dec.set_rows(toks, [ctx] * b, slots))
                dec.set_rows(toks, [ctx] * b, slots)
                times.setdefault(name, []).append(time_replays(runner, 30) / 4)
                del runner, dec
            except Exception:
                times.setdefault(name, []).append(float("inf"))
                log(f"  {name}: " + traceback.format_exc()[-600:])
            finally:
                for k, v in saved.items():
                    setattr(moe_cls, k, v)
                for k, v in st_saved.items():
                    setattr(st_cls, k, v)
            torch.cuda.empty_cache()
    R[f"{tag}batch{b}_tiles"] = res = {k: min(v) for k, v in times.items()}
    log(f"  {tag}batch {b} tiles: " + ", ".join(f"{k} {v:.3f} ms" for k, v in res.items()))
    try:
        from torch.profiler import ProfilerActivity, profile
        dec = built_with(X, {"PDL": False}, lambda: X.mla_decoder.MlaBatchDecoder(
            model, caches, cos, sin, batch=b, max_steps=4096, num_splits=16))
        dec.set_rows(toks, [ctx] * b, slots)
        dec.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dec.set_rows(toks, [ctx] * b, slots)
                dec.step()
            torch.cuda.synchronize()
        rows = kernel_rows(prof, 3)
        R[f"{tag}batch{b}_profile"] = rows[:30]
        log(f"  {tag}batch {b} profile (PDL off): total {sum(r[2] for r in rows):.0f} us in "
            f"{sum(r[1] for r in rows)} kernels; " + "; ".join(f"{n} x{c} {t}us" for n, c, t in rows[:16]))
        del dec
    except Exception:
        log(traceback.format_exc()[-800:])
    del caches
    torch.cuda.empty_cache()


def run_mla(X, R: dict, ctx: int = 1024) -> None:
    if os.environ.get("MLA_VERIFY_CHAIN"):  # the verify's block as one chain of Triton kernels (a variant's run)
        X.mla.MlaStack.VERIFY_CHAIN = True
        R["mla_verify_chain"] = True
    s = DSV2_LITE
    ctx = int(os.environ.get("MLA_CTX", ctx))  # another context for a variant's run (the published keys: 1K)
    model, caches, cos, sin, by, bw, roof_ms = shape_setup(X, s, ctx, R, "dsv2lite_", "deepseek-v2-lite-like model")
    if os.environ.get("MLA_PDL_AB"):  # PDL on / off alone (a short run)
        pdl_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_")
        tiles_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_", rounds=2)
        R["dsv2lite_frac_roofline_pdl_early"] = roof_ms / R["dsv2lite_pdl_ab"]["pdl_early"]
        R["dsv2lite_frac_roofline_pdl"] = roof_ms / R["dsv2lite_pdl_ab"]["pdl"]
        R["dsv2lite_frac_roofline_no_pdl"] = roof_ms / R["dsv2lite_pdl_ab"]["no_pdl"]
        log(f"  dsv2lite of roofline: PDL + early tiles {R['dsv2lite_frac_roofline_pdl_early']:.3f}, PDL "
            f"{R['dsv2lite_frac_roofline_pdl']:.3f}, without "
            f"{R['dsv2lite_frac_roofline_no_pdl']:.3f} (roofline {roof_ms:.3f} ms)")
        return
    if os.environ.get("MLA_VERIFY_AB"):  # the verify's block, bmm form against the chain, alternated (a short run)
        verify_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_")
        return
    if os.environ.get("MLA_BATCH_SWEEP"):  # the batched step's tiles and per-kernel profile alone (a short run)
        plain_reduce_ab(X, model, caches, cos, sin, ctx, R)
        for b in (4, 8):
            batch_sweep(X, model, s, ctx, R, b=b)
        return
    if os.environ.get("MLA_BATCH_ONLY"):  # one slot's plain step and the batched steps alone (a short run)
        dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=3, max_steps=4096)
        R["dsv2lite_plain_ms"] = time_plain_step(dec, ctx, 30)[0]
        R["dsv2lite_frac_roofline"] = roof_ms / R["dsv2lite_plain_ms"]
        log(f"  dsv2lite plain step {R['dsv2lite_plain_ms']:.3f} ms ({R['dsv2lite_frac_roofline']:.3f} of roofline)")
        # a drafting request's plain step (adaptive drafting between probes): + the MTP layer's cache row
        rows = capture(lambda: dec.plain_step(mtp_row=True), steps_per_replay=4, before_capture=lambda: dec.set_state(1, ctx))
        dec.set_state(1, ctx)
        R["dsv2lite_plain_mtp_row_ms"] = ms = time_replays(rows, 30) / 4
        R["dsv2lite_plain_mtp_row_ratio"] = ms / R["dsv2lite_plain_ms"]
        log(f"  dsv2lite plain step + MTP row {ms:.3f} ms ({R['dsv2lite_plain_mtp_row_ratio']:.3f}x)")
        del dec, rows
        ab = bool(os.environ.get("MLA_BATCH_AB"))  # the batched block's forms alternated (BATCH_VARIANTS)
        batch_measure(X, model, s, ctx, R, sizes=(4, 8) if ab else (2, 4, 8),
                      variants=tuple(os.environ.get("MLA_BATCH_VARIANTS", ",".join(BATCH_VARIANTS)).split(","))
                      if ab else ("product",), rounds=3 if ab else 1)
        if not ab:
            batch_spec_measure(X, model, s, ctx, R)
        return
    if os.environ.get("MLA_FUSED_AB"):  # the attention middle's variants alone (a short run)
        fused_middle_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_", variants=list(FUSED_VARIANTS))
        return
    if os.environ.get("MLA_SHARED_AB"):  # the one-token step's forms (ONE_TOKEN_VARIANTS) alternated (a short run)
        one_token_variants_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_", roof_ms)
        return
    if os.environ.get("MLA_ATTN_AB"):  # the attention's splits and program forms (ATTN_VARIANTS) alternated
        one_token_variants_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_", roof_ms, ATTN_VARIANTS, "attn_variants")
        return
    if os.environ.get("MLA_PLAIN_SWEEP_ONLY"):  # the one-token tile sweep alone (a short run)
        fused_middle_ab(X, model, caches, cos, sin, ctx, R, "dsv2lite_")
        plain_tile_sweep(X, model, caches, cos, sin, ctx, R)
        R["dsv2lite_frac_roofline_tuned"] = roof_ms / R["dsv2lite_plain_ms_tuned"]
        R["dsv2lite_frac_roofline_default_same_run"] = roof_ms / R["dsv2lite_plain_ms_default_same_run"]
        log(f"  dsv2lite of roofline: tuned {R['dsv2lite_frac_roofline_tuned']:.3f}, default "
            f"{R['dsv2lite_frac_roofline_default_same_run']:.3f} (roofline {roof_ms:.3f} ms)")
        return
    for sweep in (gemv_dot_sweep, dot_tile_sweep):
        try:
            sweep(X, model, caches, cos, sin, ctx, R)
        except Exception:
            log(traceback.format_exc()[-1500:])
    try:
        measure(X, model, caches, cos, sin, ctx, "dsv2lite_", R)
        R["dsv2lite_frac_roofline"] = roof_ms / R["dsv2lite_plain_ms"]
        R["mtp_k3_step_ratio"] = R["dsv2lite_mtp_k3_step_ratio"]
        # bytes model of k=3: three drafts + a verify whose 4 tokens route independently (random weights)
        n_moe, e, k = s["layers"] - 1, s["experts"], s["top_k"]
        distinct = e * (1 - (1 - k / e) ** 4)
        verify = by["total"] - by["routed_experts"] + n_moe * distinct * 3 * s["hidden"] * s["moe_inter"] * 2
        R["mtp_k3_bytes_ratio_random_routing"] = (verify + 3 * by["mtp_draft"]) / by["total"]
        R["mtp_k3_bytes_ratio_same_routing"] = (by["total"] + 3 * by["mtp_draft"]) / by["total"]
    except Exception:
        R["dsv2lite_error"] = traceback.format_exc()[-1500:]
        log(R["dsv2lite_error"])
    for fn in (batch_measure, batch_spec_measure):
        try:
            fn(X, model, s, ctx, R)
        except Exception:
            log(traceback.format_exc()[-1500:])
    for tag, fn in (("dsv2lite_draftvocab_", lambda: measure(X, model, caches, cos, sin, ctx, "dsv2lite_draftvocab_", R,
                                                             draft_vocab=DRAFT_VOCAB)),
                    ("dsv2lite_", lambda: breakdown(X, model, caches, cos, sin, ctx, "dsv2lite_", R))):
        try:
            fn()
        except Exception:
            log(traceback.format_exc()[-1500:])
    moe_layers = [l for l in model.layers + [model.mtp.layer] if l.is_moe]
    try:  # every token routed to the same experts: the verify reads no extra experts
        for l in moe_layers:
            l.router_bias[: s["top_k"]] += 100.0
        measure(X, model, caches, cos, sin, ctx, "dsv2lite_samerouting_", R)
        measure(X, model, caches, cos, sin, ctx, "dsv2lite_samerouting_draftvocab_", R, draft_vocab=DRAFT_VOCAB)
        breakdown(X, model, caches, cos, sin, ctx, "dsv2lite_samerouting_", R, draft_vocab=DRAFT_VOCAB)
    except Exception:
        log(traceback.format_exc()[-1500:])
    finally:
        for l in moe_layers:
            l.router_bias[: s["top_k"]] -= 100.0
    key = "dsv2lite_samerouting_draftvocab_mtp_k3_step_ratio"
    if key in R:  # the correlated-routing case with the reduced draft head (the random-routing one is above)
        R["mtp_k3_step_ratio_same_routing_draft_vocab_32k"] = R[key]
    try:
        R["dsv2lite_correctness"] = c = correctness(X, model, caches, cos, sin, ctx)
        log(f"  correctness: {c}")
    except Exception:
        R["dsv2lite_correctness"] = {"error": traceback.format_exc()[-800:]}
        log(traceback.format_exc()[-1500:])
    log(f"  dsv2lite roofline {1e3 / roof_ms:.0f} tok/s ({by['total'] / 1e9:.2f} GB/step; draft "
        f"{by['mtp_draft'] / 1e9:.3f} GB = {by['mtp_draft'] / by['total']:.1%} of a step)")
    del model, caches
    torch.cuda.empty_cache()


def fp8_latent(caches: list, k_scale: float) -> list:
    """The latent caches as vLLM's CUDA MLA writer keeps them with --kv-cache-dtype fp8: E4M3 bytes of each row /
    k_scale, rounded to nearest (the engine's kvquant.quantize(nearest=True))."""
    return [(c.float() * (1.0 / k_scale)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) for c in caches]


def run_mla_fp8kv(X, R: dict, ctx: int = 32768) -> None:
    """The DeepSeek-V2-Lite shape at a long context with the latent in bf16 and in FP8 (``dsv2lite_ctx32k_*``,
    ``dsv2lite_fp8kv_ctx32k_*``, same model and run): the plain step's time, tok/s and fraction of the roofline of
    the bytes each reads (the latent at one byte an element for FP8), and the FP8 latent's first tokens against the
    bf16 one's (random weights: near ties may part; the CPU tests hold the FP8 step to its reference)."""
    s = DSV2_LITE
    model, caches, cos, sin, by, bw, roof_ms = shape_setup(X, s, ctx, R, "dsv2lite_ctx32k_",
                                                           f"deepseek-v2-lite-like model at {ctx} tokens")
    k_scale = float(max(c.abs().max().item() for c in caches)) / 448.0  # vLLM-style calibrated: max maps to 448
    kv8 = by["kv"] // 2  # the latent at one byte an element
    roof8 = (by["total"] - by["kv"] + kv8) / (bw * 1e12) * 1e3
    R["dsv2lite_fp8kv_ctx32k_roofline_tok_s"] = 1e3 / roof8
    out = {}
    product = X.adapter.attention_splits(ctx + 1024)
    for tag, cs, scales in (("dsv2lite_ctx32k_", caches, None),
                            ("dsv2lite_fp8kv_ctx32k_", fp8_latent(caches, k_scale), [k_scale] * len(caches))):
        for splits in dict.fromkeys((product, 32, 64)):  # the product's split count first, then more programs
            try:
                dec = X.mla_decoder.MlaDecoder(model, cs, cos, sin, max_draft=0, max_steps=4096, num_splits=splits,
                                               kv_scales=scales)
                ms, runner = time_plain_step(dec, ctx)
                R.setdefault(f"{tag}splits_ms", {})[splits] = ms
                log(f"  {tag} {splits} splits: plain {ms:.3f} ms, {(roof8 if scales else roof_ms) / ms:.3f} of its "
                    f"roofline")
                if splits == product:
                    out[tag] = dec.out_tokens[:8].tolist()
                    R[f"{tag}plain_ms"], R[f"{tag}tok_s"] = ms, 1e3 / ms
                    R[f"{tag}frac_roofline"] = (roof8 if scales else roof_ms) / ms
                    log(f"  {tag}: {1e3 / ms:.1f} tok/s; tokens {out[tag]}")
                del dec, runner
            except Exception:
                R[f"{tag}error"] = traceback.format_exc()[-1500:]
                log(R[f"{tag}error"])
    # a 1K context in this long slot: the product's splits (most of them empty: mla.SPLIT_MIN_ROWS) against 16
    for splits in dict.fromkeys((16, product)):
        try:
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096, num_splits=splits)
            ms, runner = time_plain_step(dec, 1024)
            R.setdefault("dsv2lite_ctx1k_in_32k_slot_splits_ms", {})[splits] = ms
            log(f"  1K context in the 32K slot, {splits} splits: plain {ms:.3f} ms")
            del dec, runner
        except Exception:
            log(traceback.format_exc()[-1500:])
    try:  # the compiled FP8-latent step against the torch twins over the same bytes
        kv8 = fp8_latent(caches, k_scale)
        R["dsv2lite_fp8kv_ctx32k_correctness"] = c = correctness(X, model, kv8, cos, sin, ctx, steps=16,
                                                                 kv_scales=[k_scale] * len(kv8))
        log(f"  dsv2lite FP8 latent correctness: {c}")
        del kv8
    except Exception:
        R["dsv2lite_fp8kv_ctx32k_correctness"] = {"error": traceback.format_exc()[-800:]}
        log(traceback.format_exc()[-1500:])
    if len(out) == 2:
        R["dsv2lite_fp8kv_over_bf16_ctx32k"] = R["dsv2lite_ctx32k_plain_ms"] / R["dsv2lite_fp8kv_ctx32k_plain_ms"]
        R["dsv2lite_fp8kv_ctx32k_tokens_equal_bf16"] = out["dsv2lite_ctx32k_"] == out["dsv2lite_fp8kv_ctx32k_"]
        R["dsv2lite_fp8kv_ctx32k_k_scale"] = k_scale
    del model, caches
    torch.cuda.empty_cache()


def run_dsv3(X, R: dict, ctx: int = 1024) -> None:
    """DeepSeek-V3's layer shapes (DSV3_CUT) on the fast path: plain step against the bytes it reads, the
    MTP spec steps, the per-kernel profile (``dsv3_shape_*``). The roofline counts what a plain step of
    this cut reads; with 3 layers the lm_head is 28% of it (2% in the 61-layer model), so
    ``dsv3_shape_layer_us`` (the MoE layer's share of the graph-timed pieces) is the figure that carries
    over to the full model."""
    s = DSV3_CUT
    model, caches, cos, sin, by, bw, roof_ms = shape_setup(X, s, ctx, R, "dsv3_shape_",
                                                           f"deepseek-v3-shaped model ({s['layers']} layers)")
    R["dsv3_shape_config"] = {k: v for k, v in s.items()}
    if os.environ.get("MLA_PDL_AB"):  # PDL / absorb variants and the T2 tiles against T1's (a short run)
        pdl_ab(X, model, caches, cos, sin, ctx, R, "dsv3_shape_", rounds=2)
        tiles_ab(X, model, caches, cos, sin, ctx, R, "dsv3_shape_", rounds=2)
        R["dsv3_shape_frac_roofline"] = roof_ms / R["dsv3_shape_pdl_ab"]["pdl_early"]
        log(f"  dsv3 shape of roofline on the defaults: {R['dsv3_shape_frac_roofline']:.3f} (roofline {roof_ms:.3f} ms)")
        return
    if os.environ.get("MLA_SHARED_AB"):
        one_token_variants_ab(X, model, caches, cos, sin, ctx, R, "dsv3_shape_", roof_ms)
        return
    if os.environ.get("MLA_ATTN_AB"):
        one_token_variants_ab(X, model, caches, cos, sin, ctx, R, "dsv3_shape_", roof_ms, ATTN_VARIANTS,
                              "attn_variants")
        return
    if os.environ.get("MLA_QUICK"):  # the plain step only, fused middle against unfused (a short run)
        fused_middle_ab(X, model, caches, cos, sin, ctx, R, "dsv3_shape_")
        R["dsv3_shape_plain_ms"] = R["dsv3_shape_fused_middle"]["fused"]
        R["dsv3_shape_frac_roofline"] = roof_ms / R["dsv3_shape_plain_ms"]
        log(f"  dsv3 shape: plain {R['dsv3_shape_plain_ms']:.3f} ms, {R['dsv3_shape_frac_roofline']:.3f} of roofline")
        return
    try:
        measure(X, model, caches, cos, sin, ctx, "dsv3_shape_", R)
        R["dsv3_shape_frac_roofline"] = roof_ms / R["dsv3_shape_plain_ms"]
        log(f"  dsv3 shape: plain {R['dsv3_shape_plain_ms']:.3f} ms, roofline {roof_ms:.3f} ms "
            f"({by['total'] / 1e9:.2f} GB), {R['dsv3_shape_frac_roofline']:.3f} of it")
    except Exception:
        R["dsv3_shape_error"] = traceback.format_exc()[-1500:]
        log(R["dsv3_shape_error"])
    try:
        breakdown(X, model, caches, cos, sin, ctx, "dsv3_shape_", R)
        moe_us = R["dsv3_shape_pieces_us"].get("moe_block1")
        if isinstance(moe_us, float):
            per_layer_bytes = by["attention"] / s["layers"] \
                + (by["routed_experts"] + by["shared_experts"] + by["router"]) / (s["layers"] - 1)
            R["dsv3_shape_layer_us"] = moe_us
            R["dsv3_shape_layer_frac_roofline"] = per_layer_bytes / (bw * 1e12) * 1e6 / moe_us
    except Exception:
        log(traceback.format_exc()[-1500:])
    del model, caches
    torch.cuda.empty_cache()


def run_dsv3_fp8(X, R: dict, ctx: int = 1024) -> None:
    """DeepSeek-V3's layer shapes with its FP8 checkpoint's format on the fast path (``build(fp8=True)``: 128 x 128
    block scales, activations rounded per block): the plain step against the bytes it reads
    (``dsv3_shape_fp8_*``; FP8 weights + scales, bf16 kv_b / router / lm_head, KV), and the bf16 figure of the
    same shape when this run measured it (``dsv3_shape_fp8_over_bf16``), and 16 teacher-forced steps against the torch
    twins over the same bytes (``dsv3_shape_fp8_correctness``: activations rounded per block, weights dequantized in
    float32, as the engine's reference step)."""
    s = DSV3_CUT
    model, caches, cos, sin, by, bw, roof_ms = shape_setup(X, s, ctx, R, "dsv3_shape_fp8_",
                                                           f"deepseek-v3-shaped FP8 model ({s['layers']} layers)",
                                                           fp8=True)

    def sweep_point(label: str) -> float | None:
        """The plain step's ms under the settings in force (a sweep's point), logged; None where it failed."""
        try:
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096)
            ms, runner = time_plain_step(dec, ctx)
            del dec, runner
        except Exception:
            log(traceback.format_exc()[-800:])
            return None
        log(f"  dsv3 shape FP8 {label}: plain {ms:.3f} ms, {roof_ms / ms:.3f} of roofline")
        return ms

    if os.environ.get("FP8_TILE_SWEEP"):  # "rows:acc_elems,...": the one-token block-FP8 tile policy (fp8block.tile)
        base = (X.fp8block.FMA_ACT_BLOCK_N, X.fp8block.ACC_ELEMS)
        for spec in os.environ["FP8_TILE_SWEEP"].split(","):
            X.fp8block.FMA_ACT_BLOCK_N, X.fp8block.ACC_ELEMS = (int(v) for v in spec.split(":"))
            if (ms := sweep_point(f"tiles {spec}")) is not None:
                R.setdefault("dsv3_shape_fp8_tile_sweep_ms", {})[spec] = ms
        X.fp8block.FMA_ACT_BLOCK_N, X.fp8block.ACC_ELEMS = base
    if os.environ.get("FP8_ROWS_SWEEP"):  # "name=rows+name=rows,...": the fewest rows a program of one-token FP8
        # GEMVs by projection (MlaStack.FP8_ROWS; "moe_gate_up" / "moe_down": GroupedMoe.FP8_ROWS), each spec measured
        # twice in turn ("-": the product's; "flat": none, fp8block.FMA_ACT_BLOCK_N everywhere as before run G48)
        base = (dict(X.mla.MlaStack.FP8_ROWS), dict(X.moe.GroupedMoe.FP8_ROWS))
        specs = os.environ["FP8_ROWS_SWEEP"].split(",")
        for _ in range(2):
            for spec in specs:
                if spec == "-":
                    X.mla.MlaStack.FP8_ROWS, X.moe.GroupedMoe.FP8_ROWS = (dict(b) for b in base)
                else:
                    rows = {} if spec == "flat" else {k: int(v) for k, v in (p.split("=") for p in spec.split("+"))}
                    X.mla.MlaStack.FP8_ROWS = {k: v for k, v in rows.items() if not k.startswith("moe_")}
                    X.moe.GroupedMoe.FP8_ROWS = {k[4:]: v for k, v in rows.items() if k.startswith("moe_")}
                if (ms := sweep_point(f"rows {spec}")) is not None:
                    R.setdefault("dsv3_shape_fp8_rows_sweep_ms", {}).setdefault(spec, []).append(ms)
        X.mla.MlaStack.FP8_ROWS, X.moe.GroupedMoe.FP8_ROWS = base
        return
    default = X.fp8block.GROUPED
    try:
        # the product's default first, then the one-token tiles' other layout ([rows, groups, 128] against
        # [rows, K]: fp8block.GROUPED)
        for grouped in dict.fromkeys((default, True, False)):
            X.fp8block.GROUPED = grouped
            dec = X.mla_decoder.MlaDecoder(model, caches, cos, sin, max_draft=0, max_steps=4096)
            ms, runner = time_plain_step(dec, ctx)
            R.setdefault("dsv3_shape_fp8_grouped_ms", {})[str(grouped)] = ms
            toks = dec.out_tokens[:8].tolist()
            log(f"  dsv3 shape FP8 (grouped tiles {grouped}): plain {ms:.3f} ms, {roof_ms / ms:.3f} of the roofline "
                f"{roof_ms:.3f} ms ({by['total'] / 1e9:.2f} GB); tokens {toks}")
            if grouped == default:
                R["dsv3_shape_fp8_plain_ms"], R["dsv3_shape_fp8_tok_s"] = ms, 1e3 / ms
                R["dsv3_shape_fp8_frac_roofline"] = roof_ms / ms
                if "dsv3_shape_plain_ms" in R:
                    R["dsv3_shape_fp8_over_bf16"] = R["dsv3_shape_plain_ms"] / ms
                R["dsv3_shape_fp8_tokens"] = toks
            elif R["dsv3_shape_fp8_tokens"] != toks:  # another tile sums in another order: a near tie may part
                R.setdefault("dsv3_shape_fp8_token_mismatch", []).append(grouped)
            del dec, runner
    except Exception:
        R["dsv3_shape_fp8_error"] = traceback.format_exc()[-1500:]
        log(R["dsv3_shape_fp8_error"])
    finally:
        X.fp8block.GROUPED = default
    try:  # the compiled kernels against their torch twins over the same FP8 bytes (reference.linear reads BlockFp8)
        R["dsv3_shape_fp8_correctness"] = c = correctness(X, model, caches, cos, sin, ctx, steps=16)
        log(f"  dsv3 shape FP8 correctness: {c}")
    except Exception:
        R["dsv3_shape_fp8_correctness"] = {"error": traceback.format_exc()[-800:]}
        log(traceback.format_exc()[-1500:])
    moe_layers = [l for l in model.layers + ([model.mtp.layer] if model.mtp else []) if l.is_moe]
    try:  # the same with every token routed to the same experts: random 256-expert grouped routing flips on
        # differences far below a kernel error, which this check then no longer mistakes for one
        for l in moe_layers:
            l.router_bias[: s["top_k"]] += 100.0
        R["dsv3_shape_fp8_correctness_samerouting"] = c = correctness(X, model, caches, cos, sin, ctx, steps=16)
        log(f"  dsv3 shape FP8 correctness, same routing: {c}")
    except Exception:
        R["dsv3_shape_fp8_correctness_samerouting"] = {"error": traceback.format_exc()[-800:]}
        log(traceback.format_exc()[-1500:])
    finally:
        for l in moe_layers:
            l.router_bias[: s["top_k"]] -= 100.0
    if os.environ.get("MLA_FP8_BREAKDOWN"):  # graph-timed pieces and the per-kernel profile (profile last)
        try:
            breakdown(X, model, caches, cos, sin, ctx, "dsv3_shape_fp8_", R)
        except Exception:
            log(traceback.format_exc()[-1500:])
    del model, caches
    torch.cuda.empty_cache()


def run_dsv32(X, R: dict, ctx: int = 131072) -> None:
    """DeepSeek-V3.2's layer shapes (DSV32_CUT: V3's 3-layer cut plus the indexer) at a 128K context, plain
    step: sparse (the product: indexer + radix top-k + MLA attention over the 2048 picked rows) against the
    same layers attending densely (``dsv32_dense_step_ctx128k_ms``). The roofline counts what the sparse
    step reads: weights (the indexer's included; routed experts the top-8 of each MoE layer), the
    indexer's key cache over the context and the picked rows' latent (``dsv32_shape_ctx128k_*``)."""
    import dataclasses

    M = X.mla
    s = DSV32_CUT
    t0 = time.time()
    model = build(X, s)
    by = step_bytes(model, s, ctx)  # "total": the main model's plain step (the MTP layer apart)
    log(f"deepseek-v3.2-shaped model ({s['layers']} layers + MTP) built in {time.time() - t0:.1f} s")
    mt = ctx + 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    caches = [torch.randn(mt, s["r"] + s["rope"], device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(s["layers"] + 1)]
    index_caches = [torch.randn(mt, s["index_dim"], device="cuda", generator=g).to(torch.bfloat16)
                    for _ in range(s["layers"] + 1)]
    inv = 1.0 / (10000.0 ** (torch.arange(0, s["rope"], 2).float() / s["rope"]))
    fr = torch.arange(mt, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = fr.cos(), fr.sin()
    b = 2
    index_w = sum(l.index.wq_b.numel() * b for l in model.layers)  # wqkv_a (in "attention") holds wk + weights
    kv_sparse = s["layers"] * (s["index_topk"] * (s["r"] + s["rope"]) + ctx * s["index_dim"]) * b
    total = by["total"] - by["kv"] + index_w + kv_sparse
    R["dsv32_shape_config"] = dict(s, ctx=ctx)
    R["dsv32_shape_ctx128k_step_bytes"] = dict(by, indexer_q_b=index_w, kv=kv_sparse, total=total, mtp_draft=None)
    bw = R.get("copy_bw_TBps", 4.2)
    roof_ms = total / (bw * 1e12) * 1e3
    R["dsv32_shape_ctx128k_roofline_tok_s"] = 1e3 / roof_ms
    splits = 16  # the product's (adapter.attention_splits of min(rows, index_topk))

    def plain_ms(mdl, spec: bool = False, **kw) -> float:
        dec = X.mla_decoder.MlaDecoder(mdl, caches, cos, sin, max_draft=3 if spec else 0, max_steps=4096,
                                       num_splits=splits, **kw)
        ms, runner = time_plain_step(dec, ctx)
        del runner
        if spec:  # MTP draft(s) (the draft layer's own indexer) + a verify with a top-k list per token
            for k in (1, 3):
                sp = capture(lambda k=k: dec.spec_step(k), before_capture=lambda: dec.set_state(1, ctx))
                dec.set_state(1, ctx)
                R[f"dsv32_shape_ctx128k_mtp_k{k}_step_ratio"] = r = time_replays(sp, 20) / ms
                log(f"  dsv3.2 MTP k={k}: {r:.2f}x the plain step")
                del sp
        del dec
        return ms

    try:
        ms = plain_ms(model, spec=True, index_caches=index_caches)
        R["dsv32_shape_ctx128k_plain_ms"], R["dsv32_shape_ctx128k_tok_s"] = ms, 1e3 / ms
        R["dsv32_shape_ctx128k_frac_roofline"] = roof_ms / ms
        log(f"  dsv3.2 shape at {ctx}: sparse plain step {ms:.3f} ms ({1e3 / ms:.1f} tok/s), roofline "
            f"{roof_ms:.3f} ms ({total / 1e9:.2f} GB), {roof_ms / ms:.3f} of it")
    except Exception:
        R["dsv32_shape_error"] = traceback.format_exc()[-1500:]
        log(R["dsv32_shape_error"])
    try:  # the same layers attending densely: the indexer's rows dropped from the input projection
        cut = s["index_dim"] + s["index_heads"]
        dense = dataclasses.replace(model, mtp=None,
                                    dims=dataclasses.replace(model.dims, index_topk=0, index_heads=0, index_dim=0),
                                    layers=[dataclasses.replace(l, wqkv_a=l.wqkv_a[:-cut], index=None, sparse=False)
                                            for l in model.layers])
        ms = plain_ms(dense)
        R["dsv32_dense_step_ctx128k_ms"] = ms
        dense_roof = (by["total"]) / (bw * 1e12) * 1e3
        R["dsv32_dense_step_ctx128k_frac_roofline"] = dense_roof / ms
        log(f"  same layers, dense attention at {ctx} ({splits} splits): {ms:.3f} ms ({1e3 / ms:.1f} tok/s); "
            f"sparse is {ms / R.get('dsv32_shape_ctx128k_plain_ms', float('nan')):.2f}x faster")
    except Exception:
        R["dsv32_dense_error"] = traceback.format_exc()[-1500:]
        log(R["dsv32_dense_error"])
    del model, caches, index_caches
    torch.cuda.empty_cache()
