"""FP8 (compressed-tensors per-channel / per-tensor) Llama-family models on the fast path, its Triton
kernels interpreted on CPU (conftest.py): greedy tokens through
``Engine(fast_path="on")`` equal the reference step's (``fast_path="off"``, which dequantizes in
torch), with and without FP8 activations, and for Qwen3's q/k norm; what the FP8 step does not read
(block scales on a Llama-family model) keeps the reference step and says why; block-scaled DeepSeek-family
checkpoints: test_fp8_block_fast_path.py.
"""

from __future__ import annotations

import pytest
import torch

from infra.tinymodel_fp8 import quantize_checkpoint
from services.decode.engine import Engine
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


def test_block_scaled_fp8_keeps_the_reference_step(tmp_path):
    save_checkpoint("llama", tmp_path, damp=True)
    quantize_checkpoint(tmp_path, "fp8-block")
    engine = load(tmp_path, "auto")
    assert engine.fast_path is None and "fp8 FP8 weights (block scales 128x128)" in engine.fast_path_reason
    with pytest.raises(ValueError, match="per-channel or per-tensor scales on Llama-family"):
        load(tmp_path, "on")


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
