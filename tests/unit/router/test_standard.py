"""Standard lane forwarding: pass-through of vLLM errors, and vLLM's native P/D proxy protocol."""

from __future__ import annotations

import json

import httpx
import pytest

from services.router import standard
from services.router.errors import ApiError


def _transport(seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            if body.get("model") == "bad":
                return httpx.Response(400, json={"error": {"message": "too long", "type": "BadRequestError",
                                                           "param": None, "code": 400}})
            params = None if body.get("model") == "plain" else {"remote_engine_id": "e1", "remote_block_ids": [1, 2]}
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": params})
        return httpx.Response(200, json={"choices": [{"text": "answer"}], "echo": body["kv_transfer_params"]})
    return httpx.MockTransport(handler)


async def test_native_pool_protocol():
    seen: list = []
    async with httpx.AsyncClient(transport=_transport(seen)) as client:
        resp = await standard.forward_native_pool(
            client, "http://prefill", "http://decode", "/v1/completions",
            {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False}, False, {}, 10.0)
    assert resp.status_code == 200
    (host1, prefill), (host2, decode) = seen
    assert (host1, host2) == ("prefill", "decode")
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["max_tokens"] == 9 and decode["kv_transfer_params"] == {"remote_engine_id": "e1",
                                                                          "remote_block_ids": [1, 2]}
    assert json.loads(resp.body)["choices"][0]["text"] == "answer"


async def test_native_pool_errors_pass_through():
    async with httpx.AsyncClient(transport=_transport([])) as client:
        with pytest.raises(standard.UpstreamError) as info:
            await standard.forward_native_pool(client, "http://prefill", "http://decode", "/v1/completions",
                                               {"model": "bad", "prompt": "x"}, False, {}, 10.0)
        assert info.value.status == 400 and b"too long" in info.value.body
        with pytest.raises(ApiError) as err:
            await standard.forward_native_pool(client, "http://prefill", "http://decode", "/v1/completions",
                                               {"model": "plain", "prompt": "x"}, False, {}, 10.0)
        assert err.value.status == 503


async def test_forward_passes_status_and_unreachable_is_503():
    async with httpx.AsyncClient(transport=_transport([])) as client:
        resp = await standard.forward(client, "http://prefill", "/v1/completions", {"model": "bad"}, True, {}, 5.0)
        assert resp.status_code == 400 and b"too long" in resp.body

    def refuse(request):
        raise httpx.ConnectError("refused")
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(ApiError) as err:
            await standard.forward(client, "http://nowhere", "/v1/completions", {}, False, {}, 5.0)
        assert err.value.status == 503
