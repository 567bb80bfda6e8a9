"""FP8 through the express lane's connector (real vLLM on CPU, Mooncake).

- FP8 KV: a prefill vLLM keeping its KV cache in FP8 (``--kv-cache-dtype fp8``) hands the cache's bytes
  over unchanged into a decode slot that keeps FP8 too, and the engine decoding from that slot gives
  vLLM-alone's greedy tokens with the same cache dtype; a slot of another KV dtype gets no write but a
  KvFailed whose reason names the flag to change.
- FP8 weights: a prefill vLLM serving a compressed-tensors FP8 checkpoint (per-channel weight scales,
  FP8_DYNAMIC activations, lm_head unquantized; vLLM's CPU W8A8 kernel) hands its KV to an engine that
  loads the same checkpoint with its weights in FP8, which then decodes vLLM-alone's greedy tokens of
  that checkpoint."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import torch

from infra.receiver import ReceiverProcess
from services.decode.engine import Engine
from services.decode.engine.fp8 import is_fp8
from shared.bus import Bus
from shared.events import KvFailed, KvReady, SamplingParams
from tests.fixtures.prefill import Express
from tests.fixtures.cpu_isa import VLLM_CPU_FP8_KV, needs_vllm_cpu_fp8_kv
from tests.fixtures.vllm import Plain, vllm_greedy
from tests.integration.test_prefill_kv import KvEvents, decode_layout, handoff_params, wait_all_free

pytestmark = pytest.mark.vllm
FP8 = ("--kv-cache-dtype", "fp8")
FP8_WEIGHTS = "fp8-channel"
VLLM_SERVERS = [Express("llama"), Express("llama", fp8=FP8_WEIGHTS), Plain("llama", fp8=FP8_WEIGHTS)] + (
    [Express("llama", vllm_args=FP8), Plain("llama", extra_args=FP8)] if VLLM_CPU_FP8_KV else [])  # where vLLM can
MAX_TOKENS = 256
PROMPT = [0] + [(17 * i + 5) % 700 + 5 for i in range(150)]  # 151 tokens: two CPU blocks of 128
NUM_TOKENS = 16


@pytest.fixture
async def bus(nats_url):
    b = await Bus.connect(nats_url, name="test-fp8-kv-handoff")
    yield b
    await b.close()


async def _handoff(prefill, layout, bus, tmp_path) -> tuple[object, dict, bytes]:
    """(KvReady or KvFailed, the completion, the receiving slot's bytes) of PROMPT's handoff."""
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    events = KvEvents()
    await events.start(bus, node_id)
    rx = ReceiverProcess("mooncake", layout.slot_nbytes, fill=0xEE)
    try:
        _, params = handoff_params(rx, layout, node_id)
        async with httpx.AsyncClient() as client:
            resp = await prefill.complete(client, PROMPT, kv_transfer_params=params)
        event, _ = await events.next()
        return event, resp, rx.read(str(tmp_path / "slot"))
    finally:
        rx.close()
        await events.sub.unsubscribe()


async def _decode_after_handoff(prefill, engine, bus, tmp_path) -> list[int]:
    """PROMPT's KV written by the prefill's connector into the engine's slot 0, then NUM_TOKENS greedy tokens
    from the prefill's first token on."""
    event, resp, raw = await _handoff(prefill, engine.layout, bus, tmp_path)
    assert isinstance(event, KvReady), event
    assert event.nbytes == sum(len(PROMPT) * s.bytes_per_token for s in engine.layout.segments)
    engine.slot_buffer(0).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    engine.inject(0, len(PROMPT))
    first = resp["choices"][0]["token_ids"][0]
    engine.start(0, first, SamplingParams(max_tokens=NUM_TOKENS - 1, ignore_eos=True))
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
    return tokens


async def test_fp8_checkpoint_handoff_decodes_vllms_tokens(express_vllm, vllm_servers, tiny_model, bus, tmp_path):
    torch.set_num_threads(1)
    prefill = express_vllm("llama", fp8=FP8_WEIGHTS)
    engine = Engine.load(prefill.model_dir, num_slots=1, max_seq_len=MAX_TOKENS, dtype=torch.float32)
    assert is_fp8(engine.model.layers[0].wqkv) and is_fp8(engine.model.layers[1].w_down)
    tokens = await _decode_after_handoff(prefill, engine, bus, tmp_path)
    alone = vllm_servers.get(Plain("llama", fp8=FP8_WEIGHTS).model_dir(tiny_model), dtype="float32")
    assert tokens == await asyncio.to_thread(vllm_greedy, alone, PROMPT, NUM_TOKENS)
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats


@needs_vllm_cpu_fp8_kv
async def test_fp8_kv_handoff_decodes_vllms_tokens(express_vllm, vllm_servers, tiny_model, bus, tmp_path):
    torch.set_num_threads(1)
    prefill = express_vllm("llama", vllm_args=FP8)
    engine = Engine.load(prefill.model_dir, num_slots=1, max_seq_len=MAX_TOKENS, dtype=torch.float32,
                         kv_cache_dtype="fp8")
    assert engine.layout.dtype == "fp8_e4m3"
    tokens = await _decode_after_handoff(prefill, engine, bus, tmp_path)
    spec = Plain("llama", extra_args=FP8)
    alone = vllm_servers.get(spec.model_dir(tiny_model), dtype="float32", extra_args=FP8)
    assert tokens == await asyncio.to_thread(vllm_greedy, alone, PROMPT, NUM_TOKENS)
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats


@needs_vllm_cpu_fp8_kv
async def test_a_slot_of_another_kv_dtype_is_refused_with_the_flag_to_change(express_vllm, bus, tmp_path):
    prefill = express_vllm("llama", vllm_args=FP8)
    layout = decode_layout(prefill.model_dir, "float32", with_mtp=False)
    event, _, raw = await _handoff(prefill, layout, bus, tmp_path)
    assert isinstance(event, KvFailed), event
    assert "prefill stages KV in fp8_e4m3" in event.reason and "decode --kv-cache-dtype fp8_e4m3" in event.reason
    assert set(raw) == {0xEE}  # nothing written
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats


async def test_an_fp8_slot_behind_a_prefill_of_the_model_dtype_is_refused(express_vllm, bus, tmp_path):
    """The other way round (and on any CPU): vLLM keeps its KV in the model dtype, the slot in FP8."""
    prefill = express_vllm("llama")
    layout = decode_layout(prefill.model_dir, "fp8_e4m3", with_mtp=False)
    event, _, raw = await _handoff(prefill, layout, bus, tmp_path)
    assert isinstance(event, KvFailed), event
    assert "decode slot keeps fp8_e4m3" in event.reason and "vLLM --kv-cache-dtype fp8_e4m3" in event.reason
    assert set(raw) == {0xEE}  # nothing written
    stats = await wait_all_free(prefill)
    assert stats["free"] == stats["total"], stats
