"""GEMV micro-benchmarks and op-by-op GPU diagnostics for bench/decode_gpu.py (Llama-3-8B shape).

``micro_gemv``: each projection's kernel over all layers' distinct weights in one CUDA graph, every tile
candidate and cuBLAS, us per launch and TB/s. ``diagnose``: every fast-path kernel against its torch
twin on identical inputs at full shape, then layers chained, as relative L2 / max abs / fraction of
elements that differ.
"""

from __future__ import annotations

import torch

from decode_gpu import LLAMA_ROPE, capture, log, make_slot, rope_tables, time_graph

MICRO_TILES = {  # (block_n, block_k, num_warps, num_stages); runs 1-3: deep pipelines (stages 4-6) win
    "qkv": [(8, 256, 4, 6), (8, 256, 4, 8), (16, 256, 4, 8), (4, 256, 4, 8)],
    "o": [(16, 256, 4, 6), (16, 256, 4, 8), (32, 256, 4, 6), (16, 128, 4, 8)],
    "gate_up": [(4, 512, 4, 6), (8, 256, 4, 8), (4, 256, 4, 8), (8, 512, 4, 6)],
    "down": [(16, 512, 4, 5), (16, 512, 4, 6), (32, 512, 8, 4), (16, 256, 4, 8)],
    "lm_head": [(32, 256, 4, 4), (32, 256, 4, 6), (64, 256, 8, 4)],
}


def micro_gemv(X, model, s, k_caches, v_caches, cos, sin) -> dict:
    """Per projection: us per launch and TB/s for each tile and for cuBLAS, over all layers' weights."""
    G, S = X.gemv, X.smallops
    h, hq, hkv, d, inter = s["hidden"], s["hq"], s["hkv"], s["d"], s["inter"]
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(h, device=dev, dtype=dt)
    xa = torch.randn(hq * d, device=dev, dtype=dt)
    xi = torch.randn(inter, device=dev, dtype=dt)
    q = torch.empty(hq * d, device=dev, dtype=dt)
    act = torch.empty(inter, device=dev, dtype=dt)
    hres = torch.empty(h, device=dev, dtype=dt)
    logits = torch.empty(s["vocab"], device=dev, dtype=torch.float32)
    pos = torch.tensor([100], dtype=torch.int32, device=dev)
    L = model.layers
    nbytes = {"qkv": L[0].wqkv.numel() * 2, "o": L[0].wo.numel() * 2, "gate_up": L[0].w_gate_up.numel() * 2,
              "down": L[0].w_down.numel() * 2, "lm_head": model.lm_head.numel() * 2}

    def triton_fn(name, t):
        kw = dict(block_n=t[0], block_k=t[1], num_warps=t[2], stages=t[3])
        if name == "qkv":
            return lambda: [G.gemv_qkv_rope(x, l.wqkv, l.attn_norm, 1e-5, q, k_caches[i], v_caches[i], pos, cos, sin,
                                            num_q_heads=hq, num_kv_heads=hkv, head_dim=d, **kw) for i, l in enumerate(L)]
        if name == "o":
            return lambda: [G.gemv(xa, l.wo, hres, residual=hres, **kw) for l in L]
        if name == "gate_up":
            return lambda: [G.gemv_silu(x, l.w_gate_up, act, norm_w=l.mlp_norm, **kw) for l in L]
        if name == "down":
            return lambda: [G.gemv(xi, l.w_down, hres, residual=hres, **kw) for l in L]
        return lambda: [G.gemv(x, model.lm_head, logits, norm_w=model.final_norm, **kw) for _ in range(4)]

    def cublas_fn(name):
        if name == "lm_head":
            return lambda: [torch.matmul(x.view(1, -1), model.lm_head.t()) for _ in range(4)]
        attr = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}[name]
        inp = {"qkv": x, "o": xa, "gate_up": x, "down": xi}[name]
        return lambda: [torch.matmul(inp.view(1, -1), getattr(l, attr).t()) for l in L]

    out = {}
    for name, tiles in MICRO_TILES.items():
        n_launch = 4 if name == "lm_head" else len(L)
        res = {}
        for label, fn in [("cublas", cublas_fn(name))] + [(str(t), triton_fn(name, t)) for t in tiles]:
            try:
                g = capture(fn)
                ms = time_graph(g, iters=20)
                us = ms * 1e3 / n_launch
                res[label] = {"us": round(us, 2), "TBps": round(nbytes[name] / (us * 1e-6) / 1e12, 3)}
                del g
            except Exception as e:  # a tile that fails to compile is reported, not fatal
                res[label] = {"error": repr(e)[:200]}
        best = min((k for k in res if k != "cublas" and "us" in res[k]), key=lambda k: res[k]["us"], default=None)
        out[name] = {"results": res, "best_triton": best}
        log(f"  micro {name:8s} cublas {res['cublas'].get('us')} us; best triton {best} "
            f"{res[best]['us'] if best else None} us ({res[best]['TBps'] if best else None} TB/s)")
    return out



