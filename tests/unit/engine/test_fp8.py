"""FP8 checkpoints on the reference step: compressed-tensors (channel, tensor scales) and the fp8
method with 128x128 block scales, for both families (DeepSeek-V3 with its MTP layer).

The engine keeps the weights in float8 with their scales and dequantizes in torch just before each
matmul, and quantizes activations dynamically as vLLM does for these checkpoints (per token, or
per 128 features for block scales); its logits must stay within 2% (max-abs relative) of an
engine loaded from the same checkpoint multiplied out in float32 by the writer
(``dequantize_checkpoint``: independent code), and its greedy tokens must equal the reference's on
near-bigram models (wide argmax margins, as a trained model has) up to a near tie: where the
reference's own top two logits lie within 1% of its logit scale, FP8 activations may pick the other
one, and the sequences part there. ``quant.parse_quant`` is table-tested; the loader's refusals say
what is wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infra.tinymodel import make_model
from infra.tinymodel_fp8 import dequantize_checkpoint, quantization_config, quantize_checkpoint
from services.decode.engine import Engine
from services.decode.engine.fp8 import is_fp8
from services.decode.engine.quant import QuantSpec, parse_quant
from shared.events import SamplingParams
from tests.fixtures.models import damp

PROMPT = [1, 17, 42, 99, 3, 250, 7, 12]
TOKENS = 16


def checkpoints(tmp_path, arch: str, scheme: str, dtype: str = "float32", ignore=()):
    """(FP8 checkpoint, its dequantized float32 twin, the unquantized original)."""
    orig = make_model(arch, tmp_path / "orig", dtype=dtype)
    damp(orig)
    fp8 = make_model(arch, tmp_path / "fp8", dtype=dtype)
    damp(fp8)
    quantize_checkpoint(fp8, scheme, ignore=ignore)
    return fp8, dequantize_checkpoint(fp8, tmp_path / "deq", "float32"), orig


def greedy(engine: Engine, prompt=PROMPT) -> tuple[torch.Tensor, list[int]]:
    """(prefill logits, greedy tokens) of one request alone."""
    logits = engine.prefill(0, prompt)
    engine.start(0, int(logits.argmax()), SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    tokens = [int(logits.argmax())]
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
    engine.release(0)
    return logits.float(), tokens


def assert_same_greedy(tokens: list[int], ref_tokens: list[int], ref: Engine, prompt=PROMPT) -> None:
    """Equal, or equal up to a position where the reference's choice was a near tie (see above)."""
    i = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if i is None:
        return
    logits = ref.prefill(0, prompt + ref_tokens[:i]).float()
    ref.release(0)
    gap = float(logits[ref_tokens[i]] - logits[tokens[i]])
    assert 0 <= gap < 0.01 * float(logits.abs().max()), f"token {i}: {tokens[i]} != {ref_tokens[i]}, reference gap {gap}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def load(path, dtype="float32", k=0) -> Engine:
    return Engine.load(path, num_slots=1, max_seq_len=64, dtype=dtype, num_speculative_tokens=k,
                       adaptive_speculation=False)  # with k, every step drafts (a CPU engine)


CASES = [  # (arch, scheme, engine dtype, speculative tokens)
    ("llama", "fp8-channel", "float32", 0),
    ("llama", "fp8-tensor", "bfloat16", 0),
    ("llama", "fp8-block", "float32", 0),
    ("qwen2", "fp8-block", "float32", 0),  # q/k/v rows not a multiple of 128: wqkv dequantized on load
    ("qwen3", "fp8-channel", "bfloat16", 0),
    ("deepseek_v3", "fp8-block", "float32", 1),
    ("deepseek_v3", "fp8-channel", "bfloat16", 0),
]


@pytest.mark.parametrize("arch,scheme,dtype,k", CASES)
def test_fp8_engine_matches_its_dequantized_reference(tmp_path, arch, scheme, dtype, k):
    fp8_dir, deq_dir, orig_dir = checkpoints(tmp_path, arch, scheme)
    engine, ref = load(fp8_dir, dtype, k), load(deq_dir, dtype, k)
    blk = engine.model.layers[0]
    assert is_fp8(blk.w_gate_up) and is_fp8(blk.w_down) and is_fp8(blk.wo)
    assert is_fp8(blk.wqkv if arch != "deepseek_v3" else blk.wq_b) == (arch != "qwen2")
    w = blk.w_gate_up
    assert not is_fp8(engine.model.lm_head) and not is_fp8(engine.model.embed)  # ignore: lm_head
    if scheme == "fp8-block":
        assert w.scale.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)) and w.block == (128, 128)
    else:
        assert w.scale.shape == (w.shape[0],) and w.scale.dtype == torch.float32 and w.block is None
    if arch == "deepseek_v3":
        moe = engine.model.layers[1]
        assert is_fp8(moe.experts_gate_up) and moe.experts_gate_up.scale.shape[0] == engine.cfg.num_experts
        assert not is_fp8(moe.router) and not is_fp8(blk.w_uk)  # kv_b is multiplied out, as vLLM does
        if k:
            assert is_fp8(engine.model.mtp[0].block.wq_b) and not is_fp8(engine.model.mtp[0].eh_proj)
    logits, tokens = greedy(engine)
    ref_logits, ref_tokens = greedy(ref)
    assert rel(logits, ref_logits) < 0.02
    assert_same_greedy(tokens, ref_tokens, ref)
    if dtype == "float32" and not k:  # and FP8 keeps the unquantized model's greedy choices
        orig = load(orig_dir, dtype)
        assert_same_greedy(tokens, greedy(orig)[1], orig)


