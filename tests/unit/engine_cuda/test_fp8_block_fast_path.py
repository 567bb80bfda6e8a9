"""Block-scaled FP8 DeepSeek-family checkpoints (the ``fp8`` method with ``weight_block_size``, as DeepSeek-V3 /
R1 ship) on the fast path, its Triton kernels interpreted on CPU, through the Engine API.

The tiny DeepSeek-V3 model (q LoRA, group-limited routing, shared experts, a dense first layer, an MTP layer)
quantized in 16 x 16 blocks (its projections are 32-64 wide: DeepSeek-V3's 128 x 128 blocks would make every
weight one partial block) keeps its FP8 bytes on the fast path (the fused wkv_a | wq_a, q_b, o, experts, the MTP
block) and gives the reference step's greedy tokens (which dequantizes in torch and rounds the activations per
block as vLLM's W8A8 block path does): plain steps, MTP drafts with their verify, and slots batched together.
"""

from __future__ import annotations

import pytest

from infra.tinymodel_fp8 import quantize_checkpoint
from services.decode.engine import Engine
from services.decode.engine.cuda.fp8block import BlockFp8
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint
from tests.unit.engine_cuda.test_engine_fast_path_mla import SMALL, V3_PROMPT, run
from tests.unit.engine_cuda.test_fast_path_batch import decode_alone, decode_together


def spread_blocks(path, block: int = 16) -> None:
    """Scale each 16 x 16 block of every weight the writer quantizes by 1/4, 1 or 4 (a pattern over the blocks),
    so that the blocks' scales differ by up to 16x and a scale applied to the wrong rows or columns changes the
    tokens (random weights of one distribution would give every block nearly the same scale)."""
    import torch
    from safetensors.torch import load_file, save_file

    from infra.tinymodel_fp8 import quantized_module

    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if quantized_module(name) is None or t.dim() != 2:
                continue
            nb, kb = -(-t.shape[0] // block), -(-t.shape[1] // block)
            factor = torch.tensor([0.25, 1.0, 4.0])[(torch.arange(nb)[:, None] * 2 + torch.arange(kb)[None, :]) % 3]
            full = factor.repeat_interleave(block, 0)[: t.shape[0]].repeat_interleave(block, 1)[:, : t.shape[1]]
            tensors[name] = (t.float() * full).to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-fp8-v3")
    save_checkpoint("deepseek_v3", path, **SMALL)
    spread_blocks(path)
    quantize_checkpoint(path, "fp8-block", block=(16, 16))
    return path


def load(path, mode: str, k: int = 0, slots: int = 1) -> Engine:
    return Engine.load(path, num_slots=slots, max_seq_len=32, dtype="bfloat16", fast_path=mode,
                       num_speculative_tokens=k)


@pytest.mark.parametrize("k", [0, 3])
def test_block_fp8_fast_path_tokens_equal_the_reference_step(checkpoint, k):
    fast = load(checkpoint, "on", k)
    assert fast.fast_path_reason is None
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    got, reason, paths, _, stats = run(fast, V3_PROMPT, greedy)
    mm = fast.model._fast_mla_model  # what the fast path reads: FP8 bytes and their scales
    moe_layer = mm.layers[-1]
    assert all(isinstance(w, BlockFp8) for w in (moe_layer.wqkv_a, moe_layer.wq_b, moe_layer.wo, moe_layer.gate_up,
                                                 moe_layer.down, moe_layer.shared_gate_up, moe_layer.shared_down))
    assert moe_layer.wqkv_a.act and isinstance(mm.layers[0].gate_up, BlockFp8)  # the dense layer too
    assert (mm.mtp is not None and isinstance(mm.mtp.layer.gate_up, BlockFp8)) == bool(k)  # MTP loaded with drafts
    want, want_reason, ref_paths, _, _ = run(load(checkpoint, "off", k), V3_PROMPT, greedy)
    assert paths == {"fast"} and ref_paths == {"reference"}
    assert got == want and reason == want_reason == "length"
    if k:
        assert stats.num_draft_tokens > 0


def test_block_fp8_slots_decode_together_with_their_tokens_alone(checkpoint):
    engine = load(checkpoint, "on", slots=2)
    assert engine.fast_path.batch_ok
    prompts = {0: V3_PROMPT, 1: [5, 77, 200, 9, 61]}
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    alone = decode_alone(engine, prompts, greedy)
    assert decode_together(engine, prompts, greedy) == alone  # the tensor-core path's per-block dots


def test_block_fp8_sparse_attention_tokens_equal_the_reference_step(tmp_path):
    # DeepSeek-V3.2: the indexer's key and head-weight rows (bf16 in the engine) beside the FP8 wkv_a | wq_a stack
    # run as a GEMV of their own into the columns after it
    save_checkpoint("deepseek_v32", tmp_path, **SMALL)
    spread_blocks(tmp_path)
    quantize_checkpoint(tmp_path, "fp8-block", block=(16, 16))
    fast = load(tmp_path, "on")
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    got, _, paths, _, _ = run(fast, V3_PROMPT, greedy)
    lw = fast.model._fast_mla_model.layers[-1]
    assert isinstance(lw.wqkv_a, BlockFp8) and lw.w_idx_rows is not None
    want, _, _, _, _ = run(load(tmp_path, "off"), V3_PROMPT, greedy)
    assert paths == {"fast"} and got == want


def test_per_channel_fp8_deepseek_keeps_the_reference_step(tmp_path):
    save_checkpoint("deepseek_v3", tmp_path, **SMALL)
    quantize_checkpoint(tmp_path, "fp8-channel")
    engine = load(tmp_path, "auto")
    assert engine.fast_path is None and "block scales of powers of two" in engine.fast_path_reason
