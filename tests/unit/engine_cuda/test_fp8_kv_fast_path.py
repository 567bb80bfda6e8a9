"""FP8 KV cache on the Llama-family fast path, its Triton kernels interpreted on CPU (conftest.py).

- ``kvfp8.fp8_kv_bits`` stores the bytes ``kvquant.quantize`` stores (truncated as vLLM's CPU cache writer,
  or rounded to nearest as its CUDA writers), for every finite bf16 value (bf16 subnormals aside, below
  2^-126: a compiled multiply may flush them) and random ones, E4M3 and E5M2, unit and non-unit scales.
- The step's K/V writers (the QKV GEMV epilogue, the rope + cache-write kernel, with and without Qwen3's
  q/k norm) write the bytes of the bf16 K/V they write to a bf16 cache, quantized as the reference does.
- The attention reads fp8 * scale: within fp32 rounding of attention over the dequantized values.
- Through the Engine API (``kv_cache_dtype``): greedy tokens on the fast path equal the FP8-KV reference
  step's, bf16 and FP8 weights, Llama and Qwen3, with non-unit k/v scales; slots decoding together in
  the batched step (FP8 KV and/or FP8 weights, FP8_DYNAMIC or weight-only) get the tokens and write the
  K/V bytes they do alone.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from safetensors.torch import load_file, save_file

from infra.tinymodel_fp8 import quantize_checkpoint
from services.decode.engine import Engine
from services.decode.engine import engine as engine_mod
from services.decode.engine.cuda import gemv, reference, smallops
from services.decode.engine.cuda.attention import DecodeAttention
from services.decode.engine.cuda.kvfp8 import fp8_kv_bits, kv_fmt
from services.decode.engine.kvquant import dequantize, quantize
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path import OPTIONS, OTHER, PROMPT, run
from tests.unit.engine_cuda.test_fast_path_batch import OPTIONS as BATCH_OPTIONS, decode_alone, decode_together
from tests.unit.engine_cuda.test_fast_path_families import _close

FORMATS = ["fp8_e4m3", "fp8_e5m2"]


@triton.jit
def _bits_kernel(x_ptr, o_ptr, inv, N, FMT: tl.constexpr, B: tl.constexpr):
    r = tl.program_id(0) * B + tl.arange(0, B)
    m = r < N
    x = tl.load(x_ptr + r, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + r, fp8_kv_bits(x, inv, FMT), mask=m)


def _bf16_values() -> torch.Tensor:
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    f = every.float()
    every = every[torch.isfinite(f) & ((f.abs() >= 2.0**-126) | (f == 0))]
    g = torch.Generator().manual_seed(0)
    rnd = (torch.randn(4096, generator=g) * torch.logspace(-12, 6, 4096)).to(torch.bfloat16)
    return torch.cat([every, rnd])


@pytest.mark.parametrize("nearest", [False, True])  # vLLM's CPU writer truncates, its CUDA writers round
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 0.0123, 300.0])
def test_fp8_kv_bits_are_kvquant_bytes(fmt, scale, nearest):
    x = _bf16_values()
    out = torch.zeros(x.numel(), dtype=torch.uint8)
    _bits_kernel[(triton.cdiv(x.numel(), 8192),)](x, out, 1.0 / scale, x.numel(), FMT=kv_fmt(fmt, nearest), B=8192)
    assert torch.equal(out, quantize(x, scale, fmt, nearest))


def _caches(t: int, hkv: int, d: int, fp8: bool):
    dt = torch.uint8 if fp8 else torch.bfloat16
    return torch.zeros(t, hkv, d, dtype=dt), torch.zeros(t, hkv, d, dtype=dt)


@pytest.mark.parametrize("writer", ["qkv_gemv", "rope_kernel", "rope_kernel_qk_norm"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_writers_store_the_reference_bytes(writer, fmt):
    hq, hkv, d, h, t, pos = 4, 2, 16, 64, 8, 5
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    w = (torch.randn((hq + 2 * hkv) * d, h, generator=g) * 0.2).to(bf)
    x = torch.randn(h, generator=g).to(bf)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(bf)
    qn, kn = (1 + 0.1 * torch.randn(d, generator=g)).to(bf), (1 + 0.1 * torch.randn(d, generator=g)).to(bf)
    cos = torch.randn(t, d // 2, generator=g).to(bf)
    sin = torch.randn(t, d // 2, generator=g).to(bf)
    p = torch.tensor([pos], dtype=torch.int32)
    ks, vs = 0.05, 0.021
    kv = dict(kv_fmt=kv_fmt(fmt), inv_k=1.0 / ks, inv_v=1.0 / vs)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    results = []
    for fp8 in (False, True):
        kc, vc = _caches(t, hkv, d, fp8)
        q = torch.zeros(hq * d, dtype=bf)
        extra = kv if fp8 else {}
        if writer == "qkv_gemv":
            gemv.gemv_qkv_rope(x, w, nw, 1e-5, q, kc, vc, p, cos, sin, **heads, block_n=8, block_k=64, **extra)
        else:
            qkv = (w.float() @ x.float()).to(bf)
            norms = dict(q_norm=qn, k_norm=kn) if writer.endswith("qk_norm") else {}
            smallops.rope_cache_write(qkv, q, kc, vc, p, cos, sin, **heads, **norms, **extra)
        results.append((q, kc, vc))
    (q16, k16, v16), (q8, k8, v8) = results
    assert torch.equal(q8, q16)
    assert torch.equal(k8[pos], quantize(k16[pos], ks, fmt)) and torch.equal(v8[pos], quantize(v16[pos], vs, fmt))
    assert not k8[:pos].any() and not k8[pos + 1:].any()  # only row pos written


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_gain", [1.0, 2.0**-4, 4e4])  # 4e4: q beyond fp16's range, scaled into it for the dot
def test_attention_reads_fp8_times_scale(one_launch, fmt, q_gain):
    hq, hkv, d, t, pos = 8, 2, 32, 96, 70
    g = torch.Generator().manual_seed(2)
    ks, vs = 0.03, 0.011
    k = quantize(torch.randn(t, hkv, d, generator=g).to(torch.bfloat16) * 0.4, ks, fmt)
    v = quantize(torch.randn(t, hkv, d, generator=g).to(torch.bfloat16) * 0.2, vs, fmt)
    q = (torch.randn(hq, d, generator=g) * q_gain).to(torch.bfloat16)
    out = torch.full((hq, d), float("nan"), dtype=torch.bfloat16)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=2, block_s=32,
                           one_launch=one_launch)
    attn(q, k, v, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d,
         kv_fmt=kv_fmt(fmt), k_scale=ks, v_scale=vs)
    want = reference.attention(q.float()[None], dequantize(k, ks, fmt), dequantize(v, vs, fmt), pos, d**-0.5)[0]
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - want).norm() / want.norm()).item() < 4e-3  # the output's bf16 rounding
    assert ((out.float() - want).abs().max()).item() <= 2 * want.abs().max().item() * 2**-8


KV_SCALES = (0.04, 0.015)  # non-unit: the tiny models' K/V land in E4M3's normal range
FP8_KV_OPTIONS = replace(OPTIONS, fp8_kv_attn=(4, 16))  # the FP8-KV attention's own split count and tile
BATCH_TILES = BATCH_OPTIONS.batch_tiles  # small tiles: the interpreter's cost


def _load(path, mode: str, kv: str, num_slots: int = 1) -> Engine:
    # the norm before the QKV GEMV at HF's rounding points (norm_late off): the K/V bytes the fast path writes are
    # then the reference step's, byte for byte (folded, they move by an ulp before the FP8 rounding)
    return Engine.load(path, num_slots=num_slots, max_seq_len=48, dtype="bfloat16", fast_path=mode,
                       fast_path_options=replace(FP8_KV_OPTIONS, norm_late=False), kv_cache_dtype=kv)


@pytest.mark.parametrize("arch,weights,kv,nearest", [
    ("llama", "bf16", "fp8", False), ("llama", "bf16", "fp8_e5m2", False), ("qwen3", "bf16", "fp8_e4m3", False),
    ("llama", "fp8-channel", "fp8", False),
    # a node on a GPU writes its tokens' K/V rounded to nearest, as vLLM's CUDA writers write the prompt's
    ("llama", "bf16", "fp8", True), ("qwen3", "bf16", "fp8_e5m2", True),
])
def test_fp8_kv_fast_path_tokens_equal_the_reference_step(tmp_path, monkeypatch, arch, weights, kv, nearest):
    monkeypatch.setattr(engine_mod, "fp8_kv_nearest", lambda shape, device: nearest)
    save_checkpoint(arch, tmp_path, damp=True)
    if weights == "bf16":  # no quantization config: vLLM keeps 1.0; non-unit scales set here for both engines
        monkeypatch.setattr(engine_mod, "checkpoint_scales", lambda raw, n, has, get: [KV_SCALES] * n)
    else:  # calibrated scales in the checkpoint, read as vLLM reads them
        quantize_checkpoint(tmp_path, weights, activations="dynamic")
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"]["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "strategy": "tensor"}
        (tmp_path / "config.json").write_text(json.dumps(config))
        tensors = load_file(str(tmp_path / "model.safetensors"))
        tensors |= {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(s)
                    for i in range(config["num_hidden_layers"]) for w, s in zip("kv", KV_SCALES)}
        save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    fast, ref = _load(tmp_path, "on", kv), _load(tmp_path, "off", kv)
    assert fast.fast_path_reason is None and fast.cache.kv_format is not None
    assert fast.cache.kv_nearest == ref.cache.kv_nearest == nearest
    assert fast.cache.scales[0] == pytest.approx(KV_SCALES) and fast.cache.scales == ref.cache.scales
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens, _, paths = run(fast, 0, PROMPT, greedy)
    assert paths == {"fast"}
    want = run(ref, 0, PROMPT, greedy)[0]
    assert tokens == want
    # every K/V byte of the prompt and the decoded tokens: the reference step's
    n = len(PROMPT)
    for i in range(len(fast.cache.k_caches)):
        for c_fast, c_ref in ((fast.cache.k_caches[i], ref.cache.k_caches[i]),
                              (fast.cache.v_caches[i], ref.cache.v_caches[i])):
            a, b = c_fast[0, : n + 7], c_ref[0, : n + 7]
            assert a[n:].any() and torch.equal(a, b)


@pytest.mark.parametrize("arch,weights,kv", [
    ("llama", "bf16", "fp8"), ("llama", "bf16", "fp8_e5m2"), ("qwen3", "bf16", "fp8_e4m3"),
    ("llama", "fp8-channel", "fp8"), ("llama", "fp8-channel", "auto"), ("qwen2", "fp8-tensor", "auto"),
    ("llama", "fp8-channel-weight-only", "auto"),
])
def test_fp8_slots_decode_together_with_their_tokens_and_bytes_alone(tmp_path, monkeypatch, arch, weights, kv):
    save_checkpoint(arch, tmp_path, damp=True)
    if weights != "bf16":
        scheme = weights.removesuffix("-weight-only")
        quantize_checkpoint(tmp_path, scheme, activations="none" if weights.endswith("weight-only") else "dynamic")
    monkeypatch.setattr(engine_mod, "checkpoint_scales", lambda raw, n, has, get: [KV_SCALES] * n)
    options = replace(FP8_KV_OPTIONS, batch_tiles=BATCH_TILES)
    prompts = {0: PROMPT, 1: OTHER}
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)

    def load() -> Engine:
        return Engine.load(tmp_path, num_slots=2, max_seq_len=48, dtype="bfloat16", fast_path="on",
                           fast_path_options=options, kv_cache_dtype=kv)

    alone_engine = load()
    alone = decode_alone(alone_engine, prompts, greedy, release=False)  # (its caches compared below)
    engine = load()
    assert engine.fast_path.batch_ok and (engine.cache.kv_format is not None) == (kv != "auto")
    assert decode_together(engine, prompts, greedy) == alone
    # the batched step wrote every slot's K/V bytes as its batch-1 step did
    for slot in prompts:
        n = len(prompts[slot]) + 4
        for caches in ("k_caches", "v_caches"):
            for a, b in zip(getattr(engine.cache, caches), getattr(alone_engine.cache, caches)):
                assert a[slot, len(prompts[slot]):n].any() and torch.equal(a[slot, :n], b[slot, :n])


@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_quant_rows_and_the_fp8_rows_gemv_follow_the_one_token_twins(act, rows):
    from services.decode.engine.cuda.batch import quant_rows, rows_gemv
    from services.decode.engine.cuda.fp8 import gemv_fp8_reference, gemv_fp8_silu_reference
    from services.decode.engine.fp8 import quantize_activations

    g = torch.Generator().manual_seed(rows)
    n, k = 48, 96
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]).to(torch.bfloat16)
    w16 = torch.randn(2 * n, k, generator=g) * 0.1
    ws = w16.abs().amax(dim=1) / 448.0
    w = (w16 / ws[:, None]).to(torch.float8_e4m3fn)
    res = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    q = torch.full((rows, k), float("nan"), dtype=torch.float16)
    scale = torch.empty(rows)
    quant_rows(x, q, scale, act)
    # the rows' values as the GEMV sees them: FP8_DYNAMIC's rounding, or the bf16 values exactly
    want = quantize_activations(x) if act else x.float()
    assert torch.equal(q.float() * scale[:, None], want)
    kw = dict(block_n=16, block_k=32, stages=1, mode=1, w_scale=ws, x_scale=scale)
    out = res.clone()
    rows_gemv(q, w[:n], out, residual=out, **kw)
    silu = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    rows_gemv(q, w, silu, silu=True, **kw)
    for r in range(rows):
        _close(out[r], gemv_fp8_reference(x[r], w[:n], ws[:n], residual=res[r], act=act), 1e-2)
        _close(silu[r], gemv_fp8_silu_reference(x[r], w, ws, act=act), 1e-2)
