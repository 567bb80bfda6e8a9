"""Config parsing: supported families and clear refusals (table-driven)."""

from __future__ import annotations

import pytest

from services.decode.engine.config import parse_config

BASE = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
MLA = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}

ACCEPTED = [
    ({"model_type": "llama"}, dict(family="gqa", num_kv_heads=2, head_dim=8, qkv_bias=False, qk_norm=False)),
    ({"model_type": "qwen2", "num_key_value_heads": 1}, dict(family="gqa", num_kv_heads=1, qkv_bias=True)),
    ({"model_type": "qwen3", "head_dim": 16}, dict(head_dim=16, qk_norm=True, qkv_bias=False)),
    ({"model_type": "llama", "attention_bias": True}, dict(qkv_bias=True, o_bias=True)),
    ({"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}}, dict()),
    ({"model_type": "deepseek_v3", **MLA, "num_nextn_predict_layers": 1, "eos_token_id": [1, 2]},
     dict(family="mla", num_mtp_layers=1, num_cache_layers=2, eos_token_ids=(1, 2))),
    ({"model_type": "glm_moe_dsa", **MLA, "q_lora_rank": 8, "index_topk_pattern": "FS", "num_hidden_layers": 2},
     dict(index_layers=(0,))),
]
REFUSED = [
    ({"model_type": "gpt2"}, "not supported by the decode engine"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "only silu"),
    ({"model_type": "llama", "mlp_bias": True}, "MLP biases"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}, "rope_type"),
    ({"model_type": "deepseek_v3", **MLA, "scoring_func": "softmax"}, "noaux_tc"),
    ({"model_type": "deepseek_v3", **MLA, "attention_bias": True}, "attention biases"),
    ({"model_type": "glm_moe_dsa", **MLA, "q_lora_rank": 8, "indexer_types": ["shared"]}, "layer 0 is marked to share"),
    ({"model_type": "glm_moe_dsa", **MLA, "q_lora_rank": 8, "index_topk_pattern": "SF", "num_hidden_layers": 2},
     "must make layer 0 'full'"),
]


@pytest.mark.parametrize("extra,expected", ACCEPTED)
def test_accepted(extra, expected):
    cfg = parse_config({**BASE, **extra})
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name


@pytest.mark.parametrize("extra,message", REFUSED)
def test_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_config({**BASE, **extra})
