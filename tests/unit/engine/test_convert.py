"""``expresslane convert-weights``: the converted checkpoint loads and decodes exactly like the HF one."""

from __future__ import annotations

import json

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.weights import ENGINE_MARKER
from infra.cli import main as cli
from shared.events import SamplingParams
from tests.unit.engine.test_engine_behaviour import PROMPTS, run


@pytest.mark.parametrize("arch,k", [("qwen2", 0), ("deepseek_v3", 2)])
def test_converted_checkpoint_decodes_like_the_hf_one(hf_checkpoint, tmp_path, arch, k):
    src, _ = hf_checkpoint(arch)
    dst = tmp_path / "converted"
    assert cli(["convert-weights", str(src), str(dst), "--no-progress", "--shard-gib", "0.0001"]) == 0
    marker = json.loads((dst / ENGINE_MARKER).read_text())
    assert len(marker["shards"]) > 1 and all((dst / s).exists() for s in marker["shards"])
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    drafts = dict(num_speculative_tokens=k, adaptive_speculation=False)  # every step drafts (a CPU engine)
    hf_engine = Engine.load(src, max_seq_len=96, dtype=torch.float32, **drafts)
    ours = Engine.load(dst, max_seq_len=96, **drafts)
    assert ours.dtype == torch.float32
    ref = hf_engine.prefill(0, PROMPTS[0])
    assert float((ours.prefill(0, PROMPTS[0]) - ref).abs().max() / ref.abs().max()) < 1e-6  # same math, other alignment
    hf_engine.release(0)
    ours.release(0)
    assert run(ours, 0, PROMPTS[1], greedy) == run(hf_engine, 0, PROMPTS[1], greedy)
    assert ours.free_slots() == [0]


def test_convert_to_bfloat16_and_refusals(hf_checkpoint, tmp_path, capsys):
    src, _ = hf_checkpoint("llama")
    dst = tmp_path / "bf16"
    assert cli(["convert-weights", str(src), str(dst), "--dtype", "bfloat16", "--no-progress"]) == 0
    engine = Engine.load(dst, max_seq_len=64)
    assert engine.dtype == torch.bfloat16 and engine.layout.dtype == "bfloat16"
    assert len(run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))) == 9
    assert cli(["convert-weights", str(dst), str(tmp_path / "again"), "--no-progress"]) == 2
    assert cli(["convert-weights", str(tmp_path / "missing"), str(tmp_path / "x"), "--no-progress"]) == 2
    assert "already in the engine's format" in capsys.readouterr().err
