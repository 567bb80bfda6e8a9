"""FP8 MLA latent on the DeepSeek-family fast path, its Triton kernels interpreted on CPU (conftest.py).

- ``_mla_prep_kernel`` writes the bytes of the bf16 latent row it writes to a bf16 cache (normed latent, roped
  k_pe), quantized as the reference does; the split attention reads fp8 * k_scale for the latent and its rope
  part, within fp32 rounding of attention over the dequantized rows.
- Through the Engine API (``kv_cache_dtype='fp8'``): greedy tokens on the fast path equal the FP8-latent
  reference step's, plain and with MTP drafts (the draft layer's latent FP8 too), with a non-unit k_scale, and
  every latent byte of the prompt and the decoded tokens is the reference step's; two slots batched decode and
  write as they do alone.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine import engine as engine_mod
from services.decode.engine.cuda import reference
from services.decode.engine.cuda.attention import DecodeAttention
from services.decode.engine.cuda.kvfp8 import kv_fmt
from services.decode.engine.cuda.mla import _mla_prep_kernel
from services.decode.engine.kvquant import dequantize
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path_mla import SMALL, V3_PROMPT, run
from tests.unit.engine_cuda.test_fast_path_batch import decode_alone, decode_together
from tests.unit.engine.test_kv_fp8_mla import quantize_nearest

K_SCALE = 0.05  # non-unit: the tiny model's latent lands in E4M3's normal range, and a missing scale shows


def test_prep_kernel_writes_the_bf16_rows_bytes():
    heads, nope, rope, r, t, pos = 2, 16, 8, 32, 3, 4
    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    qkv = torch.randn(t, heads * (nope + rope) + r + rope, generator=g).to(bf)
    nw = (1 + 0.1 * torch.randn(r, generator=g)).to(bf)
    cos = torch.randn(16, rope // 2, generator=g).to(bf)
    sin = torch.randn(16, rope // 2, generator=g).to(bf)
    p = torch.tensor([pos], dtype=torch.int32)
    rows = []
    for fp8 in (False, True):
        cache = torch.zeros(16, r + rope, dtype=torch.uint8 if fp8 else bf)
        q_pe = torch.zeros(t, heads, rope, dtype=bf)
        _mla_prep_kernel[(t, heads + 1)](qkv, q_pe, cache, nw, p, cos, sin, qkv.stride(0), 1e-6, NUM_HEADS=heads,
                                         NOPE=nope, ROPE=rope, R=r, KV_FMT=kv_fmt("fp8_e4m3", nearest=True) if fp8 else 0,
                                         inv_scale=1.0 / K_SCALE)
        rows.append((q_pe, cache))
    (q16, c16), (q8, c8) = rows
    assert torch.equal(q8, q16)
    assert torch.equal(c8[pos:pos + t], quantize_nearest(c16[pos:pos + t], K_SCALE))
    assert not c8[:pos].any() and not c8[pos + t:].any()


@pytest.mark.parametrize("q_gain", [1.0, 4e4])  # 4e4: q beyond fp16's range, both parts scaled into it
def test_attention_reads_the_fp8_latent_times_its_scale(q_gain):
    hq, r, rope, n, pos = 4, 128, 16, 80, 61
    g = torch.Generator().manual_seed(2)
    cache = quantize_nearest(torch.randn(n, r + rope, generator=g).to(torch.bfloat16) * 0.3, K_SCALE)
    q_c = (torch.randn(hq, 1, r, generator=g) * q_gain).to(torch.bfloat16)
    q_pe = (torch.randn(1, hq, rope, generator=g) * q_gain).to(torch.bfloat16)
    out = torch.full((1, hq, r), float("nan"), dtype=torch.bfloat16)
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=1, d_main=r, d_v=r, d_rope=rope, num_splits=2, block_s=32,
                           v_chunks=1, sm_scale=0.1)
    attn(q_c, cache, cache, torch.tensor([pos], dtype=torch.int32), out, stride_kt=r + rope, stride_vt=r + rope,
         rope_offset=r, q_pe=q_pe, stride_qt=r, stride_qh=r, kv_fmt=kv_fmt("fp8_e4m3", nearest=True), k_scale=K_SCALE,
         v_scale=K_SCALE)
    kv = dequantize(cache, K_SCALE, "fp8_e4m3")
    query = torch.cat([q_c[:, 0].float(), q_pe[0].float()], dim=-1)  # [Hq, r + rope]
    want = reference.attention(query[None], kv[:, None], kv[:, None, :r], pos, 0.1)[0]
    assert torch.isfinite(out.float()).all()
    assert ((out[0].float() - want).norm() / want.norm()).item() < 4e-3  # the output's bf16 rounding


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-fp8-latent")
    save_checkpoint("deepseek_v3", path, **SMALL)
    return path


def _load(path, mode: str, k: int = 0, slots: int = 1) -> Engine:
    return Engine.load(path, num_slots=slots, max_seq_len=32, dtype="bfloat16", fast_path=mode,
                       num_speculative_tokens=k, kv_cache_dtype="fp8")


@pytest.mark.parametrize("k", [0, 3])
def test_fp8_latent_fast_path_tokens_and_bytes_equal_the_reference_step(checkpoint, monkeypatch, k):
    monkeypatch.setattr(engine_mod, "checkpoint_scales", lambda raw, n, has, get: [(K_SCALE, K_SCALE)] * n)
    fast, ref = _load(checkpoint, "on", k), _load(checkpoint, "off", k)
    assert fast.fast_path_reason is None and fast.cache.kv_format == "fp8_e4m3"
    assert fast.cache.kv[0].dtype == torch.uint8 and fast.cache.scales[0] == (K_SCALE, K_SCALE)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    got, reason, paths, _, stats = run(fast, V3_PROMPT, greedy)
    want, _, ref_paths, _, _ = run(ref, V3_PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == "length"
    if k:
        assert stats.num_draft_tokens > 0
    n = len(V3_PROMPT) + 7  # every latent byte the two wrote (the MTP layer's: its drafts' rows may differ)
    for a, b in zip(fast.cache.kv[:fast.cfg.num_layers], ref.cache.kv[:ref.cfg.num_layers]):
        assert a[0, len(V3_PROMPT):n].any() and torch.equal(a[0, :n], b[0, :n])


def test_fp8_latent_slots_decode_together_as_alone(checkpoint, monkeypatch):
    monkeypatch.setattr(engine_mod, "checkpoint_scales", lambda raw, n, has, get: [(K_SCALE, K_SCALE)] * n)
    prompts = {0: V3_PROMPT, 1: [5, 9, 2, 77, 40]}
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    alone_engine = _load(checkpoint, "on", slots=2)
    alone = decode_alone(alone_engine, prompts, greedy, release=False)
    engine = _load(checkpoint, "on", slots=2)
    assert engine.fast_path.batch_ok
    assert decode_together(engine, prompts, greedy) == alone
    for slot, prompt in prompts.items():
        n = len(prompt) + 4
        for a, b in zip(engine.cache.kv, alone_engine.cache.kv):
            assert a[slot, len(prompt):n].any() and torch.equal(a[slot, :n], b[slot, :n])
