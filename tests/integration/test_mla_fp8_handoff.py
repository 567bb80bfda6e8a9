"""A dense MLA FP8 latent (DeepSeek-V3, ``--kv-cache-dtype fp8``) handed from vLLM's CUDA cache layout to a
decode slot that keeps it in FP8, as its bytes.

vLLM's CPU build keeps the MLA latent in the model dtype only, so the prefill is the decode engine's own with
an FP8 latent: its reference step writes each row as vLLM's CUDA ``concat_and_cache_mla`` writes it for
``fp8`` (the row divided by the layer's k_scale, rounded to nearest: kvquant.quantize(nearest=True)) and attends over
them as the decode step does. Those rows, the rope part in vLLM's GPT-J pair order, fill a FLASHMLA cache
(``[blocks, 64, 576]`` uint8, 64-token kernel blocks, the block table out of order). From there everything is
the product's: vLLM's backend class names the layers' backend, the connector's worker picks its adapter and
stages the request in the fp8_e4m3 layout, its sender writes the slot over Mooncake into a receiver process,
and the engine decodes from the received bytes. Not an end-to-end test of vLLM itself.

Checked: the received slot's latent (MTP layer included) is byte for byte the engine's own FP8 slot, past the
prompt untouched; decoding from it, teacher-forced, gives logits bitwise equal to the engine's from its own
slot; and a bf16 slot is never filled from the FP8 cache (the sender refuses the layout, naming the flag).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infra.receiver import ReceiverProcess
from infra.tinymodel import make_model
from services.decode.engine import Engine
from services.prefill.config import ExpressConfig
from services.prefill.scheduler import SaveRequest
from services.prefill.staging import RESERVED, read_stats
from shared.events import SlotTarget, TransferTarget
from shared.handoff import Handoff
from tests.integration.test_dsa_handoff import _decode  # STEPS greedy steps, teacher-forced when fed
from tests.unit.prefill.vllm_dsa_twin import gptj

MAX_SEQ_LEN = 192
NUM_BLOCKS, BLOCK_SIZE = 8, 64
BLOCKS = [5, 2, 6]  # the request's block table
K_SCALE = 0.03125  # each layer's _k_scale_float (a checkpoint's calibrated scale)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_model("deepseek_v3", tmp_path_factory.mktemp("dsv3-fp8-latent"))


def _fp8_engine(path: Path, slots: int = 3) -> Engine:
    engine = Engine.load(path, num_slots=slots, max_seq_len=MAX_SEQ_LEN, dtype=torch.bfloat16,
                         kv_cache_dtype="fp8", num_speculative_tokens=1)
    engine.cache.scales = [(K_SCALE, K_SCALE)] * len(engine.cache.scales)
    return engine


def _vllm_caches(engine: Engine, n: int):
    """FLASHMLA's FP8 caches for the prompt in slot 0 (each row's bytes, the rope part in GPT-J pair order), and
    the layers of its static forward context."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    rank = engine.cfg.kv_lora_rank
    caches, ctx = {}, {}
    slots = torch.tensor([BLOCKS[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(n)])
    for layer, kv in enumerate(engine.cache.kv):
        name = f"model.layers.{layer}.self_attn.attn"
        row = kv[0, :n]
        cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, row.shape[1], dtype=torch.uint8)
        cache.view(-1, row.shape[1])[slots] = torch.cat([row[:, :rank], gptj(row[:, rank:])], dim=-1)
        caches[name] = cache
        ctx[name] = SimpleNamespace(attn_backend=FlashMLABackend, kv_cache_dtype="fp8", _k_scale_float=K_SCALE)
    return caches, ctx


