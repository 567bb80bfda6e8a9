"""Mistral's sliding-window attention: the engine attends to the whole context, which equals the
window up to the window's length, so it caps max_seq_len at the window (and says so) instead of
decoding longer contexts differently from the model."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.config import parse_config

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)


@pytest.mark.parametrize("config,want", [
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),
    ({"model_type": "mistral", "sliding_window": None}, None),   # Mistral 7B v0.2 onwards
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, None),
    ({"model_type": "llama"}, None),
])
def test_parse_config_reads_the_window_only_where_the_model_uses_it(config, want):
    raw = {"num_attention_heads": 4, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, **config}
    assert parse_config(raw).sliding_window == want


def _mistral(path, window):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=window, **SMALL)).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("window,want", [(8, 8), (None, 32), (64, 32)])
def test_engine_caps_max_seq_len_at_the_sliding_window(tmp_path, window, want):
    hf = _mistral(tmp_path, window)
    engine = Engine.load(tmp_path, num_slots=1, max_seq_len=32, dtype=torch.float32)
    assert engine.max_seq_len == want and engine.layout.max_tokens >= want
    prompt = [3, 17, 42, 9, 77]
    logits = engine.prefill(0, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(logits.float(), ref, atol=1e-4)  # inside the window: the model's own logits
    engine.release(0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.prefill(0, list(range(2, 2 + want)))  # a prompt as long as the limit does not fit
