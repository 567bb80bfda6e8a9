"""The router learns each vLLM server's --kv-cache-dtype from its metrics and puts it in every claim,
so the coordinator pairs the request only with decode nodes whose slots keep KV in that dtype."""

from __future__ import annotations

import httpx
import pytest

from services.router import backend
from services.router.backend import ModelInfo, kv_cache_dtype_from_metrics
from services.router.express import claim_request

INFO_LINE = ('vllm:cache_config_info{block_size="128",cache_dtype="%s",calculate_kv_scales="False",'
             'engine="0",gpu_memory_utilization="0.9"} 1.0\n')


@pytest.mark.parametrize("text, expected", [
    ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
     "# TYPE vllm:cache_config_info gauge\n" + INFO_LINE % "fp8", "fp8"),
    (INFO_LINE % "auto", "auto"),
    ("vllm:num_requests_running 0.0\n", ""),  # no cache info: not known
    ("", ""),
])
def test_kv_cache_dtype_from_metrics(text, expected):
    assert kv_cache_dtype_from_metrics(text) == expected


@pytest.mark.parametrize("metrics", [INFO_LINE % "fp8_e5m2", None])  # None: /metrics answers 404
async def test_discovered_models_carry_the_servers_kv_cache_dtype(tmp_path, monkeypatch, metrics):
    monkeypatch.setattr(backend, "load_tokenizer", lambda path: None)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "root": str(tmp_path), "max_model_len": 64}]})
        if request.url.path == "/metrics" and metrics is not None:
            return httpx.Response(200, text=metrics)
        return httpx.Response(404)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        [info] = await backend.discover(client, "http://vllm:8000")
    assert info.kv_cache_dtype == ("fp8_e5m2" if metrics else "")
    claim = claim_request(info, "r1", num_prompt_tokens=3, max_tokens=4, wait_ms=0)
    assert claim.kv_cache_dtype == info.kv_cache_dtype


def test_claims_of_a_model_without_a_known_kv_cache_dtype_pair_as_before():
    info = ModelInfo(name="m", root="/m", url="http://vllm:8000", max_model_len=64)
    assert claim_request(info, "r1", num_prompt_tokens=1, max_tokens=1, wait_ms=0).kv_cache_dtype == ""