def test_ignored_modules_stay_unquantized_and_a_converted_checkpoint_loads_alike(tmp_path):
    from infra.cli import main as cli

    fp8_dir, deq_dir, _ = checkpoints(tmp_path, "llama", "fp8-channel", ignore=("re:.*layers\\.1\\.mlp\\..*",))
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["ignore"][1].startswith("re:")
    engine = load(fp8_dir)
    assert is_fp8(engine.model.layers[0].w_gate_up) and not is_fp8(engine.model.layers[1].w_gate_up)
    assert is_fp8(engine.model.layers[1].wqkv)
    conv = tmp_path / "converted"
    assert cli(["convert-weights", str(fp8_dir), str(conv), "--dtype", "bfloat16", "--no-progress"]) == 0
    converted = Engine.load(conv, num_slots=1, max_seq_len=64, dtype="float32")
    assert is_fp8(converted.model.layers[0].wqkv) and converted.model.layers[0].wqkv_scale.dtype == torch.float32
    a, b = greedy(converted), greedy(engine)
    assert rel(a[0], b[0]) < 0.02 and a[1] == b[1]  # only the unquantized weights went through bf16
    assert rel(b[0], greedy(load(deq_dir))[0]) < 0.02


def test_loader_refusals_say_what_is_wrong(tmp_path):
    fp8_dir = make_model("llama", tmp_path / "m", dtype="bfloat16")
    quantize_checkpoint(fp8_dir, "fp8-channel")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization method 'awq'.*serve an FP8 or bf16 checkpoint"):
        load(fp8_dir)
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8_e4m3fn but config.json has no quantization_config"):
        load(fp8_dir)
    config["quantization_config"] = quantization_config("fp8-channel", ())
    (fp8_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(KeyError, match="k_proj.weight is float8 but .*k_proj.weight_scale is missing"):
        load(fp8_dir)


def _ct(weights: dict, inputs: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "symmetric": True, **weights},
             "input_activations": inputs}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": group}, **extra}}


@pytest.mark.parametrize("raw,want", [
    ({}, None),
    (_ct({"strategy": "channel"}, {"dynamic": True}, ignore=["lm_head"]),
     QuantSpec("compressed-tensors", "channel", None, ("lm_head",), "dynamic")),
    (_ct({"strategy": "tensor"}, {"dynamic": False}), QuantSpec("compressed-tensors", "tensor", None, (), "static")),
    (_ct({"strategy": "block", "block_structure": [128, 128]}),
     QuantSpec("compressed-tensors", "block", (128, 128), (), "none")),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, QuantSpec("fp8", "block", (128, 128), (), "dynamic")),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}},
     QuantSpec("fp8", "tensor", None, ("lm_head",), "static")),
])
def test_parse_quant(raw, want):
    assert parse_quant(raw) == want


@pytest.mark.parametrize("raw,error", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization method 'gptq'"),
    (_ct({"strategy": "channel", "type": "int"}), "8-bit int weights"),
    (_ct({"strategy": "channel", "num_bits": 4}), "4-bit float weights"),
    (_ct({"strategy": "group"}), "weight strategy 'group'"),
    (_ct({"strategy": "channel", "symmetric": False}), "asymmetric or dynamic"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "config_groups": {}}}, "format 'pack-quantized'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fp8 fmt 'e5m2'"),
])
def test_parse_quant_refuses(raw, error):
    with pytest.raises(ValueError, match=error):
        parse_quant(raw)


def test_make_model_quantize_flag_and_loading_progress(tmp_path, capsys):
    from infra.cli import main as cli
    from services.decode.engine.weights import iter_engine_params, read_config

    out = tmp_path / "block"
    assert cli(["make-model", "--arch", "deepseek_v3", "--out", str(out), "--dtype", "bfloat16",
                "--quantize", "fp8-block"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    tensors = load_file(str(out / "model.safetensors"))
    w, s = tensors["model.layers.1.mlp.experts.3.down_proj.weight"], tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 1)  # [256, 128] in 128x128
    assert tensors["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16  # MTP eh_proj stays unquantized
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # and the router
    capsys.readouterr()
    _, cfg = read_config(out)
    names = [n for n, _ in iter_engine_params(out, cfg, progress=True)]
    assert "layers.1.experts_down_scale" in names and "mtp.0.block.wq_b_scale" in names
    assert f"loading {out.name}" in capsys.readouterr().err


def test_make_model_block_flag(tmp_path):
    from infra.cli import main as cli

    out = tmp_path / "block16"
    assert cli(["make-model", "--arch", "llama", "--out", str(out), "--quantize", "fp8-block", "--block", "16x32"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 32]
    scale = load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    q = load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert scale.shape == (-(-q.shape[0] // 16), -(-q.shape[1] // 32))
    with pytest.raises(SystemExit) as exc:
        cli(["make-model", "--arch", "llama", "--out", str(tmp_path / "bad"), "--quantize", "fp8-block", "--block", "16"])
    assert exc.value.code == 2
