"""The fast path built over a loaded engine (its weights, its slot cache): same next token as the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from services.decode.engine.cuda.adapter import gqa_decoder_from_engine, mla_decoder_from_engine
from tests.unit.engine.hf_models import save_checkpoint

TILES = {"qkv": (8, 32, 4, 2), "o": (8, 32, 4, 1), "gate_up": (16, 32, 4, 2), "down": (8, 32, 4, 1),
         "lm_head": (16, 32, 4, 1)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(f"fast-{arch}")
            save_checkpoint(arch, made[arch])
        return made[arch]

    return get


def test_gqa_fast_path_continues_an_engine_prefill_in_its_own_slot(checkpoint):
    engine = Engine.load(checkpoint("llama"), num_slots=2, max_seq_len=48, device="cpu", dtype="bfloat16")
    prompt = [5, 9, 17, 33, 2, 71, 8]
    first = int(engine.prefill(1, prompt).argmax())
    other_slot = engine.cache.k_caches[0][0].clone()
    dec = gqa_decoder_from_engine(engine.model, 1, FastOptions(tiles=TILES, num_splits=4, block_s=16), max_steps=4)
    assert dec.k_caches[0].data_ptr() == engine.cache.k_caches[0][1].data_ptr()  # the engine's cache, no copy
    m, n = engine.model, len(prompt)
    ref = m.logits(m(torch.tensor([[first]]), torch.tensor([[n]]), torch.tensor([1])))[0, 0].float()
    dec.set_state(first, n)
    dec.step()
    assert ((dec.logits - ref).abs().max() / ref.abs().max()).item() < 3e-2  # bf16, SDPA vs split-K
    picked = int(dec.token)
    assert ref[picked] >= ref.max() - 3e-2 * ref.abs().max()  # the engine's choice or a near-tie of it
    assert int(dec.pos) == n + 1 and dec.out_tokens[:1].tolist() == [picked]
    assert torch.equal(engine.cache.k_caches[0][0], other_slot)  # slot 0 untouched


def test_mla_fast_path_refuses_q_lora_models():
    model = SimpleNamespace(cfg=SimpleNamespace(q_lora_rank=48))
    with pytest.raises(ValueError, match="q LoRA"):
        mla_decoder_from_engine(model, 0)
