"""FP8 MLA latent on the reference step (DeepSeek family): slots keep vLLM's CUDA MLA FP8 bytes.

- ``kvquant.quantize(nearest=True)`` writes what vLLM's ``concat_and_cache_mla`` writes for ``fp8``: the row
  divided by the layer's k_scale, rounded to nearest (ties to even), saturated at 448, sign of zero kept.
- The FP8-latent engine's steps (plain and MTP draft + verify) attend over the dequantized bytes: with a
  float32 model its logits are within 1e-4 of the same model whose float32 cache holds each latent value
  as the FP8 slot reads it back, and its greedy tokens are that reference's.
- The slot layout says fp8_e4m3 (one byte per latent element); scales come from the checkpoint, MTP
  layers' included; E5M2 and sparse-attention models are refused with what to run instead.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.decode.engine import Engine
from services.decode.engine.kvquant import dequantize, quantize
from tests.unit.engine.test_kv_fp8 import PROMPT, _greedy, rel


def quantize_nearest(x: torch.Tensor, scale: float) -> torch.Tensor:
    return quantize(x, scale, "fp8_e4m3", nearest=True)


@pytest.mark.parametrize("x, scale, byte", [
    (1.0, 1.0, 0x38), (-1.0, 1.0, 0xB8), (0.0, 1.0, 0x00), (-0.0, 1.0, 0x80),
    (1.0625, 1.0, 0x38),  # halfway between 1.0 (mantissa 000) and 1.125 (001): ties to even, down
    (1.1875, 1.0, 0x3A),  # halfway between 1.125 (001) and 1.25 (010): ties to even, up
    (1.07, 1.0, 0x39),  # past halfway: up (truncation would give 0x38)
    (500.0, 1.0, 0x7E), (-1e9, 1.0, 0xFE),  # saturated at +-448, never NaN
    (2.0 ** -9, 1.0, 0x01), (2.0 ** -10, 1.0, 0x00), (-2.0 ** -11, 1.0, 0x80),  # subnormals; underflow keeps sign
    (3 * 2.0 ** -10, 1.0, 0x02),  # 1.5 subnormal units: ties to even, up
    (0.9375 * 2.0 ** -6 + 2.0 ** -12, 1.0, 0x08),  # rounds up out of the subnormals into the smallest normal
    (12.0, 4.0, 0x44), (-0.75, 0.25, 0xC4),  # x / scale = 3
])
def test_quantize_nearest_rounds_as_the_cuda_writer(x, scale, byte):
    assert int(quantize_nearest(torch.tensor([x]), scale)[0]) == byte


def test_quantize_nearest_is_the_nearest_e4m3_value():
    x = torch.cat([torch.linspace(-500, 500, 20001), torch.logspace(-12, 2, 3000), -torch.logspace(-12, 2, 3000)])
    got = dequantize(quantize_nearest(x, 1.0), 1.0, "fp8_e4m3")
    every = torch.arange(256, dtype=torch.uint8)
    values = dequantize(every[(every & 0x7F) != 0x7F], 1.0, "fp8_e4m3").unique()
    nearest = (x.clamp(-448, 448)[:, None] - values[None, :]).abs().min(dim=1).values
    assert torch.equal((x.clamp(-448, 448) - got).abs(), nearest)


@pytest.fixture(scope="module")
def deepseek(hf_checkpoint):
    return hf_checkpoint("deepseek_v3")[0]


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_fp8_latent_steps_equal_a_float32_cache_of_the_dequantized_values(deepseek, monkeypatch, k, scale):
    """The reference: the same float32 model whose cache writes store each latent value as the FP8 slot
    reads it back. k = 2: MTP drafts and their verify read and write the FP8 latent too (the draft
    layer's own cache layer included)."""
    fp8 = Engine.load(deepseek, num_slots=1, max_seq_len=64, dtype=torch.float32, kv_cache_dtype="fp8",
                      num_speculative_tokens=k, adaptive_speculation=False)  # every step drafts
    assert fp8.layout.dtype == "fp8_e4m3" and fp8.cache.kv[0].dtype == torch.uint8
    assert len(fp8.cache.kv) == len(fp8.cache.scales) == fp8.cfg.num_layers + (1 if k else 0)
    fp8.cache.scales = [(scale, scale)] * len(fp8.cache.scales)
    got_logits, got = _greedy(fp8)

    from services.decode.engine import deepseek as ds

    plain_write = ds.write_cache
    monkeypatch.setattr(ds, "write_cache", lambda cache, slots, pos, values: plain_write(
        cache, slots, pos, dequantize(quantize_nearest(values, scale), scale, "fp8_e4m3")))
    ref = Engine.load(deepseek, num_slots=1, max_seq_len=64, dtype=torch.float32, num_speculative_tokens=k,
                      adaptive_speculation=False)
    want_logits, want = _greedy(ref)
    assert rel(got_logits, want_logits) < 1e-4
    assert got == want


def test_fp8_latent_spec_output_equals_plain_output(deepseek):
    plain = _greedy(Engine.load(deepseek, num_slots=1, max_seq_len=64, dtype=torch.bfloat16,
                                kv_cache_dtype="fp8"))[1]
    spec = _greedy(Engine.load(deepseek, num_slots=1, max_seq_len=64, dtype=torch.bfloat16,
                               kv_cache_dtype="fp8", num_speculative_tokens=3, adaptive_speculation=False))[1]
    assert spec == plain


def test_fp8_latent_layout_and_checkpoint_scales(tmp_path, deepseek):
    """The layout carries fp8_e4m3 at one byte an element; a checkpoint with a quantization config and
    per-layer k_scale tensors (the MTP layer's under its own layer index) fills the slot with x / k_scale."""
    ckpt = tmp_path / "scaled"
    ckpt.mkdir()
    for f in deepseek.iterdir():
        if f.is_file():
            (ckpt / f.name).write_bytes(f.read_bytes())
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (ckpt / "config.json").write_text(json.dumps(config))
    n = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    files = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    tensors |= {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.02 * (i + 1)) for i in range(n)}
    save_file(tensors, str(files[0]), metadata={"format": "pt"})

    fp8 = Engine.load(ckpt, num_slots=1, max_seq_len=64, dtype=torch.float32, kv_cache_dtype="fp8",
                      num_speculative_tokens=1)
    auto = Engine.load(ckpt, num_slots=1, max_seq_len=64, dtype=torch.float32, num_speculative_tokens=1)
    assert fp8.cache.scales == [(float(torch.tensor(0.02 * (i + 1))),) * 2 for i in range(n)]
    assert fp8.layout.slot_nbytes * 4 == auto.layout.slot_nbytes  # float32 model, one byte a latent element
    fp8.prefill(0, PROMPT)
    auto.prefill(0, PROMPT)
    t = len(PROMPT)  # layer 0's latent does not depend on attention: the same rows, quantized with its scale
    assert torch.equal(fp8.cache.kv[0][0, :t], quantize_nearest(auto.cache.kv[0][0, :t], fp8.cache.scales[0][0]))


def test_fp8_latent_refusals(hf_checkpoint, deepseek):
    with pytest.raises(ValueError, match="E4M3 .*kv_cache_dtype='fp8'"):
        Engine.load(deepseek, num_slots=1, max_seq_len=64, dtype=torch.float32, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="sparse-attention model .*kv_cache_dtype='auto'"):
        Engine.load(hf_checkpoint("deepseek_v32")[0], num_slots=1, max_seq_len=64, dtype=torch.float32,
                    kv_cache_dtype="fp8")
