"""``attention_bias`` as each family's HF code reads it: Llama and Qwen3 put it on q, k, v and o;
Qwen2 always has q/k/v biases and never an o bias; Mistral has none. The engine's prefill logits
equal HF's."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)


def _config(model_type: str):
    import transformers as tf

    kinds = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
             "qwen3": tf.Qwen3Config}
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    return kinds[model_type](attention_bias=True, **SMALL, **extra)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_attention_biases_as_hf_reads_them(tmp_path, model_type):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # biases that matter (HF starts them at zero)
    hf.save_pretrained(tmp_path)
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters()) == (model_type in ("llama", "qwen3"))
    engine = Engine.load(tmp_path, num_slots=1, max_seq_len=32, dtype=torch.float32)
    prompt = [3, 17, 42, 9, 77, 5]
    logits = engine.prefill(0, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(logits.float(), ref, atol=1e-4), (logits.float() - ref).abs().max()
