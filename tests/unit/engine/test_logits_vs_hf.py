"""Engine logits equal HF transformers' (float32) at prefill and at every step of a 64-token greedy run."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams

PROMPT = [0, 17, 42, 99, 3, 250, 7, 8, 120, 64, 5]
NUM_STEPS = 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3", "deepseek_v3", "deepseek_v3_yarn",
                                  "deepseek_v32", "glm_moe_dsa"])
def test_logits_match_hf_prefill_and_every_decode_step(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    check_against_hf(path, hf)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_the_torch_step_matches_hf_where_the_fused_cpu_step_would_run(hf_checkpoint, arch):
    """The torch step, which the fused CPU step (cpustep.py) replaces for one token of a float32 slot, against
    HF too (other steps, sparse attention and hosts without a compiler take it)."""
    path, hf = hf_checkpoint(arch)
    check_against_hf(path, hf, cpu_step="off")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "deepseek_v3"])
def test_logits_match_hf_on_the_project_tiny_models(tiny_model, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_against_hf(path, hf)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_logits_match_hf_across_attended_key_buckets(hf_checkpoint, arch):
    """A context growing past 256 keys moves the step to the next attended-prefix bucket."""
    path, hf = hf_checkpoint(arch)
    prompt = [int(t) for t in torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(1))]
    check_against_hf(path, hf, prompt, num_steps=12, max_seq_len=1024)


def test_cpu_float32_deepseek_projections_are_column_major_with_their_values(hf_checkpoint):
    """The DeepSeek family's float32 CPU weights the same way (DeepseekModel.column_major_projections): every
    block's projections, each stacked expert, the MTP layer's input projection and head; the embeddings
    (main and MTP) stay row-major, every value unchanged."""
    from services.decode.engine.deepseek import PROJECTIONS

    path, _ = hf_checkpoint("deepseek_v3")
    f32 = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32, num_speculative_tokens=1).model
    bf16 = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.bfloat16, num_speculative_tokens=1).model
    assert len(f32.mtp) == 1 and f32.cfg.q_lora_rank and any(b.is_moe for b in f32.layers)
    pairs = [(getattr(b, n), getattr(r, n)) for b, r in zip([*f32.layers, f32.mtp[0].block],
                                                            [*bf16.layers, bf16.mtp[0].block], strict=True)
             for n in PROJECTIONS if hasattr(b, n)]
    pairs += [(f32.lm_head, bf16.lm_head), (f32.mtp[0].eh_proj, bf16.mtp[0].eh_proj),
              (f32.mtp[0].head, bf16.mtp[0].head)]
    assert len(pairs) >= 20
    for w, w_ref in pairs:
        assert w.transpose(-1, -2).is_contiguous() and not w.is_contiguous() and w_ref.is_contiguous()
        assert torch.equal(w.to(torch.bfloat16), w_ref)
    for e, e_ref in ((f32.embed, bf16.embed), (f32.mtp[0].embed, bf16.mtp[0].embed)):
        assert e.is_contiguous() and torch.equal(e.to(torch.bfloat16), e_ref)


def check_against_hf(path, hf, prompt=PROMPT, num_steps=NUM_STEPS, max_seq_len=600, cpu_step="auto") -> None:
    from transformers import DynamicCache

    engine = Engine.load(path, num_slots=1, max_seq_len=max_seq_len, dtype=torch.float32, cpu_step=cpu_step)
    # the step checked: the fused CPU step where it applies (float32, one token a slot; the DeepSeek family's with
    # dense attention), else torch's
    fused = cpu_step == "auto" and (engine.cfg.family == "gqa" or not engine.cfg.index_topk)
    path = "cpu-fused" if fused else "reference"
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        ref = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
        ours = engine.prefill(0, prompt)
        assert rel_err(ours, ref) < 1e-4
        first = int(ref.argmax())
        engine.start(0, first, SamplingParams(max_tokens=num_steps, ignore_eos=True))
        token = first
        for i in range(num_steps):
            ref = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
            out = engine.step()[0]
            assert rel_err(engine.last_logits[0, 0], ref) < 1e-4, f"step {i}"
            assert engine.last_step_path == path
            token = int(ref.argmax())
            assert out.token_ids == [token], f"step {i}"
        assert out.finish_reason == "length"
    assert engine.active_slots() == []
    engine.release(0)
    assert engine.free_slots() == [0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: its lm_head is the embedding (tied)
def test_cpu_float32_projections_are_column_major_with_their_values(hf_checkpoint, arch):
    """On the CPU in float32 the engine stores each projection weight column-major (LlamaModel.
    column_major_projections: the one-token F.linear's faster form), values unchanged; a bf16 model keeps
    row-major weights, and a tied lm_head stays the embedding (whose rows F.embedding gathers)."""
    path, _ = hf_checkpoint(arch)
    f32 = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32).model
    bf16 = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.bfloat16).model
    for blk, ref in zip(f32.layers, bf16.layers, strict=True):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            w, w_ref = getattr(blk, name), getattr(ref, name)
            assert w.t().is_contiguous() and not w.is_contiguous() and w_ref.is_contiguous()
            assert torch.equal(w.to(torch.bfloat16), w_ref)
    tied = f32.lm_head.untyped_storage().data_ptr() == f32.embed.untyped_storage().data_ptr()
    assert tied == (arch == "qwen2")
    assert f32.lm_head.is_contiguous() == tied and f32.embed.is_contiguous()
    assert torch.equal(f32.lm_head.to(torch.bfloat16), bf16.lm_head)
