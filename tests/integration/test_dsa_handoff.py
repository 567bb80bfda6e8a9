"""Sparse attention (deepseek_v32, glm_moe_dsa) handed from vLLM's CUDA cache layout to a decode slot.

No GPU vLLM serves these models here (its CPU build refuses sparse attention), so the prefill is the
decode engine's own: its prefill of a tiny checkpoint fills caches laid out as vLLM's CUDA DSA
kernels lay them out (tests/unit/prefill/vllm_dsa_twin.py: the sparse-MLA latent as ``auto``,
``fp8_ds_mla`` (FLASHMLA_SPARSE) or per-tensor ``fp8`` (FLASHINFER_MLA_SPARSE), the indexer's FP8 keys with their per-token scales, 64-token kernel blocks, one
cache group each, block tables out of order). Everything from there is the product's: vLLM's
backend classes name the layers' backends, the connector's worker picks its adapters and stages
the request, its sender writes the slot over Mooncake into a receiver process, and the engine
decodes from the received bytes. Not an end-to-end test of vLLM itself.

What is checked, per family and latent format:
- the received slot: every segment the worker wrote equals the engine's own slot where vLLM keeps
  the value as is (the ``auto`` latent, the bfloat16 rope tail of ``fp8_ds_mla``; byte-equal) and
  equals the FP8 round trip of the engine's values where vLLM keeps FP8 (``fp8_ds_mla``'s latent,
  the whole per-tensor ``fp8`` row, every index key; exactly); the tokens past the prompt are untouched;
- decoding from it, teacher-forced over 8 steps: logits bitwise equal to the engine's from its own
  slot with the same FP8 round trip; and, against the engine's own unquantized slot, equal for an
  ``auto`` latent and within 5% (relative L2, each step; 1.3-2.0% measured) for ``fp8_ds_mla`` and
  per-tensor ``fp8`` where the indexer keeps every token (``index_topk`` above the prompt). Where it
  drops tokens (top 16 of 130), FP8 index keys flip its choice between near-tied tokens of these
  random models (up to ~100% relative logit error at a step, measured), as vLLM's FP8 indexer does
  against exact keys; that variant is held to the exact comparison only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from infra.receiver import ReceiverProcess
from infra.tinymodel import make_model, make_weights
from services.decode.engine import Engine
from services.prefill.config import ExpressConfig
from services.prefill.scheduler import SaveRequest
from services.prefill.staging import RESERVED, read_stats
from shared.events import SamplingParams, SlotTarget, TransferTarget
from shared.handoff import Handoff
from tests.unit.prefill import vllm_dsa_twin as twin

MAX_SEQ_LEN = 192
NUM_BLOCKS = 8
LATENT_BLOCKS, INDEX_BLOCKS = [5, 2, 6], [1, 7, 3]  # the request's block table in each cache group
RANK, ROPE = 512, 64
STEPS = 8
K_SCALE = 0.03125  # the per-tensor fp8 cache's k_scale (a layer's _k_scale_float)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, index_topk) -> dir: make-model's tiny checkpoint with the indexer vLLM can page
    (index_head_dim 128, as both families ship) and, for GLM, the config key vLLM ropes its indexer by."""
    made: dict = {}

    def get(arch: str, index_topk: int) -> Path:
        if (arch, index_topk) not in made:
            path = make_model(arch, tmp_path_factory.mktemp(f"{arch}-{index_topk}"))
            config = json.loads((path / "config.json").read_text())
            config.update(index_head_dim=128, index_topk=index_topk)
            if arch == "glm_moe_dsa":
                config["indexer_rope_interleave"] = True
            (path / "config.json").write_text(json.dumps(config, indent=2))
            save_file(make_weights(config, 0, "float32"), str(path / "model.safetensors"), metadata={"format": "pt"})
            made[arch, index_topk] = path
        return made[arch, index_topk]

    return get