def _hand_over(engine: Engine, target_layout, path: Path, n: int, nats_url: str, tmp_path: Path,
               cache_dtype: str = "fp8") -> tuple[bytes, dict]:
    """Stage the prompt from FLASHMLA's caches with the connector's worker and write it over Mooncake into a
    receiver laid out as ``target_layout``; returns (the receiver's bytes, the staging stats)."""
    from transformers import AutoConfig

    from services.prefill.worker import ExpressWorker

    caches, ctx = _vllm_caches(engine, n)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=AutoConfig.from_pretrained(path), use_mla=True,
                                     max_model_len=MAX_SEQ_LEN, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),  # vLLM's --kv-cache-dtype
        compilation_config=SimpleNamespace(static_forward_context=ctx), parallel_config=None)
    groups = [SimpleNamespace(layer_names=list(caches), kv_cache_spec=SimpleNamespace(block_size=BLOCK_SIZE))]
    stats = str(tmp_path / "staging-stats")
    config = ExpressConfig(nats_url=nats_url, staging_slots=1, staging_max_tokens=MAX_SEQ_LEN, stats_path=stats)
    worker = ExpressWorker(config, vllm_config, SimpleNamespace(kv_cache_groups=groups), "mla-fp8-test")
    rx = ReceiverProcess("mooncake", target_layout.slot_nbytes, fill=0xEE)
    try:
        worker.register_kv_caches(caches)
        assert worker.spec.dtype == "fp8_e4m3"  # staged as the bytes, not dequantized
        target = TransferTarget(node_id="decode-mla-fp8", transport="mooncake", endpoint=rx.endpoint,
                                slot=SlotTarget(slot=1, base_addr=rx.addr, nbytes=rx.nbytes), layout=target_layout)
        handoff = Handoff(request_id="mla-fp8-1", lease_id="lease-1", generation=1, target=target)
        worker.states.set(0, RESERVED)  # as the scheduler reserves it
        worker.wait_for_save([SaveRequest("mla-fp8-1", handoff, [BLOCKS], n, staging_slot=0)])
        deadline = time.monotonic() + 60
        while read_stats(stats)["kv_ready"] + read_stats(stats)["kv_failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return rx.read(str(tmp_path / "slot.bin")), read_stats(stats)
    finally:
        worker.shutdown()
        rx.close()


def test_fp8_latent_lands_in_the_decode_slot_as_its_bytes(checkpoint, nats_url, tmp_path):
    engine = _fp8_engine(checkpoint)
    prompt = [int(t) for t in torch.randint(1, 250, (130,), generator=torch.Generator().manual_seed(11))]
    n = len(prompt)
    first = int(engine.prefill(0, prompt).argmax())
    assert len(engine.cache.kv) == engine.cfg.num_layers + 1  # the MTP layer's latent rides along

    raw, stats = _hand_over(engine, engine.layout, checkpoint, n, nats_url, tmp_path)
    assert stats["kv_ready"] == 1, stats

    got = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    own = engine.slot_buffer(0)
    for seg in engine.layout.segments:
        lo, written = seg.offset_bytes, n * seg.bytes_per_token
        where = f"layer {seg.layer} {seg.name}"
        assert got[lo: lo + written].any() and torch.equal(got[lo: lo + written], own[lo: lo + written]), where
        assert bool((got[lo + written: lo + seg.bytes_per_token * engine.layout.max_tokens] == 0xEE).all()), where

    engine.slot_buffer(1).copy_(got)
    own_logits, fed = _decode(engine, 0, first)
    engine.inject(1, n)
    received, _ = _decode(engine, 1, first, fed)
    assert torch.equal(received, own_logits)


def test_a_bf16_slot_is_not_filled_from_an_fp8_latent(checkpoint, nats_url, tmp_path):
    engine = _fp8_engine(checkpoint, slots=1)
    prompt = [7, 19, 3, 88, 41, 5, 60]
    engine.prefill(0, prompt)
    bf16 = Engine.load(checkpoint, num_slots=1, max_seq_len=MAX_SEQ_LEN, dtype=torch.bfloat16,
                       num_speculative_tokens=1).layout
    raw, stats = _hand_over(engine, bf16, checkpoint, len(prompt), nats_url, tmp_path)
    assert stats["kv_ready"] == 0 and stats["kv_failed"] == 1, stats
    assert bool((torch.frombuffer(bytearray(raw), dtype=torch.uint8) == 0xEE).all())  # nothing written
