"""FP8 checkpoints: the decode engine's greedy tokens equal the real vLLM's (CPU, float32).

Tiny near-bigram checkpoints (wide argmax margins, as trained models have) quantized by
``make-model``'s FP8 writer in compressed-tensors FP8_DYNAMIC form (per-channel weight scales,
lm_head unquantized). vLLM's CPU build runs them with its W8A8 kernel (activations quantized per
token, dynamically); the engine quantizes activations the same way before its FP8 matmuls, so
both pick the same tokens (with weight-only FP8 the Llama run parted from vLLM's at a near tie).

What vLLM 0.32's CPU build cannot load, and so is tested on the engine side only against its
dequantized reference (tests/unit/engine/test_fp8.py): the fp8 block format ("Failed to find a
kernel that can implement the ScaledMM linear layer ... CPUFp8BlockScaledMMKernel requires AMX tile
support (Sapphire Rapids or newer)"), FP8 routed experts ("Unsupported FP8 MoE backend: NONE"),
per-tensor scales (its requantize_with_max_scale calls "_C::static_scaled_fp8_quant() expected at
most 0 argument(s) but received 4": the op is missing from the CPU build) and weight-only FP8 without
input activations (init_wfp8_a16_linear_kernel: "Failed to find a kernel that can implement the
ScaledMM linear layer"); the DeepSeek-V3 checkpoint here therefore keeps its routed experts in
float32 (``ignore``).
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.fp8 import is_fp8
from tests.integration.test_engine_vs_vllm import NUM_TOKENS, PROMPTS, engine_greedy
from tests.fixtures.vllm import Plain, vllm_greedy_batch

pytestmark = pytest.mark.vllm
SERVERS = {"llama": Plain("llama", fp8="fp8-channel"),
           "deepseek_v3": Plain("deepseek_v3", fp8="fp8-channel", fp8_ignore=("re:.*mlp\\.experts\\..*",))}
VLLM_SERVERS = list(SERVERS.values())


@pytest.mark.parametrize("arch", list(SERVERS))
def test_fp8_greedy_tokens_equal_vllm(tiny_model, vllm_servers, arch):
    torch.set_num_threads(1)
    model_dir = SERVERS[arch].model_dir(tiny_model)
    server = vllm_servers.get(model_dir, dtype="float32")
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=128, dtype=torch.float32)
    assert is_fp8(engine.model.layers[0].wo) and is_fp8(engine.model.layers[1].w_down if arch == "llama"
                                                        else engine.model.layers[1].shared_down)
    # the prompts in one request: vLLM's CPU W8A8 step takes ~0.7 s for this tiny model, one or three rows
    for prompt, expected in zip(PROMPTS, vllm_greedy_batch(server, PROMPTS, NUM_TOKENS), strict=True):
        assert len(expected) == NUM_TOKENS
        assert engine_greedy(engine, prompt, NUM_TOKENS) == expected
