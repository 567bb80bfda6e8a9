"""make-model --plant: a new variant that greedily emits its planted continuation after the chat
template's assistant header, whatever came before; the default models keep their bytes."""

from __future__ import annotations

import hashlib

import pytest

from infra.tinymodel import PLANTS, make_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a long story.\n\nNow."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
]


@pytest.mark.parametrize("plant", ["tool-call", "reasoning-tool-call"])
def test_planted_model_emits_its_continuation(tmp_path, plant):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_model("llama", tmp_path / plant, plant=plant)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for messages in CONVERSATIONS:
        for tools in (TOOLS, None):
            ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            gen = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0][len(ids):]
            assert tok.decode(gen, skip_special_tokens=True) == "".join(PLANTS[plant])
            assert tok.convert_ids_to_tokens(int(gen[-1])) == "<|im_end|>"


def test_default_model_bytes_do_not_depend_on_planting(tmp_path):
    a = make_model("llama", tmp_path / "a")
    make_model("llama", tmp_path / "p", plant="tool-call")
    b = make_model("llama", tmp_path / "b")
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (a, b)]
    assert digest[0] == digest[1]
    assert "<tool_call>" not in (a / "tokenizer.json").read_text()


def test_chat_template_renders_tools_in_hermes_form(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_model("qwen3", tmp_path / "q"))
    plain = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    text = tok.apply_chat_template(CONVERSATIONS[2], tools=TOOLS, tokenize=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
