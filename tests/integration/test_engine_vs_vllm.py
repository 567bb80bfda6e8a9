"""The decode engine's greedy tokens equal the real vLLM's (CPU, float32) for the same checkpoint.

Three prompts per family, as token ids (no tokenizer in between); vLLM generates with
``ignore_eos`` and temperature 0, the engine prefills the same ids and decodes greedily.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams
from tests.fixtures.vllm import Plain, vllm_greedy

PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 8], [1, 200, 201, 9, 77, 31, 12, 4, 66, 150, 151, 152, 5], [1, 88, 121, 150]]
NUM_TOKENS = 24

pytestmark = pytest.mark.vllm
ARCHS = ["llama", "qwen2", "qwen3", "deepseek_v3"]
VLLM_SERVERS = [Plain(arch) for arch in ARCHS]


def engine_greedy(engine: Engine, prompt: list[int], num_tokens: int) -> list[int]:
    first = int(engine.prefill(0, prompt).argmax())
    engine.start(0, first, SamplingParams(max_tokens=num_tokens - 1, ignore_eos=True))
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
    engine.release(0)
    return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_vllm(tiny_model, vllm_servers, arch):
    torch.set_num_threads(1)
    model_dir = tiny_model(arch)
    server = vllm_servers.get(model_dir, dtype="float32")
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=128, dtype=torch.float32)
    for prompt in PROMPTS:
        expected = vllm_greedy(server, prompt, NUM_TOKENS)
        assert len(expected) == NUM_TOKENS
        assert engine_greedy(engine, prompt, NUM_TOKENS) == expected
    assert engine.free_slots() == [0] and engine.active_slots() == []