def _slots(blocks: list[int], n: int) -> torch.Tensor:
    return torch.tensor([blocks[t // twin.BLOCK_SIZE] * twin.BLOCK_SIZE + t % twin.BLOCK_SIZE for t in range(n)])


def _vllm_caches(engine: Engine, n: int, kv_cache_dtype: str, glm: bool):
    """The caches vLLM's CUDA model would hold for the prompt in slot 0, and the fake layers of its
    static forward context (with vLLM's own backend classes)."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseTRTLLMBackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    caches, ctx = {}, {}
    for layer, kv in enumerate(engine.cache.kv):
        name = f"model.layers.{layer}.self_attn.attn"
        row = kv[0, :n]
        kv_c, k_pe = row[:, :RANK], twin.gptj(row[:, RANK:])
        if kv_cache_dtype == "auto":
            cache = torch.zeros(NUM_BLOCKS, 1, twin.BLOCK_SIZE, RANK + ROPE, dtype=torch.bfloat16)
            twin.write_latent(cache, _slots(LATENT_BLOCKS, n), kv_c, k_pe)
        elif kv_cache_dtype == "fp8":  # FlashInfer's sparse MLA keeps the standard fp8 format
            cache = torch.zeros(NUM_BLOCKS, 1, twin.BLOCK_SIZE, RANK + ROPE, dtype=torch.uint8)
            twin.write_latent_fp8(cache, _slots(LATENT_BLOCKS, n), kv_c, k_pe, K_SCALE)
        else:
            cache = torch.zeros(NUM_BLOCKS, 1, twin.BLOCK_SIZE, 656, dtype=torch.uint8)
            twin.write_ds_mla(cache, _slots(LATENT_BLOCKS, n), kv_c, k_pe)
        caches[name] = cache
        backend = FlashInferMLASparseTRTLLMBackend if kv_cache_dtype == "fp8" else FlashMLASparseBackend
        ctx[name] = SimpleNamespace(attn_backend=backend, kv_cache_dtype=kv_cache_dtype, _k_scale_float=K_SCALE)
        # vLLM 0.32 gives every layer an indexer unless index_topk_pattern / index_topk_freq skip it:
        # GLM's "shared" layer 1 (indexer_types) has one there, holding keys the slot has no room for.
        name = f"model.layers.{layer}.self_attn.indexer.k_cache"
        cache = torch.zeros(NUM_BLOCKS, 1, twin.BLOCK_SIZE, 128 + 4, dtype=torch.uint8)
        if layer in engine.cache.index_k:
            keys = engine.cache.index_k[layer][0, :n]
            if glm:  # vLLM ropes GLM's indexer GPT-J style; the engine keeps evens, then odds
                keys = torch.cat([twin.gptj(keys[:, :ROPE]), keys[:, ROPE:]], dim=-1)
            twin.write_index_keys(cache, _slots(INDEX_BLOCKS, n), keys)
        else:
            cache.random_(0, 256, generator=torch.Generator().manual_seed(layer))
        caches[name] = cache
        ctx[name] = SimpleNamespace(get_attn_backend=lambda: DeepseekV32IndexerBackend, uses_shuffled_layout=False)
    return caches, ctx


def _expected_slot(engine: Engine, n: int, kv_cache_dtype: str) -> torch.Tensor:
    """Slot 0's bytes with vLLM's FP8 round trips applied: what the decode slot must receive."""
    saved = engine.slot_buffer(0).clone()
    for kv in engine.cache.kv:
        if kv_cache_dtype == "fp8_ds_mla":
            kv[0, :n, :RANK] = twin.dequant_ds_mla_latent(kv[0, :n, :RANK]).to(kv.dtype)
        if kv_cache_dtype == "fp8":
            kv[0, :n] = ((kv[0, :n].float() / K_SCALE).to(twin.FP8).float() * K_SCALE).to(kv.dtype)
    for keys in engine.cache.index_k.values():
        keys[0, :n] = twin.dequant_index_keys(keys[0, :n]).to(keys.dtype)
    want = engine.slot_buffer(0).clone()
    engine.slot_buffer(0).copy_(saved)
    return want


def _hand_over(engine: Engine, path: Path, n: int, kv_cache_dtype: str, glm: bool, nats_url: str,
               tmp_path: Path) -> bytes:
    """Stage the prompt from vLLM's caches with the connector's worker and write it over Mooncake
    into a receiver laid out as the engine's slot; returns the receiver's bytes."""
    from transformers import AutoConfig

    from services.prefill.worker import ExpressWorker

    caches, ctx = _vllm_caches(engine, n, kv_cache_dtype, glm)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=AutoConfig.from_pretrained(path), use_mla=True,
                                     max_model_len=MAX_SEQ_LEN, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),  # vLLM's --kv-cache-dtype, canonicalized
        compilation_config=SimpleNamespace(static_forward_context=ctx), parallel_config=None)
    groups = [SimpleNamespace(layer_names=[k for k in caches if k.endswith(".attn")],
                              kv_cache_spec=SimpleNamespace(block_size=twin.BLOCK_SIZE)),
              SimpleNamespace(layer_names=[k for k in caches if k.endswith("k_cache")],
                              kv_cache_spec=SimpleNamespace(block_size=twin.BLOCK_SIZE))]
    stats = str(tmp_path / "staging-stats")
    config = ExpressConfig(nats_url=nats_url, staging_slots=1, staging_max_tokens=MAX_SEQ_LEN, stats_path=stats)
    worker = ExpressWorker(config, vllm_config, SimpleNamespace(kv_cache_groups=groups), "dsa-test")
    rx = ReceiverProcess("mooncake", engine.layout.slot_nbytes, fill=0xEE)
    try:
        worker.register_kv_caches(caches)
        target = TransferTarget(node_id="decode-dsa", transport="mooncake", endpoint=rx.endpoint,
                                slot=SlotTarget(slot=1, base_addr=rx.addr, nbytes=rx.nbytes), layout=engine.layout)
        handoff = Handoff(request_id="dsa-1", lease_id="lease-1", generation=1, target=target)
        worker.states.set(0, RESERVED)  # as the scheduler reserves it
        worker.wait_for_save([SaveRequest("dsa-1", handoff, [LATENT_BLOCKS, INDEX_BLOCKS], n, staging_slot=0)])
        deadline = time.monotonic() + 60
        while read_stats(stats)["kv_ready"] + read_stats(stats)["kv_failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_stats(stats)["kv_ready"] == 1, read_stats(stats)
        return rx.read(str(tmp_path / "slot.bin"))
    finally:
        worker.shutdown()
        rx.close()


def _decode(engine: Engine, slot: int, first: int, fed: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """STEPS greedy steps of one slot, alone; with ``fed`` each step's input token is forced
    (teacher forcing), so logits of two runs compare step by step. Returns (logits [STEPS, V], inputs)."""
    engine.start(slot, first, SamplingParams(max_tokens=STEPS, ignore_eos=True, num_speculative_tokens=0))
    logits, inputs = [], []
    while engine.active_slots():
        if fed is not None:
            engine.slots[slot].pending = fed[len(inputs)]
        inputs.append(engine.slots[slot].pending)
        engine.step()
        logits.append(engine.last_logits[0, 0].clone())
    engine.release(slot)
    return torch.stack(logits), inputs


CASES = [
    # arch, vLLM's latent kv cache dtype, index_topk (16: drops most of the prompt; 4096: keeps it all)
    ("deepseek_v32", "auto", 16),
    ("deepseek_v32", "fp8_ds_mla", 16),
    ("glm_moe_dsa", "auto", 16),
    ("glm_moe_dsa", "fp8_ds_mla", 16),
    ("deepseek_v32", "fp8_ds_mla", 4096),
    ("glm_moe_dsa", "auto", 4096),
    ("glm_moe_dsa", "fp8", 4096),
]


@pytest.mark.parametrize("arch,kv_cache_dtype,index_topk", CASES)
def test_sparse_attention_kv_lands_in_the_decode_slot(checkpoint, nats_url, tmp_path, arch, kv_cache_dtype,
                                                      index_topk):
    path = checkpoint(arch, index_topk)
    engine = Engine.load(path, num_slots=3, max_seq_len=MAX_SEQ_LEN, dtype=torch.bfloat16, num_speculative_tokens=1)
    prompt = [int(t) for t in torch.randint(1, 250, (130,), generator=torch.Generator().manual_seed(11))]
    n = len(prompt)
    first = int(engine.prefill(0, prompt).argmax())
    assert sorted(engine.cache.index_k) == ([0, 1, 2] if arch == "deepseek_v32" else [0, 2])  # MTP layer 2 too

    raw = _hand_over(engine, path, n, kv_cache_dtype, arch == "glm_moe_dsa", nats_url, tmp_path)

    got = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    want = _expected_slot(engine, n, kv_cache_dtype)
    own = engine.slot_buffer(0)
    for seg in engine.layout.segments:
        lo, written = seg.offset_bytes, n * seg.bytes_per_token
        where = f"layer {seg.layer} {seg.name}"
        assert torch.equal(got[lo: lo + written], want[lo: lo + written]), where
        assert bool((got[lo + written: lo + seg.bytes_per_token * engine.layout.max_tokens] == 0xEE).all()), where
        rows = lambda buf: buf[lo: lo + written].view(torch.bfloat16).view(n, -1)  # noqa: E731
        if seg.name == "kv_latent" and kv_cache_dtype != "fp8":  # a bfloat16 rope tail: the engine's bytes
            assert torch.equal(rows(got)[:, RANK:], rows(own)[:, RANK:]), where
            if kv_cache_dtype == "auto":
                assert torch.equal(rows(got), rows(own)), where

    # decode from the received slot (1) and, for reference, from slot 2 holding the same FP8 round trip
    engine.slot_buffer(1).copy_(got)
    engine.slot_buffer(2).copy_(want)
    own_logits, fed = _decode(engine, 0, first)
    engine.inject(1, n)
    received, _ = _decode(engine, 1, first, fed)
    engine.inject(2, n)
    round_trip, _ = _decode(engine, 2, first, fed)
    assert torch.equal(received, round_trip)
    err = ((received - own_logits).norm(dim=-1) / own_logits.norm(dim=-1)).tolist()
    if index_topk >= n:  # the indexer keeps every token: the latent's FP8 rounding is the only difference
        assert max(err) <= (0.0 if kv_cache_dtype == "auto" else 0.05), err


def test_a_slot_layer_without_an_indexer_cache_is_refused(checkpoint, nats_url, tmp_path):
    """vLLM registering no indexer cache for a layer whose index keys the decode slot keeps (another
    indexer schedule than the checkpoint's) stops the connector at start, not with wrong keys later."""
    from transformers import AutoConfig

    from services.prefill.worker import ExpressWorker

    path = checkpoint("deepseek_v32", 16)
    engine = Engine.load(path, num_slots=1, max_seq_len=MAX_SEQ_LEN, dtype=torch.bfloat16, num_speculative_tokens=1)
    caches, ctx = _vllm_caches(engine, 4, "auto", glm=False)
    del caches["model.layers.1.self_attn.indexer.k_cache"]
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=AutoConfig.from_pretrained(path), use_mla=True,
                                     max_model_len=MAX_SEQ_LEN, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context=ctx), parallel_config=None)
    config = ExpressConfig(nats_url=nats_url, staging_slots=1, stats_path=str(tmp_path / "stats"))
    worker = ExpressWorker(config, vllm_config, SimpleNamespace(kv_cache_groups=[]), "dsa-refused")
    try:
        with pytest.raises(ValueError, match=r"layers \[1\] keep index keys"):
            worker.register_kv_caches(caches)
    finally:
        worker.shutdown()
