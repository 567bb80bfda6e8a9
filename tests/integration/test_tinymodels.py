"""The tiny checkpoints are real: HF transformers loads and runs them, vLLM (CPU) serves them, and
in float32 vLLM's greedy tokens equal HF's, token for token (the reference every engine test
leans on). DeepSeek-V3 also serves in bf16 with its MTP layer as the speculative drafter.
``expresslane make-model`` is deterministic and documents itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from infra import tinymodel
from tests.fixtures.vllm import MTP_SPECULATIVE_CONFIG, Plain, VllmServers, VllmStartError, vllm_greedy

ARCHS = list(tinymodel.ARCHS)
VLLM_SERVERS = [*(Plain(arch) for arch in tinymodel.ARCHS),
                Plain("deepseek_v3", "bfloat16", "bfloat16", ("--speculative-config", MTP_SPECULATIVE_CONFIG))]
PROMPTS = ["Hello world", "def fibonacci(n):", "The river ran low that summer, and",
           "Q: What is the capital of France? A:"]
NUM_TOKENS = 16


def hf_greedy(model, token_ids: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding: full forward over the whole sequence at every step, no cache."""
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids):]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    """Factory: arch -> (tokenizer, model, loading_info) loaded with HF transformers in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            path = tiny_model(arch)
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, output_loading_info=True)
            loaded[arch] = (AutoTokenizer.from_pretrained(path), model.eval(), info)
        return loaded[arch]

    return get


def _sha256_files(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_make_model_help_lists_arches_and_options():
    exe = Path(sys.executable).with_name("expresslane")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "infra.cli"]
    done = subprocess.run([*cmd, "make-model", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for word in ("--arch", "--out", "--seed", "--dtype", *ARCHS):
        assert word in done.stdout


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_make_model_same_seed_gives_same_bytes(tmp_path, arch):
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "seed1"]
    assert tinymodel.main(["--arch", arch, "--out", str(runs[0])]) == 0
    assert tinymodel.main(["--arch", arch, "--out", str(runs[1])]) == 0
    assert tinymodel.main(["--arch", arch, "--out", str(runs[2]), "--seed", "1"]) == 0
    first, second, other_seed = map(_sha256_files, runs)
    assert set(first) == {"config.json", "generation_config.json", "model.safetensors",
                          "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}
    assert first == second
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_transformers_loads_and_generates(hf_model, tiny_model, arch):
    tok, model, info = hf_model(arch)
    config = json.loads((tiny_model(arch) / "config.json").read_text())
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # Only the MTP layer (stored after the last decoder layer) is unknown to HF.
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert all(k.startswith(mtp) for k in info["unexpected_keys"])
    assert bool(info["unexpected_keys"]) == (config.get("num_nextn_predict_layers", 0) > 0)
    assert len(tok) == config["vocab_size"] == model.get_output_embeddings().weight.shape[0]

    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == (tok.bos_token or "") + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The raw tokenizer.json (what a service without transformers loads) agrees with HF.
    raw = Tokenizer.from_file(str(tiny_model(arch) / "tokenizer.json"))
    tricky = "Hello  world,\n\tthe QUICK fox's 12345 café ü <|im_end|>"
    assert raw.encode(tricky).ids == tok(tricky)["input_ids"]

    outputs = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        body = ids[1:] if tok.bos_token else ids
        assert ids[: len(ids) - len(body)] == ([config["bos_token_id"]] if tok.bos_token else [])
        assert tok.decode(body) == prompt
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        new = generated[0, len(ids):].tolist()
        assert 1 <= len(new) <= 8
        assert new == hf_greedy(model, ids, len(new))  # cached generate == uncached reference
        outputs.append(tuple(hf_greedy(model, ids, 8)))
    assert len(set(outputs)) == len(PROMPTS), "greedy outputs should depend on the prompt"


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_greedy_equals_hf_greedy_float32(vllm_servers, tiny_model, hf_model, arch):
    tok, model, _ = hf_model(arch)
    server = vllm_servers.get(tiny_model(arch), dtype="float32")
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        body = {"model": server.model_name, "prompt": prompt, "max_tokens": NUM_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["prompt_token_ids"] == ids  # vLLM tokenizes exactly as HF does
        assert choice["token_ids"] == hf_greedy(model, ids, NUM_TOKENS), prompt
        # vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence; HF shows U+FFFD.
        text = tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert choice["text"].rstrip("\ufffd") == text.rstrip("\ufffd")
    # Token-id prompts through the shared helper give the same answer.
    ids = tok(PROMPTS[0])["input_ids"]
    assert vllm_greedy(server, ids, NUM_TOKENS) == hf_greedy(model, ids, NUM_TOKENS)


def _metric_total(metrics_text: str, name: str) -> float:
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics_text, re.M)
    return sum(float(v) for v in values)


@pytest.mark.vllm
def test_deepseek_v3_serves_bf16_with_mtp_speculation(vllm_servers, tiny_model):
    path = tiny_model("deepseek_v3", "bfloat16")
    server = vllm_servers.get(path, dtype="bfloat16", extra_args=("--speculative-config", MTP_SPECULATIVE_CONFIG))
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    for prompt in PROMPTS:
        tokens = vllm_greedy(server, prompt, NUM_TOKENS)
        assert len(tokens) == NUM_TOKENS and all(0 <= t < vocab_size for t in tokens)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert _metric_total(metrics, "vllm:spec_decode_num_drafts_total") > 0, "MTP drafter never ran"


@pytest.mark.vllm
def test_vllm_that_cannot_start_raises_with_its_log_and_leaves_nothing(tmp_path):
    # Servers of its own: the session's stay for the modules that need them.
    servers = VllmServers(tmp_path / "logs", max_alive=1)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    try:
        with pytest.raises(VllmStartError) as failure:
            servers.get(model)
        assert "exited" in str(failure.value) and "no_such_model" in str(failure.value)
        assert failure.value.log_path.exists()
        with pytest.raises(ProcessLookupError):
            os.killpg(failure.value.pid, 0)  # the whole process group is gone
        assert servers.alive() == []
    finally:
        servers.stop_all()
