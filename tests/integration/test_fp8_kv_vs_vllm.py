"""FP8 KV cache: the decode engine's greedy tokens equal the real vLLM's (CPU, float32) when both
keep K/V in FP8 (vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e5m2``, the engine's ``kv_cache_dtype``).

vLLM's CPU attention writes each token's K/V truncated to FP8 and reads them back dequantized into
fp32 (services/decode/engine/kvquant.py); the engine's reference step does the same, prompt and
output alike, so both pick the same tokens. The server's metrics say which KV cache dtype it runs
with, as the router reads it for its claims.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from services.decode.engine import Engine
from services.router.backend import kv_cache_dtype_from_metrics
from tests.fixtures.cpu_isa import VLLM_CPU_FP8_KV, needs_vllm_cpu_fp8_kv
from tests.fixtures.vllm import Plain, vllm_greedy
from tests.integration.test_engine_vs_vllm import NUM_TOKENS, PROMPTS, engine_greedy

pytestmark = [pytest.mark.vllm, needs_vllm_cpu_fp8_kv]
SERVERS = {kv: Plain("llama", extra_args=("--kv-cache-dtype", kv)) for kv in ("fp8", "fp8_e5m2")}
VLLM_SERVERS = list(SERVERS.values()) if VLLM_CPU_FP8_KV else []  # none started where vLLM cannot run them


@pytest.mark.parametrize("kv_cache_dtype", list(SERVERS))
def test_fp8_kv_greedy_tokens_equal_vllm(tiny_model, vllm_servers, kv_cache_dtype):
    torch.set_num_threads(1)
    spec = SERVERS[kv_cache_dtype]
    model_dir = spec.model_dir(tiny_model)
    server = vllm_servers.get(model_dir, dtype="float32", extra_args=spec.extra_args)
    assert kv_cache_dtype_from_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text) == kv_cache_dtype
    engine = Engine.load(model_dir, num_slots=1, max_seq_len=128, dtype=torch.float32,
                         kv_cache_dtype=kv_cache_dtype)
    assert engine.layout.dtype == {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    for prompt in PROMPTS:
        expected = vllm_greedy(server, prompt, NUM_TOKENS)
        assert len(expected) == NUM_TOKENS
        assert engine_greedy(engine, prompt, NUM_TOKENS) == expected
