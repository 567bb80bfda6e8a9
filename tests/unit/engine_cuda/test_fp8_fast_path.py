"""FP8 (compressed-tensors per-channel / per-tensor) Llama-family models on the fast path, its Triton
kernels interpreted on CPU (conftest.py): greedy tokens through
``Engine(fast_path="on")`` equal the reference step's (``fast_path="off"``, which dequantizes in
torch), with and without FP8 activations, and for Qwen3's q/k norm; block-scaled checkpoints (the ``fp8`` method,
Qwen's FP8 releases) through the block-scaled GEMVs, one slot a step or several; what the FP8 step does not read (block
scales with biases, blocks not a power of two) keeps the reference step and says why. Block-scaled
DeepSeek-family checkpoints: test_fp8_block_fast_path.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from infra.tinymodel_fp8 import quantize_checkpoint
from services.decode.engine import Engine
from services.decode.engine.cuda.fp8 import gemv_fp8block_silu, gemv_fp8block_xq_qkv_rope, quant_groups
from services.decode.engine.fp8 import is_fp8
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path import OPTIONS, PROMPT, run

def load(path, mode: str) -> Engine:
    return Engine.load(path, num_slots=1, max_seq_len=48, dtype="bfloat16", fast_path=mode,
                       fast_path_options=OPTIONS)


@pytest.mark.parametrize("arch,scheme,activations", [
    ("llama", "fp8-channel", "dynamic"), ("llama", "fp8-tensor", "none"), ("qwen3", "fp8-channel", "dynamic"),
])
def test_fp8_fast_path_tokens_equal_the_reference_step(tmp_path, arch, scheme, activations):
    save_checkpoint(arch, tmp_path, damp=True)
    quantize_checkpoint(tmp_path, scheme, activations=activations)
    fast, ref = load(tmp_path, "on"), load(tmp_path, "off")
    assert fast.fast_path_reason is None and is_fp8(fast.model.layers[0].wqkv)
    assert fast.fast_path.batch_ok  # several slots: the batched step (test_fp8_kv_fast_path.py)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, _, paths = run(fast, 0, PROMPT, greedy)
    assert paths == {"fast"}
    assert tokens == run(ref, 0, PROMPT, greedy)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_block_scaled_fp8_fast_path_tokens_equal_the_reference_step(tmp_path, arch, monkeypatch):
    # the fp8 method with weight_block_size (Qwen's and DeepSeek's FP8 releases; 16 x 16 blocks on the tiny
    # model, whose blocks' scales spread_blocks makes differ): the batch-1 step runs the block-scaled GEMVs, with
    # the reference step's per-128-feature (here 16) activation rounding (once a GEMV input), gate/up and SiLU in one
    # launch, one slot a step or several together
    from services.decode.engine.cuda import fp8
    from tests.unit.engine_cuda.test_fp8_block_fast_path import spread_blocks

    save_checkpoint(arch, tmp_path, damp=True)
    spread_blocks(tmp_path)
    quantize_checkpoint(tmp_path, "fp8-block", block=(16, 16))
    fast, ref = load(tmp_path, "on"), load(tmp_path, "off")
    assert fast.fast_path_reason is None and fast.fast_path.batch_ok
    fused, rounded, roped = [], [], []
    monkeypatch.setattr(fp8, "gemv_fp8block_silu", lambda *a, **kw: fused.append(1) or gemv_fp8block_silu(*a, **kw))
    monkeypatch.setattr(fp8, "quant_groups", lambda *a, **kw: rounded.append(1) or quant_groups(*a, **kw))
    monkeypatch.setattr(fp8, "gemv_fp8block_xq_qkv_rope",
                        lambda *a, **kw: roped.append(1) or gemv_fp8block_xq_qkv_rope(*a, **kw))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, _, paths = run(fast, 0, PROMPT, greedy)
    # the plain steps: each GEMV input rounded once, gate/up + SiLU in one launch; QKV's and gate/up's inputs by
    # quant_groups, down's by the gate/up kernel (16 gate rows a program: one 16-wide group), o's by the attention's
    # merge where a head is one 16-wide group (else by quant_groups too)
    cfg = json.loads((tmp_path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert paths == {"fast"} and fused and len(rounded) == (2 if head_dim == 16 else 3) * len(fused)
    # rope and the q / K / V stores in the QKV GEMV where there is no q/k norm (Llama; Qwen3's rope kernel norms)
    assert len(roped) == (len(fused) if arch == "llama" else 0)
    assert tokens == run(ref, 0, PROMPT, greedy)[0]
    # two slots in the batched step (the few-row block-scaled GEMVs' tensor-core dots): each slot's tokens alone
    from tests.unit.engine_cuda.test_fast_path_batch import decode_alone, decode_together

    engine = Engine.load(tmp_path, num_slots=2, max_seq_len=48, dtype="bfloat16", fast_path="on",
                         fast_path_options=OPTIONS)
    prompts = {0: PROMPT, 1: [5, 77, 200, 9, 61]}
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    assert decode_together(engine, prompts, short) == decode_alone(engine, prompts, short)


def test_block_scaled_fp8_with_biases_keeps_the_reference_step(tmp_path):
    save_checkpoint("qwen2", tmp_path, damp=True)
    quantize_checkpoint(tmp_path, "fp8-block", block=(16, 16))
    engine = load(tmp_path, "auto")
    assert engine.fast_path is None and "biases" in engine.fast_path_reason
    with pytest.raises(ValueError, match="biases"):
        load(tmp_path, "on")


def test_non_power_of_two_blocks_keep_the_reference_step(tmp_path):
    save_checkpoint("llama", tmp_path, damp=True)
    quantize_checkpoint(tmp_path, "fp8-block", block=(24, 24))
    engine = load(tmp_path, "auto")
    assert engine.fast_path is None and "fp8 FP8 weights (block scales 24x24)" in engine.fast_path_reason


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_unfused_fp8_qkv_keeps_the_tokens(tmp_path, arch):
    # FastOptions(fp8_qkv_rope=False), the two-launch FP8 QKV the GPU runs compare with the fused default,
    # gives the reference step's tokens too
    from dataclasses import replace

    save_checkpoint(arch, tmp_path, damp=True)
    quantize_checkpoint(tmp_path, "fp8-channel", activations="dynamic")
    opts = replace(OPTIONS, fp8_qkv_rope=False)
    fast = Engine.load(tmp_path, num_slots=1, max_seq_len=48, dtype="bfloat16", fast_path="on", fast_path_options=opts)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, _, paths = run(fast, 0, PROMPT, greedy)
    assert paths == {"fast"}
    assert tokens == run(load(tmp_path, "off"), 0, PROMPT, greedy)[0]


def spied_fast_run(tmp_path, arch, monkeypatch, name: str, seen, **options) -> tuple[list[int], set, list[int]]:
    """(tokens, step paths, the reference step's tokens) of a per-channel FP8_DYNAMIC checkpoint on the fast path
    with ``options`` over OPTIONS, cuda/fp8.py's ``name`` wrapped so that ``seen(args, kwargs)`` sees each call."""
    from dataclasses import replace

    from services.decode.engine.cuda import fp8

    save_checkpoint(arch, tmp_path, damp=True)
    quantize_checkpoint(tmp_path, "fp8-channel", activations="dynamic")
    real = getattr(fp8, name)
    monkeypatch.setattr(fp8, name, lambda *a, **kw: seen(a, kw) or real(*a, **kw))
    fast = Engine.load(tmp_path, num_slots=1, max_seq_len=48, dtype="bfloat16", fast_path="on",
                       fast_path_options=replace(OPTIONS, **options))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, _, paths = run(fast, 0, PROMPT, greedy)
    return tokens, paths, run(load(tmp_path, "off"), 0, PROMPT, greedy)[0]


@pytest.mark.parametrize("arch,once", [("llama", True), ("qwen2", True), ("llama", False)])
def test_fp8_inputs_rounded_once_keep_the_tokens(tmp_path, arch, once, monkeypatch):
    # FastOptions.fp8_round_once (the default): the QKV and gate/up inputs normed and rounded by round_token, one
    # launch each, give the reference step's tokens; a spy says the GEMVs read them. Off: each GEMV program rounds
    # the input itself (no round_token), the same tokens
    calls = []
    tokens, paths, want = spied_fast_run(tmp_path, arch, monkeypatch, "round_token",
                                         lambda a, kw: calls.append(kw.get("norm_w") is not None), fp8_round_once=once)
    assert paths == {"fast"} and (all(calls) and len(calls) > 0) == once and (not calls) == (not once)
    assert tokens == want


@pytest.mark.parametrize("arch,carry", [("llama", True), ("qwen2", True), ("llama", False)])
def test_fp8_input_amax_carried_keeps_the_tokens(tmp_path, arch, carry, monkeypatch):
    # FastOptions.fp8_amax_carry (the default): the o and down GEMVs take their input's scale from the per-part
    # maxima the attention's merge and the SiLU GEMV leave; the reference step's tokens. Off: each program reduces
    # its input
    amaxes, exact = [], []

    def seen(args, kw):  # the parts' max is the input's own amax at the GEMV's launch (this step's writer's)
        amaxes.append(kw.get("amax") is not None)
        if amaxes[-1]:
            exact.append(kw["amax"].max().item() == args[0].float().abs().max().item())

    tokens, paths, want = spied_fast_run(tmp_path, arch, monkeypatch, "gemv_fp8", seen, fp8_amax_carry=carry)
    assert paths == {"fast"} and amaxes and all(a == carry for a in amaxes) and all(exact)
    assert tokens == want