def _cmp(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().flatten(), b.float().flatten()
    return {"rel_l2": ((a - b).norm() / b.norm()).item(), "max_abs": (a - b).abs().max().item(),
            "frac_diff": (a != b).float().mean().item()}


def diagnose(X, model, s, ctx: int = 1024) -> dict:
    """Kernel-by-kernel and layer-by-layer agreement of the fast path with the torch twins (GPU, full shape)."""
    G, L = X.gemv, model.layers
    dev, dt = "cuda", torch.bfloat16
    out: dict = {}
    x = torch.randn(s["hidden"], device=dev, dtype=dt)
    xa = torch.randn(s["hq"] * s["d"], device=dev, dtype=dt)
    o = torch.empty(s["hidden"], device=dev, dtype=dt)
    G.gemv(xa, L[0].wo, o, block_n=8, block_k=512, stages=3)
    out["gemv_o"] = _cmp(o, X.reference.linear(xa, L[0].wo))
    out["ref_linear_mm_vs_mv"] = _cmp(X.reference.linear(xa, L[0].wo), torch.mv(L[0].wo.float(), xa.float()).to(dt))
    act = torch.empty(s["inter"], device=dev, dtype=dt)
    G.gemv_silu(x, L[0].w_gate_up, act, norm_w=L[0].mlp_norm, block_n=16, block_k=512, stages=3)
    out["gemv_silu"] = _cmp(act, X.reference.silu_mul(X.reference.linear(X.reference.rms_norm(x, L[0].mlp_norm, 1e-5),
                                                                          L[0].w_gate_up)))
    lg = torch.empty(s["vocab"], device=dev, dtype=torch.float32)
    G.gemv(x, model.lm_head, lg, norm_w=model.final_norm, block_n=16, block_k=512, stages=3)
    out["gemv_lm_head"] = _cmp(lg, X.reference.rms_norm(x, model.final_norm, 1e-5).float() @ model.lm_head.float().T)
    mt = ctx + 8
    _, kc, vc = make_slot(s, mt, ctx, seed=3)
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], mt)
    cb, sb = cos.cuda().to(dt), sin.cuda().to(dt)
    q = torch.empty(s["hq"] * s["d"], device=dev, dtype=dt)
    pos = torch.tensor([ctx], dtype=torch.int32, device=dev)
    G.gemv_qkv_rope(x, L[0].wqkv, L[0].attn_norm, 1e-5, q, kc[0], vc[0], pos, cb, sb, num_q_heads=s["hq"],
                    num_kv_heads=s["hkv"], head_dim=s["d"], block_n=16, block_k=512, stages=3)
    qkv = X.reference.linear(X.reference.rms_norm(x, L[0].attn_norm, 1e-5), L[0].wqkv).view(-1, s["d"])
    qr = X.reference.rope(qkv[: s["hq"]], cb[ctx], sb[ctx])
    kr = X.reference.rope(qkv[s["hq"]: s["hq"] + s["hkv"]], cb[ctx], sb[ctx])
    out["qkv_rope_q"] = _cmp(q, qr)
    out["qkv_rope_k"] = _cmp(kc[0][ctx], kr)
    out["qkv_rope_v"] = _cmp(vc[0][ctx], qkv[s["hq"] + s["hkv"]:])
    attn = X.attention.DecodeAttention(num_q_heads=s["hq"], num_kv_heads=s["hkv"], d_main=s["d"], d_v=s["d"],
                                       device=dev)
    ao = torch.empty(s["hq"] * s["d"], device=dev, dtype=dt)
    attn(qr.reshape(-1).contiguous(), kc[0], vc[0], pos, ao, stride_kt=s["hkv"] * s["d"], stride_vt=s["hkv"] * s["d"])
    out["attention"] = _cmp(ao, X.reference.attention(qr[None], kc[0], vc[0], ctx, s["d"] ** -0.5))
    # layer 0, op by op on identical inputs (the tuned tiles), then layers chained
    d, hq, hkv = s["d"], s["hq"], s["hkv"]
    _, kc, vc = make_slot(s, mt, ctx, seed=4)
    dec = X.GqaDecoder(model, kc, vc, cos, sin, X.FastOptions(), max_steps=mt)
    dec.set_state(5, ctx)
    h0 = dec.residual.clone()
    lw = L[0]
    G.gemv_qkv_rope(dec.residual, lw.wqkv, lw.attn_norm, 1e-5, dec.query, kc[0], vc[0], dec.pos, dec.cos, dec.sin,
                    num_q_heads=hq, num_kv_heads=hkv, head_dim=d, **dec.tile_kwargs("qkv"))
    qkv = X.reference.linear(X.reference.rms_norm(h0, lw.attn_norm, 1e-5), lw.wqkv).view(-1, d)
    ops = {"q": _cmp(dec.query, X.reference.rope(qkv[:hq], dec.cos[ctx], dec.sin[ctx])),
           "k": _cmp(kc[0][ctx], X.reference.rope(qkv[hq:hq + hkv], dec.cos[ctx], dec.sin[ctx])),
           "v": _cmp(vc[0][ctx], qkv[hq + hkv:])}
    dec.attn(dec.query, kc[0], vc[0], dec.pos, dec.attn_out, stride_kt=hkv * d, stride_vt=hkv * d)
    ops["attn"] = _cmp(dec.attn_out, X.reference.attention(dec.query.view(1, hq, d), kc[0], vc[0], ctx, d ** -0.5))
    h1 = h0.clone()
    G.gemv(dec.attn_out, lw.wo, h1, residual=h1, **dec.tile_kwargs("o"))
    ops["o_residual"] = _cmp(h1, h0 + X.reference.linear(dec.attn_out, lw.wo))
    G.gemv_silu(h1, lw.w_gate_up, dec.act, norm_w=lw.mlp_norm, eps=1e-5, **dec.tile_kwargs("gate_up"))
    ops["gate_up_silu"] = _cmp(dec.act, X.reference.silu_mul(X.reference.linear(X.reference.rms_norm(h1, lw.mlp_norm, 1e-5),
                                                                                   lw.w_gate_up)))
    h2 = h1.clone()
    G.gemv(dec.act, lw.w_down, h2, residual=h2, **dec.tile_kwargs("down"))
    ops["down_residual"] = _cmp(h2, h1 + X.reference.linear(dec.act, lw.w_down))
    lg = torch.empty(s["vocab"], device=dev)
    G.gemv(h2, model.lm_head, lg, norm_w=model.final_norm, eps=1e-5, **dec.tile_kwargs("lm_head"))
    ops["lm_head"] = _cmp(lg, X.reference.rms_norm(h2, model.final_norm, 1e-5).float() @ model.lm_head.float().T)
    out["layer0_ops"] = ops
    _, kc, vc = make_slot(s, mt, ctx, seed=4)
    kr_, vr_ = [k.clone() for k in kc], [v.clone() for v in vc]
    dec = X.GqaDecoder(model, kc, vc, cos, sin, X.FastOptions(), max_steps=mt)
    dec.set_state(5, ctx)
    h = model.embed[5]
    layers = {}
    for i in range(len(L)):
        dec.layer(i)
        h = X.llama.reference_layer(model, i, h, kr_[i], vr_[i], cb[ctx], sb[ctx], ctx,
                                    norm_late=X.FastOptions().norm_late)
        if i in (0, 1, 2, 3, 7, 15, 31):
            layers[i] = _cmp(dec.residual, h)
    out["layers"] = layers
    return out
