"""DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa) on the engine's reference step: the indexer's choice is
what HF transformers computes (logits: test_logits_vs_hf.py), it really drops tokens, the indexer's
keys are part of the slot layout, and speculative decoding keeps the output exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams
from shared.kvlayout import kv_shape_from_hf_config, layout_spec
from tests.unit.engine.test_engine_behaviour import PROMPTS, run
from tests.unit.engine.test_logits_vs_hf import rel_err

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)


@pytest.mark.parametrize("arch, indexed", [("deepseek_v32", (0, 1, 2)), ("glm_moe_dsa", (0, 2))])
def test_the_slot_holds_each_indexers_keys_after_its_layers_latent(hf_checkpoint, arch, indexed):
    """Every layer with an indexer of its own (GLM's layer 1 reuses layer 0's choice; the MTP layer,
    layer 2, has one) keeps its keys in an index_k segment right after its latent."""
    path, hf = hf_checkpoint(arch)
    config = json.loads((path / "config.json").read_text())
    spec = layout_spec(kv_shape_from_hf_config(config), "bfloat16", 40)
    names = [(s.layer, s.name, s.bytes_per_token) for s in spec.segments]
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    latent, index = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2, config["index_head_dim"] * 2
    assert names == [seg for i in range(layers)
                     for seg in [(i, "kv_latent", latent)] + ([(i, "index_k", index)] if i in indexed else [])]
    assert spec.slot_nbytes == 40 * (layers * latent + len(indexed) * index)
    engine = Engine.load(path, num_slots=1, max_seq_len=32, dtype=torch.float32, num_speculative_tokens=0)
    assert sorted(engine.cache.index_k) == [i for i in indexed if i < config["num_hidden_layers"]]  # no MTP cache


def test_the_fast_path_serves_sparse_attention_with_q_lora_and_says_why_not_without(hf_checkpoint):
    import dataclasses
    import types

    from services.decode.engine import fastpath

    path, _ = hf_checkpoint("deepseek_v32")
    engine = Engine.load(path, num_slots=1, max_seq_len=32, dtype=torch.float32)
    for k in (0, 1):  # plain steps and MTP drafts alike
        assert fastpath.engine_reason("auto", engine.model, torch.device("cuda"), torch.bfloat16, k) is None
    no_lora = types.SimpleNamespace(cfg=dataclasses.replace(engine.model.cfg, q_lora_rank=None), family="mla",
                                    cache=engine.model.cache)
    reason = fastpath.engine_reason("auto", no_lora, torch.device("cuda"), torch.bfloat16, 0)
    assert "sparse attention" in reason and "q LoRA" in reason


def test_the_indexer_drops_tokens(hf_checkpoint, tmp_path):
    """The same weights with a top-k above every context (dense MLA) give other logits than HF's
    sparse model, and the engine's sparse ones equal HF's: the selection is doing work."""
    path, hf = hf_checkpoint("deepseek_v32")
    dense = tmp_path / "dense"
    shutil.copytree(path, dense)
    config = json.loads((dense / "config.json").read_text())
    config["index_topk"] = 4096
    (dense / "config.json").write_text(json.dumps(config))
    prompt = [int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    sparse_logits = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32).prefill(0, prompt)
    dense_logits = Engine.load(dense, num_slots=1, max_seq_len=64, dtype=torch.float32).prefill(0, prompt)
    assert rel_err(sparse_logits, ref) < 1e-4
    assert rel_err(dense_logits, ref) > 1e-2


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_speculative_greedy_equals_plain_greedy(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    plain = run(Engine.load(path, num_slots=1, max_seq_len=128, dtype=torch.float32), 0, PROMPTS[0], GREEDY)
    for k in (1, 3):
        engine = Engine.load(path, num_slots=1, max_seq_len=128, dtype=torch.float32, num_speculative_tokens=k,
                             adaptive_speculation=False)  # every step drafts: the draft path is what is tested
        assert run(engine, 0, PROMPTS[0], GREEDY) == plain
        assert engine.spec_counters["draft_tokens"] > 0
    assert len(plain) == 65


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_make_model_writes_a_sparse_attention_checkpoint_the_engine_decodes_as_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from infra.tinymodel import make_model
    from tests.unit.engine.test_logits_vs_hf import check_against_hf

    path = make_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.index_topk == 16
    prompt = [int(t) for t in torch.randint(0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(5))]
    check_against_hf(path, hf, prompt, num_steps=64)  # 24-token prompt, top 16: the indexer drops tokens
