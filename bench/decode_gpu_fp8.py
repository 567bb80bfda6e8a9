"""FP8 batch-1 decode on one GPU: the Llama-3-8B shape with compressed-tensors per-channel FP8 weights
(lm_head bf16) against the bf16 fast path, in the same run.

Random weights (decode_gpu.build_llama, trained-like greedy margins planted on the head), quantized
per output channel as llm-compressor's FP8 schemes do (scale = amax / 448); the dequantized bf16
copy is the reference. Parts, all in one call:
- copy bandwidth (the roofline's ceiling);
- bf16 fast path step at 1K context (default options): ``llama8b_bf16_ctx1k_tok_s``;
- FP8 step (cuda/fp8.py Fp8GqaDecoder) at 1K over the variants in FP8_VARIANTS, FP8_DYNAMIC activations:
  ``llama8b_fp8_ctx1k_tok_s``, ``llama8b_fp8_ctx1k_frac_roofline`` (bytes the step reads: FP8 weights +
  their scales + bf16 norms, lm_head and one embedding row + KV), ``llama8b_fp8_over_bf16``;
  weight-only FP8 (no activation rounding) as a variant;
- block-scaled FP8 (128 x 128, activations rounded per block: Qwen's FP8 releases' format) one slot at 1K:
  ``llama8b_fp8block_ctx1k_tok_s``, ``_frac_roofline``, ``_over_bf16``, its logits against its dequantized reference;
- correctness, 64 steps teacher-forced at 1K: FP8 logits against the dequantized bf16 reference step
  (``llama8b_fp8_logits_max_rel_err`` < 0.02), greedy tokens identical, both activation modes;
- 32K context, FP8 weights and bf16 KV: ``llama8b_fp8_ctx32k_tok_s`` (and bf16's);
- the batched step (``batched``; ``FP8_BATCH_ONLY=1``: these parts alone) with bf16 weights + FP8 KV
  (``llama8b_fp8kv_*``), FP8 weights + bf16 KV (``llama8b_fp8_batch*``), both FP8 (``llama8b_fp8_fp8kv_*``):
  4 / 8 rows over the one-row step, rows' tokens as alone;
- FP8 KV cache (vLLM's E4M3 bytes, per-layer k/v scales, cuda/kvfp8.py): FP8 weights + FP8 KV at 32K
  ``llama8b_fp8kv_ctx32k_tok_s`` and at 1K ``llama8b_fp8kv_ctx1k_tok_s``, bf16 weights + FP8 KV at 32K
  ``llama8b_bf16_fp8kv_ctx32k_tok_s``; correctness of FP8 weights + FP8 KV against the dequantized
  reference step reading the same FP8 cache dequantized (``llama8b_fp8kv_correctness``).

    python bench/decode_gpu_fp8.py [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_gpu import (LLAMA8B, LLAMA_ROPE, build_llama, capture, copy_bandwidth, kv_bytes,  # noqa: E402
                        load_cuda_pkg, log, make_slot, plant_successor, rope_tables, time_graph)

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("wqkv", "wo", "w_gate_up", "w_down")
# FP8 step variants: FastOptions fields over the product's defaults ({}: the product). The QKV GEMV with its
# rope + stores fused (the default) against two launches (run K3: -34 us a step fused)
FP8_VARIANTS = {
    "product": {},
    "qkv_unfused": {"fp8_qkv_rope": False},
    "attn_one_launch": {"attn_one_launch": True},  # the attention's merge by its last split (run N2)
}
# gate/up tiles in the step (its prologue - the input's norm and activation scale - ran once a program, so once a
# wave of resident programs, until run G41 rounded its input once: the then product's 448 programs of 96 KB of pipeline
# buffers took two waves on 132 SMs)
# (run G16: (32, 256, 4, 3) 3.519 ms, the product until run G45; (32, 256, 4, 6) 3.615, (32, 256, 4, 4) 3.531,
# (64, 128, 4, 4) 3.688, (32, 512, 4, 2) 4.494, (64, 256, 4, 3) 8.180); the other projections' tiles likewise.
# Run G44 (H100) over the tiles before: QKV (8, 512, 4, 3) -22 us, gate/up (16, 256, 4, 3) -12, o and down's 8-row
# tiles +7..+25; run G45 (H200) over both of those: QKV (8, 256, 4, 6) +105 us, (8, 1024, 4, 3) +98, gate/up (16, 512,
# 4, 3) +70, (8, 512, 4, 3) +37, (16, 256, 4, 4) +65
for _name, _tile in (("gate_up", (32, 256, 4, 3)), ("o", (8, 512, 4, 3)), ("o", (16, 256, 4, 4)),
                     ("o", (8, 256, 4, 4)), ("down", (8, 1024, 4, 3)), ("down", (16, 512, 4, 4)),
                     ("down", (32, 512, 4, 3)), ("down", (8, 512, 4, 4)), ("qkv", (16, 512, 4, 3)),
                     ("qkv", (16, 256, 4, 4)), ("qkv", (8, 256, 4, 6)), ("qkv", (8, 1024, 4, 3)),
                     ("gate_up", (16, 512, 4, 3)), ("gate_up", (8, 512, 4, 3)), ("gate_up", (16, 256, 4, 4)),
                     ("o", (32, 512, 4, 3)), ("o", (32, 256, 4, 4)), ("down", (32, 1024, 4, 3))):
    FP8_VARIANTS[f"{_name}_" + "x".join(map(str, _tile))] = {"fp8_tiles": {_name: _tile}}  # over the product's
# the QKV and gate/up tiles before run G45 (G44's two faster tiles, together the product since: 2.701 against 2.671 ms
# on the H200, run G45)
FP8_VARIANTS["tiles_g43"] = {"fp8_tiles": {"qkv": (16, 512, 4, 3), "gate_up": (32, 256, 4, 3)}}
# each GEMV program norming and rounding the QKV and gate/up inputs itself (the product before run G41: 3.456 /
# 3.462 ms against 3.337 / 3.339 with the inputs rounded once, in alternated orders)
FP8_VARIANTS["round_in_gemv"] = {"fp8_round_once": False}
# o / down programs reducing their whole input for its scale (the product before run G43). Run G42 timed the scale's
# amax gathered by one atomic max a writer program into one float (3.483 ms against 3.341 without: the atomics'
# fences at every program's end) and, over it, the residual's rounding by the o / down GEMV's last program to finish
# in place of round_token's launch (3.493): both removed
FP8_VARIANTS["amax_in_gemv"] = {"fp8_amax_carry": False}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (w.float() / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def fp8_models(X, F, model):
    """(FP8 GqaModel, its per-layer scales, the dequantized bf16 GqaModel) of a bf16 GqaModel."""
    fl, dl, scales = [], [], []
    for lw in model.layers:
        q, d, s = {}, {}, {}
        for n in NAMES:
            q[n], s[n] = quantize(getattr(lw, n))
            d[n] = (q[n].float() * s[n][:, None]).to(torch.bfloat16)
        fl.append(replace(lw, **q))
        dl.append(replace(lw, **d))
        scales.append(F.Fp8Scales(**s))
    args = (model.embed, model.final_norm, model.lm_head, model.num_q_heads, model.num_kv_heads, model.head_dim,
            model.eps)
    return X.GqaModel(fl, *args), scales, X.GqaModel(dl, *args)


def fp8_block_models(X, F, model):
    """(FP8 GqaModel, its per-layer Fp8Scales holding fp8block.BlockFp8 projections, the dequantized bf16 GqaModel)
    of a bf16 GqaModel quantized in 128 x 128 blocks with activations rounded per block (Qwen's FP8 releases'
    format)."""
    fl, dl, scales = [], [], []
    for lw in model.layers:
        b = {n: X.fp8block.quantize(getattr(lw, n)) for n in NAMES}
        fl.append(replace(lw, **{n: v.w for n, v in b.items()}))
        dl.append(replace(lw, **{n: v.dequantize(torch.bfloat16) for n, v in b.items()}))
        scales.append(F.Fp8Scales(**b))
    args = (model.embed, model.final_norm, model.lm_head, model.num_q_heads, model.num_kv_heads, model.head_dim,
            model.eps)
    return X.GqaModel(fl, *args), scales, X.GqaModel(dl, *args)


PROJ = ("wqkv", "wo", "w_gate_up", "w_down")
# the block-scaled step's variants (FP8_BLOCK_ONLY): name -> Fp8GqaDecoder class attributes over the product's (a
# dict merges over the product's dict, None replaces it)
BLOCK_VARIANTS = {
    "product": {},
    "xq_off": {"XQ_TILES": None},  # each GEMV rounds its input itself (the form before quant_groups)
    "xq_qkv_rope_off": {"XQ_QKV_ROPE": False},  # the rope + stores by rope_cache_write after the QKV GEMV
    "xq_qkv_o_rows8": {"XQ_TILES": {"wqkv": (8, 512, 4, 3), "wo": (8, 512, 4, 3)}},  # G39: noisy, -0.6 / -2.8%
    "xq_rows8": {"XQ_TILES": {"wqkv": (8, 512, 4, 3), "wo": (8, 512, 4, 3), "w_down": (8, 1024, 4, 3)}},
}
# run G39 (the rope kernel then, ms, two alternated rounds): product 3.675 / 3.685, rope in the QKV GEMV 3.628 / 3.632
# (the product since), xq_off 4.605, gate/up 64 rows 3.911, (128, 128, 8, 2) 3.920, (128, 128, 8, 4) 3.698, QKV / o /
# down at 8 rows 3.645 / 3.641, at 32 rows 3.665, QKV and o at 8 rows 3.653 / 3.581, down at 32 rows 3.690, down
# (16, 512) 3.672.
# run G38 (gate/up (64, 128, 4, 4) then, ms): product 3.809, xq_off 4.533, o's input by quant_groups 3.857, xq_off with
# SiLU in torch 4.632, QKV / o / down at 8 rows 3.771, at 32 rows 3.770, K 256 3.901; gate/up (32, 256, 4, 3) 3.622,
# (16, 512, 4, 3) 3.694, (128, 128, 8, 4) 3.574, (128, 128, 8, 3) 3.567 (the product since), (64, 128, 8, 4) 3.647
# run G30 timed 8 and 16 rows a program for QKV, o and down (K 512 or 1024) and 16 for all four: +6..+34%; G31 32
# rows over K tiles of 256 or 128 (+3%, +31%), on 8 warps (+55%), 256 x 8 warps (+1%), 64 x 256 for all four -8.5%;
# G32 128 rows over 128 (+43..+44%; 8 warps +33%), 64 x 256 on 8 warps (+6%); G33 64 x 256 for gate/up alone -12.2%,
# with down too -6.8%, all four -8.5% (3 / 6 stages: -7.9 / -7.5%); G34 128 x 128 for gate/up alone -15.7% against
# G29's form; G35 (gate/up 128 x 128 by gemv_rows): 4.622 against G29's form 5.515 and G33's 4.907 ms (6 stages 4.676)
# (those with each GEMV rounding its own input per group: the tiles of BLOCK_TILES / BLOCK_ACT_ROWS)


def block_variants(X, F, dec_of, s: dict, R: dict, ctx: int, slot, mt: int, roof: float) -> None:
    """The block-scaled step on each of BLOCK_VARIANTS, alternated twice (``llama8b_fp8block_variants``: ms, best)."""
    cls = F.Fp8GqaDecoder
    names = {a for v in BLOCK_VARIANTS.values() for a in v}
    base = {a: getattr(cls, a) for a in names}
    out: dict = {k: [] for k in BLOCK_VARIANTS}
    for _ in range(2):
        for name, attrs in BLOCK_VARIANTS.items():
            for a, v in attrs.items():
                setattr(cls, a, {**base[a], **v} if isinstance(v, dict) and base[a] is not None else v)
            try:
                out[name].append(timing(dec_of, s, ctx, slot, mt))
            except Exception:  # noqa: BLE001 - a tile that does not compile
                out[name].append(float("inf"))
                log(traceback.format_exc()[-800:])
            finally:
                for a, v in base.items():
                    setattr(cls, a, v)
    best = {k: min(v) for k, v in out.items()}
    R["llama8b_fp8block_variants"] = {"ms": out, "best_ms": best,
                                      "frac_roofline": {k: roof / v for k, v in best.items()}}
    log("  fp8 block-scaled variants (best of 2, ms): " + ", ".join(f"{k} {v:.3f} ({roof / v:.3f})"
                                                                   for k, v in best.items()))


def block_part(X, F, model, s: dict, R: dict, ms_bf16: float, bw: float, profile: bool = False) -> None:
    """Block-scaled FP8 (``llama8b_fp8block_*``): the one-slot step (Fp8GqaDecoder's block layer: the DeepSeek
    family's block-scaled GEMVs) at 1K against the bytes it reads and the bf16 step of this run, and its logits
    against its dequantized bf16 reference step; ``profile``: its eager per-kernel time (PDL off) and the step on
    each of BLOCK_VARIANTS too (FP8_BLOCK_ONLY)."""
    bmodel, bscales, bdmodel = fp8_block_models(X, F, model)
    ctx, mt = 1024, 2048
    nbytes = F.fp8_bytes_per_step(bmodel, bscales)
    roof = (nbytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3

    def dec(kc, vc, cos, sin, mt_):
        return F.Fp8GqaDecoder(bmodel, kc, vc, cos, sin, X.FastOptions(), max_steps=mt_, scales=bscales, act_fp8=True)

    slot = make_slot(s, mt, ctx)
    ms = min(timing(dec, s, ctx, slot, mt) for _ in range(2))
    if profile:
        profile_steps(X, F, R, s, ctx, slot, mt, {"fp8block": lambda kc, vc, cos, sin, mt_: F.Fp8GqaDecoder(
            bmodel, kc, vc, cos, sin, X.FastOptions(pdl=False), max_steps=mt_, scales=bscales, act_fp8=True)})
        block_variants(X, F, dec, s, R, ctx, slot, mt, roof)
    del slot
    R["llama8b_fp8block_ctx1k_tok_s"], R["llama8b_fp8block_ctx1k_frac_roofline"] = 1e3 / ms, roof / ms
    R["llama8b_fp8block_over_bf16"] = ms_bf16 / ms
    log(f"  fp8 block-scaled {ms:.3f} ms {1e3 / ms:.1f} tok/s {roof / ms:.1%} of roofline, {ms_bf16 / ms:.2f}x bf16")
    R["llama8b_fp8block_correctness"] = c = correctness(X, dec, bdmodel, s, ctx, steps=32)
    log(f"  llama8b_fp8block_correctness: {c}")
    del bmodel, bscales, bdmodel
    torch.cuda.empty_cache()


KV_SCALES = (0.05, 0.02)  # per-layer (k_scale, v_scale) of the FP8-KV runs: N(0, 1) K/V land in E4M3's range


def fp8_slot(slot):
    """The bf16 slot's K/V as E4M3 bytes of x / scale (rounded to nearest: bench data), one tensor per layer."""
    _, kc, vc = slot
    k8 = [(k.float() / KV_SCALES[0]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) for k in kc]
    v8 = [(v.float() / KV_SCALES[1]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) for v in vc]
    return None, k8, v8


def kv8(n_layers: int) -> dict:
    return dict(kv_format="fp8_e4m3", kv_scales=[KV_SCALES] * n_layers)


def timing(make_dec, s: dict, ctx: int, slot, max_tokens: int, steps_per_replay: int = 8) -> float:
    """ms per token of the captured step at context ctx."""
    _, kc, vc = slot
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = make_dec(kc, vc, cos, sin, max_tokens)
    runner = capture(dec.step, steps_per_replay, before_capture=lambda: dec.set_state(1, ctx))
    dec.set_state(1, ctx)
    iters = max(1, min(40, (max_tokens - ctx - 16) // steps_per_replay - 6))
    ms = time_graph(runner, iters=iters, warmup=3) / steps_per_replay
    del runner, dec
    return ms


def profile_steps(X, F, R: dict, s: dict, ctx: int, slot, max_tokens: int, decs: dict) -> None:
    """Per-kernel device time of 3 eager steps of each decoder in ``decs`` (name -> make_dec), torch profiler:
    ``llama8b_profile_<name>`` rows (kernel, launches a step, us a step), slowest first."""
    from torch.profiler import ProfilerActivity, profile

    from decode_gpu_mla import kernel_rows  # bench/ is on sys.path when run as a script

    _, kc, vc = slot
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    for name, make_dec in decs.items():
        dec = make_dec(kc, vc, cos, sin, max_tokens)
        dec.set_state(1, ctx)
        dec.step()
        torch.cuda.synchronize()
        dec.set_state(1, ctx)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dec.step()
            torch.cuda.synchronize()
        rows = kernel_rows(prof, 3)
        R[f"llama8b_profile_{name}"] = rows[:20]
        log(f"  profile {name}: {sum(r[2] for r in rows):.0f} us in {sum(r[1] for r in rows)} kernels a step; "
            + "; ".join(f"{n} x{c} {t}us" for n, c, t in rows[:12]))
        del dec


def correctness(X, make_dec, ref_model, s: dict, ctx: int, steps: int = 64, kv_fp8: bool = False) -> dict:
    """The FP8 step (graph, one step a replay) against the dequantized reference step, teacher-forced
    (``kv_fp8``: the step over an FP8 cache, the reference over the same cache dequantized to bf16, its
    own new rows quantized and dequantized the same way after each step)."""
    max_tokens = ctx + steps + 8
    _, kc, vc = make_slot(s, max_tokens, ctx, seed=7)
    if kv_fp8:
        _, kc, vc = fp8_slot((None, kc, vc))
        kr = [(k.view(torch.float8_e4m3fn).float() * KV_SCALES[0]).to(torch.bfloat16) for k in kc]
        vr = [(v.view(torch.float8_e4m3fn).float() * KV_SCALES[1]).to(torch.bfloat16) for v in vc]
    else:
        kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    dec = make_dec(kc, vc, cos, sin, max_tokens)
    runner = capture(dec.step, before_capture=lambda: dec.set_state(5, ctx))
    dec.set_state(5, ctx)
    tok, mismatches, first, max_rel, gaps = 5, 0, None, 0.0, []
    cb, sb = cos.cuda(), sin.cuda()
    for i in range(steps):
        runner()
        ref = X.reference_step(ref_model, kr, vr, cb, sb, tok, ctx + i)
        if kv_fp8:  # the reference's new row as the FP8 cache holds it (what the step wrote)
            for j in range(len(kr)):
                kr[j][ctx + i] = (kc[j][ctx + i].view(torch.float8_e4m3fn).float() * KV_SCALES[0]).to(torch.bfloat16)
                vr[j][ctx + i] = (vc[j][ctx + i].view(torch.float8_e4m3fn).float() * KV_SCALES[1]).to(torch.bfloat16)
        max_rel = max(max_rel, ((dec.logits - ref).abs().max() / ref.abs().max()).item())
        ft, rt = int(dec.token.item()), int(ref.argmax().item())
        top2 = ref.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        if ft != rt:
            mismatches += 1
            first = i if first is None else first
        tok = ft
    del runner, dec
    return {"steps": steps, "mismatches": mismatches, "first_mismatch": first, "logits_max_rel_err": max_rel,
            "ref_top2_gap_min": min(gaps), "ref_top2_gap_median": sorted(gaps)[len(gaps) // 2],
            "tokens_identical": mismatches == 0, "logits_ok": max_rel < 2e-2}


def batched(X, F, model, s: dict, R: dict, key: str, fp8: tuple | None = None, kv_fp8: bool = True,
            ctx: int = 1024, steps: int = 8) -> None:
    """The batched step against the one-row step, 1K: graph-timed ms of 4 / 8 rows over one row's
    (``llama8b_{key}_batch4_step_ratio`` / ``..._batch8_...``), and every row's greedy tokens over ``steps`` steps
    against the one-row step's from the same cache (``llama8b_{key}_batch_tokens_equal``). ``fp8``: (scales,
    act) of an FP8 ``model``; ``kv_fp8``: an E4M3 KV cache."""
    L, max_tokens = s["layers"], ctx + 256
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = torch.uint8 if kv_fp8 else torch.bfloat16
    kv = torch.empty(L, 2, 9, max_tokens, s["hkv"], s["d"], dtype=dt, device="cuda")
    for i in range(L):
        for j, sc in enumerate(KV_SCALES):
            x = torch.randn(9, max_tokens, s["hkv"], s["d"], device="cuda", generator=g)
            kv[i, j] = (x / sc).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) if kv_fp8 else x
    start = kv.clone()
    cos, sin = rope_tables(LLAMA_ROPE, s["d"], max_tokens)
    opts, kvf = X.FastOptions(), (kv8(L) if kv_fp8 else {})
    w8 = dict(fp8_scales=fp8[0], act_fp8=fp8[1]) if fp8 else {}

    def single(slot: int):
        args = (model, [kv[i, 0, slot] for i in range(L)], [kv[i, 1, slot] for i in range(L)], cos, sin, opts)
        if fp8:
            return F.Fp8GqaDecoder(*args, max_steps=max_tokens, scales=fp8[0], act_fp8=fp8[1], **kvf)
        return X.GqaDecoder(*args, max_steps=max_tokens, **kvf)

    def batch(b: int):
        return X.GqaBatchDecoder(model, [kv[i, 0] for i in range(L)], [kv[i, 1] for i in range(L)], cos, sin, b, opts,
                                 max_steps=max_tokens, scratch_slot=8, **kvf, **w8)

    dec = single(0)
    runner = capture(dec.step, 1, before_capture=lambda: dec.set_state(1, ctx))
    dec.set_state(1, ctx)
    one = time_graph(runner, iters=40, warmup=3)
    del runner, dec
    R[f"llama8b_{key}_single_ms"] = one
    for b in (4, 8):
        kv.copy_(start)
        dec = batch(b)
        arm = lambda dec=dec, b=b: dec.set_rows([1 + r for r in range(b)], [ctx] * b, list(range(b)))  # noqa: E731
        runner = capture(dec.step, 1, before_capture=arm)
        arm()
        ms = time_graph(runner, iters=40, warmup=3)
        R[f"llama8b_{key}_batch{b}_ms"] = ms
        R[f"llama8b_{key}_batch{b}_step_ratio"] = ms / one
        log(f"  {key}, 1K: batch {b} {ms:.3f} ms against one row {one:.3f} ms ({ms / one:.3f}x)")
        del runner, dec
    kv.copy_(start)  # tokens: 4 rows together, then each alone from the same cache
    dec = batch(4)
    dec.set_rows([1 + r for r in range(4)], [ctx] * 4, list(range(4)))
    for _ in range(steps):
        dec.step()
    together = dec.out_tokens[:, :steps].tolist()
    del dec
    equal = True
    for r in range(4):
        kv.copy_(start)
        dec = single(r)
        dec.set_state(1 + r, ctx)
        for _ in range(steps):
            dec.step()
        equal &= dec.out_tokens[:steps].tolist() == together[r]
        del dec
    R[f"llama8b_{key}_batch_tokens_equal"] = equal
    log(f"  {key}: 4 rows together give each row's tokens alone ({steps} steps): {equal}")
    del kv, start
    torch.cuda.empty_cache()


def run(R: dict) -> None:
    X = load_cuda_pkg()
    F = importlib.import_module("xl_cuda.fp8")
    if os.environ.get("FP8_PROBE_NO_ACT_ROUND"):  # a timing probe, not a product form (its logits are wrong): the
        # block-scaled GEMVs without the per-group activation rounding, so what that rounding costs in the step
        import triton
        import triton.language as tl

        @triton.jit
        def unrounded(x):
            return x.to(tl.float32)

        importlib.import_module("xl_cuda.fp8block").round_groups = F.round_groups = unrounded
        R["probe_no_act_round"] = True
    s = LLAMA8B
    R["copy_bw_TBps"] = bw = copy_bandwidth()
    log(f"copy bandwidth {bw:.3f} TB/s")
    t0 = time.time()
    model = build_llama(X, s)
    plant_successor(model, s)  # trained-like greedy margins
    fmodel, scales, dmodel = fp8_models(X, F, model)
    torch.cuda.synchronize()
    bf16_bytes, fp8_bytes = model.weight_bytes(), F.fp8_bytes_per_step(fmodel, scales)
    R["llama8b_bf16_weight_GB"], R["llama8b_fp8_weight_GB"] = bf16_bytes / 1e9, fp8_bytes / 1e9
    batch_parts = () if os.environ.get("FP8_PROFILE") else (
        ("fp8kv", model, None, True), ("fp8", fmodel, (scales, True), False), ("fp8_fp8kv", fmodel, (scales, True), True))
    for key, m, f8, kvf in batch_parts:
        try:  # the batched step: bf16 weights + FP8 KV, FP8 weights + bf16 KV, both FP8
            batched(X, F, m, s, R, key, fp8=f8, kv_fp8=kvf)
        except Exception:  # noqa: BLE001 - the other parts still run
            R[f"llama8b_{key}_batch_error"] = traceback.format_exc()[-1500:]
            log(R[f"llama8b_{key}_batch_error"])
    if os.environ.get("FP8_BATCH_ONLY"):  # the batched parts alone (a short run)
        return
    log(f"built + quantized in {time.time() - t0:.1f} s: bf16 step reads {bf16_bytes / 1e9:.3f} GB, "
        f"FP8 step {fp8_bytes / 1e9:.3f} GB (+ KV)")
    base = X.FastOptions()
    R["fast_options_pdl"] = base.pdl

    def bf16_dec(kc, vc, cos, sin, mt, opts=base):
        return X.GqaDecoder(model, kc, vc, cos, sin, opts, max_steps=mt)

    def fp8_dec(opts, act=True, kv=None):
        return lambda kc, vc, cos, sin, mt: F.Fp8GqaDecoder(fmodel, kc, vc, cos, sin, opts, max_steps=mt,
                                                            scales=scales, act_fp8=act, **(kv or {}))

    def bf16_fp8kv_dec(kc, vc, cos, sin, mt):
        return X.GqaDecoder(model, kc, vc, cos, sin, base, max_steps=mt, **kv8(s["layers"]))

    ctx, mt = 1024, 2048
    slot = make_slot(s, mt, ctx)
    roof_bf16 = (bf16_bytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3
    roof_fp8 = (fp8_bytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3
    R["llama8b_fp8_ctx1k_roofline_tok_s"] = 1e3 / roof_fp8
    ms_bf16 = min(timing(bf16_dec, s, ctx, slot, mt) for _ in range(2))
    R["llama8b_bf16_ctx1k_tok_s"], R["llama8b_bf16_ctx1k_frac_roofline"] = 1e3 / ms_bf16, roof_bf16 / ms_bf16
    log(f"  bf16 step {ms_bf16:.3f} ms {1e3 / ms_bf16:.1f} tok/s {roof_bf16 / ms_bf16:.1%} of roofline")
    if os.environ.get("FP8_BLOCK_ONLY"):  # the block-scaled part alone, with its per-kernel profile (a short run)
        block_part(X, F, model, s, R, ms_bf16, bw, profile=True)
        return
    R["llama8b_fp8_variants"] = V = {}
    made = {}
    only = os.environ.get("FP8_VARIANTS_ONLY")  # "a,b,a": these variants alone, in this order (a short run; a name
    # given again is measured again, under "<name>_2", "<name>_3", ...)
    names = only.split(",") if only else list(FP8_VARIANTS)
    for i, name in enumerate(names):
        fields = FP8_VARIANTS[name]
        if (n := names[:i].count(name)):
            name = f"{name}_{n + 1}"
        if "fp8_tiles" in fields:  # some projections' tiles over the product's
            fields = dict(fields, fp8_tiles={**base.fp8_tiles, **fields["fp8_tiles"]})
        opts = made[name] = replace(base, **fields)
        try:
            ms = min(timing(fp8_dec(opts), s, ctx, slot, mt) for _ in range(2))
            V[name] = {"ms": ms, "tok_s": 1e3 / ms, "frac_roofline": roof_fp8 / ms}
            log(f"  fp8 {name:12s} {ms:.3f} ms {1e3 / ms:.1f} tok/s {roof_fp8 / ms:.1%} of roofline")
        except Exception:
            V[name] = {"error": traceback.format_exc()[-800:]}
            log(f"  fp8 {name} FAILED\n{traceback.format_exc()[-1500:]}")
    ok = {k: v for k, v in V.items() if "ms" in v}
    if not ok:
        return
    best = min(ok, key=lambda k: ok[k]["ms"])
    R["llama8b_fp8_best_variant"] = best
    R["llama8b_fp8_best_variant_ctx1k_frac_roofline"] = ok[best]["frac_roofline"]
    # the headline keys and the runs below: the product's defaults (what the decode node serves), unless only
    # other variants ran
    head = os.environ.get("FP8_HEADLINE") or ("product" if "product" in ok else best)  # FP8_HEADLINE: a variant's
    # logits and per-kernel profile in place of the product's
    bopts = made[head]
    R["llama8b_fp8_headline_variant"] = head
    R["llama8b_fp8_ctx1k_tok_s"] = ok[head]["tok_s"]
    R["llama8b_fp8_ctx1k_frac_roofline"] = ok[head]["frac_roofline"]
    R["llama8b_fp8_over_bf16"] = ms_bf16 / ok[head]["ms"]
    if os.environ.get("FP8_PROFILE"):  # per-kernel device time of eager steps (PDL off: each kernel alone), and the
        # headline's logits against the dequantized reference; then stop
        profile_steps(X, F, R, s, ctx, slot, mt, {"fp8": fp8_dec(replace(bopts, pdl=False)),
                                                  "bf16": lambda *a: bf16_dec(*a, opts=replace(base, pdl=False))})
        del slot
        R["llama8b_fp8_correctness"] = c = correctness(X, fp8_dec(bopts), dmodel, s, ctx)
        log(f"  llama8b_fp8_correctness: {c}")
        return
    try:
        ms = min(timing(fp8_dec(bopts, act=False), s, ctx, slot, mt) for _ in range(2))
        R["llama8b_fp8_weight_only_ctx1k_tok_s"] = 1e3 / ms
        log(f"  fp8 weight-only ({head}) {ms:.3f} ms {1e3 / ms:.1f} tok/s")
    except Exception:
        log(traceback.format_exc()[-1500:])
    try:  # FP8 weights + FP8 KV at 1K
        slot8 = fp8_slot(slot)
        ms = min(timing(fp8_dec(bopts, kv=kv8(s["layers"])), s, ctx, slot8, mt) for _ in range(2))
        R["llama8b_fp8kv_ctx1k_tok_s"] = 1e3 / ms
        log(f"  fp8 weights + fp8 KV ({head}) 1K {ms:.3f} ms {1e3 / ms:.1f} tok/s")
        del slot8
    except Exception:
        log(traceback.format_exc()[-1500:])
    del slot
    try:
        R["llama8b_fp8kv_correctness"] = c = correctness(X, fp8_dec(bopts, kv=kv8(s["layers"])), dmodel, s, ctx,
                                                         kv_fp8=True)
        log(f"  llama8b_fp8kv_correctness: {c}")
    except Exception:
        R["llama8b_fp8kv_correctness"] = {"error": traceback.format_exc()[-800:]}
        log(traceback.format_exc()[-1500:])
    for act in (True, False):
        key = "llama8b_fp8_correctness" + ("" if act else "_weight_only")
        try:
            R[key] = c = correctness(X, fp8_dec(bopts, act), dmodel, s, ctx)
            log(f"  {key}: {c}")
        except Exception:
            R[key] = {"error": traceback.format_exc()[-800:]}
            log(traceback.format_exc()[-1500:])
    c = R.get("llama8b_fp8_correctness", {})
    R["llama8b_fp8_logits_max_rel_err"] = c.get("logits_max_rel_err")
    R["llama8b_fp8_tokens_identical"] = c.get("tokens_identical")
    del dmodel
    torch.cuda.empty_cache()
    try:
        block_part(X, F, model, s, R, ms_bf16, bw)
    except Exception:
        R["llama8b_fp8block_error"] = traceback.format_exc()[-1500:]
        log(R["llama8b_fp8block_error"])
    ctx, mt = 32768, 32768 + 512
    try:
        slot = make_slot(s, mt, ctx)
        ms8 = min(timing(fp8_dec(bopts), s, ctx, slot, mt) for _ in range(2))
        R["llama8b_fp8_ctx32k_tok_s"] = 1e3 / ms8
        R["llama8b_fp8_ctx32k_frac_roofline"] = (fp8_bytes + kv_bytes(s, ctx)) / (bw * 1e12) * 1e3 / ms8
        ms16 = timing(bf16_dec, s, ctx, slot, mt)
        R["llama8b_bf16_ctx32k_tok_s_same_run"] = 1e3 / ms16
        log(f"  ctx 32K: fp8 {1e3 / ms8:.1f} tok/s ({R['llama8b_fp8_ctx32k_frac_roofline']:.1%}), bf16 {1e3 / ms16:.1f}")
        R["llama8b_fp8_ctx32k_attn_tiles"] = T = {}  # bf16 KV: the attention's (num_splits, block_s) at 32K
        for ns, bs in ((32, 64), (64, 64), (32, 128)):
            T[f"{bs}x{ns}"] = t_ms = timing(fp8_dec(replace(bopts, num_splits=ns, block_s=bs)), s, ctx, slot, mt)
            log(f"    bf16 KV attention tile block_s {bs} x {ns} splits: {1e3 / t_ms:.1f} tok/s")
    except Exception:
        log(traceback.format_exc()[-1500:])
    try:  # the same slot's K/V as FP8 bytes (half the KV bytes): FP8 weights + FP8 KV, bf16 weights + FP8 KV
        slot8 = fp8_slot(slot)
        del slot
        torch.cuda.empty_cache()
        ms8kv = min(timing(fp8_dec(bopts, kv=kv8(s["layers"])), s, ctx, slot8, mt) for _ in range(2))
        R["llama8b_fp8kv_ctx32k_tok_s"] = 1e3 / ms8kv
        R["llama8b_fp8kv_ctx32k_frac_roofline"] = (fp8_bytes + kv_bytes(s, ctx) / 2) / (bw * 1e12) * 1e3 / ms8kv
        R["llama8b_fp8kv_ctx32k_attn_tiles"] = T = {}
        for bs, ns in ((128, 32), (64, 32), (32, 128), (64, 64)):  # (block_s, num_splits)
            o = replace(bopts, fp8_kv_attn=(ns, bs))  # FastOptions.fp8_kv_attn: the product's is (32, 128)
            T[f"{bs}x{ns}"] = t_ms = timing(fp8_dec(o, kv=kv8(s["layers"])), s, ctx, slot8, mt)
            log(f"    fp8 KV attention tile block_s {bs} x {ns} splits: {1e3 / t_ms:.1f} tok/s")
        ms16kv = timing(bf16_fp8kv_dec, s, ctx, slot8, mt)
        R["llama8b_bf16_fp8kv_ctx32k_tok_s"] = 1e3 / ms16kv
        if "llama8b_fp8_ctx32k_tok_s" in R:
            R["llama8b_fp8kv_over_fp8_ctx32k"] = R["llama8b_fp8kv_ctx32k_tok_s"] / R["llama8b_fp8_ctx32k_tok_s"]
        log(f"  ctx 32K fp8 KV: fp8 weights {1e3 / ms8kv:.1f} tok/s "
            f"({R['llama8b_fp8kv_ctx32k_frac_roofline']:.1%}), bf16 weights {1e3 / ms16kv:.1f}")
    except Exception:
        log(traceback.format_exc()[-1500:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_gpu_fp8.json"))
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    R: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        run(R)
    except Exception:
        R["error"] = traceback.format_exc()[-1500:]
        log(R["error"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(R, indent=1, default=str))
    keys = [k for k in R if k.startswith("llama8b_") and not isinstance(R[k], dict)]
    log("\n".join(f"{k:42s} {R[k]:.4g}" if isinstance(R[k], float) else f"{k:42s} {R[k]}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
