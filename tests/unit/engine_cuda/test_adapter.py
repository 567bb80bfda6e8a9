"""The fast path built over a loaded engine (its weights, its slot cache): same next token as the engine."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from services.decode.engine.cuda.adapter import attention_splits, gqa_decoder_from_engine, mla_decoder_from_engine
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


def test_mla_fast_path_lays_out_q_lora_and_group_limited_routing(checkpoint):
    engine = Engine.load(checkpoint("deepseek_v3"), num_slots=1, max_seq_len=16, device="cpu", dtype="bfloat16",
                         num_speculative_tokens=1)
    cfg, blk = engine.model.cfg, engine.model.layers[1]
    dec = mla_decoder_from_engine(engine.model, 0)
    d, lw = dec.model.dims, dec.model.layers[1]
    assert (d.q_lora_rank, d.n_group, d.topk_group) == (cfg.q_lora_rank, cfg.n_group, cfg.topk_group) == (48, 2, 1)
    assert torch.equal(lw.wqkv_a, torch.cat([blk.wkv_a.data, blk.wq_a.data]))  # the latent first, then q_a
    assert lw.wq_b.data_ptr() == blk.wq_b.data_ptr() and lw.q_a_norm.data_ptr() == blk.q_a_norm.data_ptr()
    assert dec.model.mtp.layer.wq_b is not None  # the MTP layer's block has q LoRA too
    assert dec.stacks[1].qkv.shape[1] == cfg.num_heads * (16 + 16) + cfg.kv_lora_rank + 16 + 48


@pytest.mark.parametrize("rows,splits", [
    (1, 1), (64, 1), (65, 2), (131, 2),  # a 128-token slot with 3 draft rows: 3 splits were refused on the GPU
    (193, 4), (300, 4), (513, 8), (1027, 16), (8192, 16),  # long slots: more splits (their rows, not the
    (8193, 32), (16384, 32), (16387, 64), (131072, 64),      # context: a short one leaves the rest empty)
])
def test_mla_attention_splits_are_a_power_of_two(rows, splits):
    assert attention_splits(rows) == splits
