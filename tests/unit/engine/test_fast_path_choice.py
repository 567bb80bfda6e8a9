"""Which engines and requests the fast CUDA path serves, and what the engine records when it does not.

No kernel runs here (tests/unit/engine_cuda/test_engine_fast_path.py runs the fast path itself).
"""

from __future__ import annotations

import logging

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams

# (arch, dtype, mode) -> words the engine's reason must contain; "auto" never picks the CPU
CASES = [
    ("qwen2", torch.bfloat16, "auto", "device cpu"),  # Qwen2/Qwen3 blocks are on the fast path, the CPU is not
    ("qwen3", torch.float32, "auto", "bfloat16 only"),
    ("deepseek_v3", torch.bfloat16, "auto", "device cpu"),  # q LoRA and group-limited routing are on it too
    ("llama", torch.float32, "auto", "bfloat16 only"),
    ("llama", torch.bfloat16, "auto", "device cpu"),
    ("llama", torch.bfloat16, "off", "fast_path='off'"),
]


@pytest.mark.parametrize("arch,dtype,mode,words", CASES)
def test_engine_records_why_it_decodes_on_the_reference_step(hf_checkpoint, caplog, arch, dtype, mode, words):
    path, _ = hf_checkpoint(arch)
    with caplog.at_level(logging.INFO, logger="services.decode.engine.fastpath"):
        engine = Engine.load(path, num_slots=1, max_seq_len=32, dtype=dtype, fast_path=mode)
    assert words in engine.fast_path_reason
    if mode == "auto":
        assert any(words in r.getMessage() for r in caplog.records)  # auto says why, once, at load
    first = int(engine.prefill(0, [0, 5, 9]).argmax())
    engine.start(0, first, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.slot_fast_path_reason(0) == engine.fast_path_reason
    # not the fast path: the torch step, or the fused CPU step in float32 (cpustep.py, both families)
    fused = dtype == torch.float32
    assert engine.step()[0].token_ids and engine.last_step_path == ("cpu-fused" if fused else "reference")
    engine.release(0)
    assert engine.free_slots() == [0]


def test_fast_path_on_refuses_a_model_it_cannot_run(hf_checkpoint):
    path, _ = hf_checkpoint("deepseek_v3")
    with pytest.raises(ValueError, match=r"fast_path='on' cannot run this engine: dtype float32"):
        Engine.load(path, num_slots=1, max_seq_len=32, dtype=torch.float32, fast_path="on")


def test_unknown_fast_path_mode_is_refused(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="fast_path must be one of auto, on, off"):
        Engine.load(path, num_slots=1, max_seq_len=32, fast_path="fast")


def test_a_graph_captured_mid_request_falls_back_to_eager_when_capture_fails():
    from services.decode.engine.fastpath import _captured_or_eager

    class Broken:
        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    calls, rearmed = [], []
    runner = _captured_or_eager(Broken(), lambda: calls.append(1), "test graph", lambda: rearmed.append(1))
    runner()
    runner()
    assert calls == [1, 1] and rearmed == [1]
