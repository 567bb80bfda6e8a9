"""Llama-family variants on the fast path (kernels interpreted on CPU, conftest.py) against the reference steps.

Kernels: the GEMV's bias epilogue and the attention kernel's q/k norm + rope prologue vs their torch twins.
Decoder (table): GqaDecoder with Qwen2's q/k/v bias, an o_proj bias, Qwen3's q/k norm (in the attention
kernel, in the QKV GEMV's last program of each head or in its own kernel), on Triton and on cuBLAS-style backends, vs ``cuda.llama.reference_step``:
logits, this step's K/V rows and greedy tokens, step by step.
Engine (table): tiny checkpoints of every Llama-family variant the engine's reference step accepts
(Qwen2 with tied embeddings, Qwen3, Mistral, Llama with llama3 / yarn / linear / no rope scaling, Llama
with attention bias) decode on the fast path (no reason recorded) the same greedy tokens as
``Engine(fast_path="off")``; its first step's logits are the engine forward's.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions, GqaDecoder, GqaLayer, GqaModel, gemv, reference, reference_step
from services.decode.engine.cuda.llama import folds_norm
from services.decode.engine.cuda.adapter import gqa_decoder_from_engine
from services.decode.engine.cuda.attention import DecodeAttention
from services.decode.engine.fastpath import engine_reason
from shared.events import SamplingParams
from tests.unit.engine.hf_models import VOCAB, save_checkpoint

BF = torch.bfloat16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape, std=1.0):
    return (torch.randn(*shape, generator=g) * std).to(BF)


def _norm_w(g, n):
    return (1 + 0.1 * torch.randn(n, generator=g)).to(BF)


def _tables(n, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.arange(n)[:, None] * inv[None]
    return f.cos(), f.sin()


def _close(a, b, tol=1e-6):
    a, b = a.float(), b.float()
    assert ((a - b).abs().max() / b.abs().max()).item() <= tol


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("residual", [False, True])
def test_gemv_bias_joins_the_sum_before_its_rounding(residual):
    g = _gen(0)
    x, w, b, res = _rand(g, 96), _rand(g, 40, 96, std=0.1), _rand(g, 40, std=2.0), _rand(g, 40)
    out = torch.full((40,), float("nan"), dtype=BF)
    gemv.gemv(x, w, out, bias=b, residual=res.clone() if residual else None, block_n=8, block_k=32)
    lin = (x.float() @ w.float().T + b.float()).to(BF)
    _close(out, res + lin if residual else lin)


@pytest.mark.parametrize("block_n", [1, 4, 16])  # 16, 4 or 1 programs a head (the last one normalises it)
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_gemv_normalises_each_head_in_its_last_program(block_n, bias):
    # the QKV GEMV with qk_norm (one launch) writes what the plain GEMV + the norm/rope/cache kernel write
    from services.decode.engine.cuda import smallops

    g, hq, hkv, d, h, n, pos = _gen(4), 4, 2, 32, 64, 12, 7
    nh = hq + 2 * hkv
    x, w, nw = _rand(g, h), _rand(g, nh * d, h, std=h ** -0.5), _norm_w(g, h)
    b = _rand(g, nh * d, std=0.5) if bias else None
    qn, kn = _norm_w(g, d), _norm_w(g, d)
    cos, sin = (t.to(BF) for t in _tables(n, d))
    kc, vc = _rand(g, n, hkv, d), _rand(g, n, hkv, d)
    pos_t = torch.tensor([pos], dtype=torch.int32)
    qkv = gemv.gemv(x, w, torch.empty(nh * d, dtype=BF), norm_w=nw, eps=1e-5, bias=b, block_n=8, block_k=32)
    q_ref, k_ref, v_ref = torch.empty(hq * d, dtype=BF), kc.clone(), vc.clone()
    smallops.rope_cache_write(qkv, q_ref, k_ref, v_ref, pos_t, cos, sin, num_q_heads=hq, num_kv_heads=hkv,
                              head_dim=d, q_norm=qn, k_norm=kn, eps=1e-6)
    q_out, raw = torch.full((hq * d,), float("nan"), dtype=BF), torch.zeros((hq + hkv) * d, dtype=BF)
    count = torch.zeros(hq + hkv, dtype=torch.int32)
    for _ in range(2):  # the counts are back at zero: a second call (the next layer) works alike
        gemv.gemv_qkv_rope(x, w, nw, 1e-5, q_out, kc, vc, pos_t, cos, sin, num_q_heads=hq, num_kv_heads=hkv,
                           head_dim=d, bias=b, rope=False, block_n=block_n, block_k=32,
                           qk_norm=(qn, kn, raw, count))
        assert torch.equal(q_out, q_ref) and torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
        assert count.tolist() == [0] * (hq + hkv)
    with pytest.raises(ValueError, match="rope=False"):
        gemv.gemv_qkv_rope(x, w, nw, 1e-5, q_out, kc, vc, pos_t, cos, sin, num_q_heads=hq, num_kv_heads=hkv,
                           head_dim=d, rope=True, qk_norm=(qn, kn, raw, count))


@pytest.mark.parametrize("pos_row_prologue", [True, False])  # V row pos loaded early, K row stored late, or not
@pytest.mark.parametrize("pos", [21, 16, 0])  # row pos after keys of its split, first of its split, alone
def test_attention_normalises_and_ropes_q_and_this_steps_k_row(pos, pos_row_prologue):
    g, hq, hkv, d, n = _gen(1), 4, 2, 32, 40
    q, kc, vc = _rand(g, hq, d), _rand(g, n, hkv, d), _rand(g, n, hkv, d)
    qn, kn = _norm_w(g, d), _norm_w(g, d)
    cos, sin = (t.to(BF) for t in _tables(n, d))
    ref_k = kc.clone()
    qr = reference.rope(reference.rms_norm(q, qn, 1e-6), cos[pos], sin[pos])
    ref_k[pos] = reference.rope(reference.rms_norm(kc[pos], kn, 1e-6), cos[pos], sin[pos])
    expected = reference.attention(qr[None], ref_k, vc, pos, d ** -0.5)[0]
    attn = DecodeAttention(num_q_heads=hq, num_kv_heads=hkv, d_main=d, d_v=d, num_splits=4, block_s=16,
                           one_launch=False, pos_row_prologue=pos_row_prologue)
    out = torch.empty(hq, d, dtype=BF)
    attn(q, kc, vc, torch.tensor([pos], dtype=torch.int32), out, stride_kt=hkv * d, stride_vt=hkv * d,
         qk_norm=(qn, kn, 1e-6, cos, sin))
    _close(out, expected, 1e-2)  # fp32 softmax sums in another order, one bf16 ulp at most
    assert torch.equal(kc, ref_k)  # row pos normalised + rotated for later steps, every other row untouched


# ---------------------------------------------------------------- decoder vs reference_step

TILES = {"qkv": (8, 32, 4, 2), "o": (8, 32, 4, 1), "gate_up": (16, 32, 4, 3), "down": (8, 32, 4, 1),
         "lm_head": (16, 32, 4, 1)}

# name -> (qkv bias, o bias, q/k norm, backend, qk_norm_in)
DECODERS = {
    "qwen2 (qkv bias)": (True, False, False, "triton", "attention"),
    "qwen3 (q/k norm in attention)": (False, False, True, "triton", "attention"),
    "qwen3 (q/k norm kernel)": (False, False, True, "triton", "kernel"),
    "qwen3 (q/k norm in the QKV GEMV)": (False, False, True, "triton", "qkv"),
    "bias + q/k norm in the QKV GEMV": (True, True, True, "triton", "qkv"),
    "qwen3 (q/k norm in attention, K row pos stored before the loop)": (False, False, True, "triton", "early_store"),
    "llama attention_bias (qkv + o bias)": (True, True, False, "triton", "attention"),
    "bias + q/k norm": (True, True, True, "triton", "attention"),
    "qwen2 on cuBLAS": (True, True, False, "cublas", "attention"),
    "qwen3 on cuBLAS": (False, False, True, "cublas", "attention"),
}


def tiny_model(bias: bool, o_bias: bool, qk_norm: bool, d: int = 16) -> GqaModel:
    g, h, hq, hkv, inter, vocab = _gen(0), 64, 4, 2, 96, 100

    def w(*shape):
        return _rand(g, *shape, std=shape[-1] ** -0.5)

    layers = []
    for _ in range(2):
        layer = GqaLayer(_norm_w(g, h), w((hq + 2 * hkv) * d, h), w(h, hq * d), _norm_w(g, h), w(2 * inter, h),
                         w(h, inter))
        layer.bqkv = _rand(g, (hq + 2 * hkv) * d, std=0.5) if bias else None
        layer.bo = _rand(g, h, std=0.1) if o_bias else None
        layer.q_norm, layer.k_norm = (_norm_w(g, d), _norm_w(g, d)) if qk_norm else (None, None)
        layers.append(layer)
    return GqaModel(layers, _rand(g, vocab, h), _norm_w(g, h), w(vocab, h), hq, hkv, d, 1e-5)


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_follows_the_reference_step(name):
    bias, o_bias, qk_norm, backend, where = DECODERS[name]
    m, n, ctx, steps, d = tiny_model(bias, o_bias, qk_norm), 40, 20, 3, 16
    g = _gen(1)
    kc = [_rand(g, n, 2, d) for _ in m.layers]
    vc = [_rand(g, n, 2, d) for _ in m.layers]
    kr, vr = [k.clone() for k in kc], [v.clone() for v in vc]
    cos, sin = _tables(n, d)
    tiles = {**TILES, "qkv": (2, 32, 4, 2)} if where == "qkv" else TILES  # 4 programs a head, the last normalising
    opts = FastOptions(backends={p: backend for p in TILES}, tiles=tiles, num_splits=4, block_s=16,
                       qk_norm_in="attention" if where == "early_store" else where,
                       qk_pos_row_prologue=where != "early_store")
    dec = GqaDecoder(m, kc, vc, cos, sin, opts, max_steps=8)
    late = (folds_norm(opts, "qkv", qk_norm, 0), folds_norm(opts, "gate_up", False, 0))  # the default: norm_late
    assert late == ((backend == "triton" and where != "kernel") if qk_norm else backend == "triton",
                    backend == "triton")
    dec.set_state(3, ctx)
    tok, expected = 3, []
    for i in range(steps):
        ref = reference_step(m, kr, vr, cos, sin, tok, ctx + i, norm_late=late)
        dec.step()
        tok = int(ref.argmax())
        expected.append(tok)
        _close(dec.logits, ref, 1e-6 if backend == "triton" else 1e-2)  # cuBLAS-style lm_head: bf16 logits
        for layer in range(2):
            assert torch.equal(kc[layer][ctx + i], kr[layer][ctx + i])
            assert torch.equal(vc[layer][ctx + i], vr[layer][ctx + i])
    assert dec.out_tokens[:steps].tolist() == expected
    assert int(dec.pos) == ctx + steps and torch.equal(dec.residual, m.embed[expected[-1]])


@pytest.mark.parametrize("name,attn_warps,want", [
    ("qwen3 (q/k norm in attention)", None, 8),  # the split kernel's prologue normalises q and K
    ("qwen3 (q/k norm kernel)", None, 4),
    ("qwen3 (q/k norm in the QKV GEMV)", None, 4),  # the attention is the Llama one
    ("qwen3 on cuBLAS", None, 4),
    ("qwen2 (qkv bias)", None, 4),
    ("qwen3 (q/k norm in attention)", 2, 2),  # an explicit choice wins
])
def test_attention_warps_follow_where_the_qk_norm_runs(name, attn_warps, want):
    bias, o_bias, qk_norm, backend, where = DECODERS[name]
    m, n, d = tiny_model(bias, o_bias, qk_norm), 40, 16
    g = _gen(1)
    caches = [[_rand(g, n, 2, d) for _ in m.layers] for _ in range(2)]
    opts = FastOptions(backends={p: backend for p in TILES}, tiles=TILES, num_splits=4, block_s=16,
                       qk_norm_in=where, attn_warps=attn_warps)
    assert GqaDecoder(m, *caches, *_tables(n, d), opts, max_steps=8).attn.num_warps == want


@pytest.mark.parametrize("fp8_qkv_rope,want", [(True, 8), (False, 4)])  # False: a rope/norm kernel of its own
def test_fp8_attention_warps_follow_where_the_qk_norm_runs(fp8_qkv_rope, want):
    from services.decode.engine.cuda.fp8 import Fp8GqaDecoder, Fp8Scales

    m, n, d = tiny_model(False, False, True), 40, 16
    g = _gen(1)
    caches = [[_rand(g, n, 2, d) for _ in m.layers] for _ in range(2)]
    scales = [Fp8Scales(wqkv=torch.ones(layer.wqkv.shape[0])) for layer in m.layers]
    opts = FastOptions(tiles=TILES, num_splits=4, block_s=16, fp8_qkv_rope=fp8_qkv_rope)
    dec = Fp8GqaDecoder(m, *caches, *_tables(n, d), opts, max_steps=8, scales=scales, act_fp8=False)
    assert dec.attn.num_warps == want


# ---------------------------------------------------------------- engine: fast path vs reference step

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)


def _config(variant: str):
    import transformers as tf

    if variant == "mistral":
        return tf.MistralConfig(sliding_window=None, **SMALL)
    rope = {"llama_yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64},
            "llama_linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}.get(variant)
    extra = dict(attention_bias=True, tie_word_embeddings=True) if variant == "llama_bias_tied" else {}
    return tf.LlamaConfig(**SMALL, **extra, **({"rope_parameters": rope} if rope else {}))


def _save_variant(variant: str, path) -> None:
    """A near-bigram checkpoint (wide greedy margins) of a config hf_models does not build."""
    import transformers as tf

    g = _gen(3)
    model = tf.AutoModelForCausalLM.from_config(_config(variant), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.25)
            if name.endswith("embed_tokens.weight"):
                p.mul_(4.0)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path)


# variant -> what the engine must have loaded (config fields, checked so the table tests what it says)
ENGINES = {
    "qwen2": dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "llama3_rope": dict(model_type="llama", rope_type="llama3"),
    "llama": dict(model_type="llama", rope_type="default"),
    "mistral": dict(model_type="mistral"),
    "llama_yarn": dict(rope_type="yarn"),
    "llama_linear": dict(rope_type="linear"),
    "llama_bias_tied": dict(qkv_bias=True, o_bias=True, tie_word_embeddings=True),
}
OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPT = [0, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = tmp_path_factory.mktemp(f"family-{variant}")
            if variant in ("qwen2", "qwen3", "llama3_rope", "llama"):
                save_checkpoint(variant, made[variant], damp=True)
            else:
                _save_variant(variant, made[variant])
        return made[variant]

    return get


def _greedy(engine: Engine, n: int) -> tuple[list[int], set[str]]:
    first = int(engine.prefill(0, PROMPT).argmax())
    engine.start(0, first, SamplingParams(max_tokens=n, ignore_eos=True))
    tokens, paths = [first], set()
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
        paths.add(engine.last_step_path)
    engine.release(0)
    return tokens, paths


@pytest.mark.parametrize("variant", list(ENGINES))
def test_engine_decodes_every_llama_family_variant_on_the_fast_path(checkpoint, variant):
    path = checkpoint(variant)
    load = dict(num_slots=1, max_seq_len=32, dtype="bfloat16", fast_path_options=OPTIONS)
    fast, ref = Engine.load(path, fast_path="on", **load), Engine.load(path, fast_path="off", **load)
    cfg = fast.cfg
    loaded = {**vars(cfg), "rope_type": cfg.rope["rope_type"]}
    assert {k: loaded[k] for k in ENGINES[variant]} == ENGINES[variant]
    assert fast.fast_path_reason is None
    expected, ref_paths = _greedy(ref, 4)
    assert ref_paths == {"reference"} and len(expected) == 5
    assert _greedy(fast, 4) == (expected, {"fast"})
    # one fast step over the engine's own prefill: logits within bf16 noise of the engine forward's
    m, first = fast.model, int(fast.prefill(0, PROMPT).argmax())
    want = m.logits(m(torch.tensor([[first]]), torch.tensor([[len(PROMPT)]]), torch.tensor([0])))[0, 0].float()
    dec = gqa_decoder_from_engine(m, 0, OPTIONS, max_steps=2)
    dec.set_state(first, len(PROMPT))
    dec.step()
    _close(dec.logits, want, 3e-2)  # bf16 through SDPA vs split-K
    assert int(dec.token) == int(want.argmax())  # a near-bigram model: no near-ties


# ---------------------------------------------------------------- what engine_reason still refuses

def _gqa(head_dim: int):
    cfg = SimpleNamespace(model_type="llama", head_dim=head_dim)
    return SimpleNamespace(cfg=cfg, family="gqa", layers=[])


@pytest.mark.parametrize("model,dtype,k,words", [
    (_gqa(24), BF, 0, "head_dim 24"),
    (_gqa(8), BF, 0, "head_dim 8"),
    (_gqa(128), torch.float16, 0, "bfloat16 only"),
    (_gqa(128), BF, 2, "one token per step"),
])
def test_engine_reason_refuses_only_what_the_gqa_fast_path_cannot_run(model, dtype, k, words):
    assert words in engine_reason("on", model, torch.device("cpu"), dtype, k)
    assert engine_reason("on", _gqa(128), torch.device("cpu"), BF, 0) is None  # interpreted: CPU allowed


@pytest.mark.parametrize("kv_format,cc,words", [
    ("fp8_e4m3", (8, 0), "fp8_e4m3 on sm_80"),  # E4M3 unpack needs cvt.rn.f16x2.e4m3x2 (sm_89+)
    ("fp8_e4m3", (8, 9), None),
    ("fp8_e4m3", (9, 0), None),
    ("fp8_e5m2", (8, 0), None),  # E5M2 unpacks by byte placement on any GPU
    (None, (8, 0), None),
])
def test_engine_reason_gates_e4m3_kv_on_the_gpu_generation(monkeypatch, kv_format, cc, words):
    model = _gqa(128)
    model.cache = SimpleNamespace(kv_format=kv_format)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or SimpleNamespace())
    reason = engine_reason("auto", model, torch.device("cuda"), BF, 0)
    assert (reason is None) if words is None else (words in reason)
