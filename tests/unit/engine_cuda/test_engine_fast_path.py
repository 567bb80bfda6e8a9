"""The fast path wired into the Engine API, its Triton kernels interpreted on CPU (conftest.py).

A bfloat16 near-bigram Llama (wide argmax margins, so the fast path's fp32 logits and the reference
step's bf16-rounded logits pick the same tokens): greedy tokens through ``Engine(fast_path="on")``
equal ``Engine(fast_path="off")``'s, also with several tokens per step, at stop ids, max_tokens and
max_seq_len; a batch with a request the fast path cannot serve takes the reference step and a request
(greedy or sampled) moves between the paths without losing a token (test_fast_path_batch.py: batches
the fast path serves); seeded sampled requests decode on the fast path with the reference
step's tokens (test_fast_path_sampling.py covers the parameters); cancel and release behave as on the
reference path and other slots' caches are untouched.
"""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint

# few, wide programs: the interpreter's cost is per program (qkv's block_n divides head_dim / 2 = 8)
OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPT = [0, 17, 42, 99, 3, 250, 7]
OTHER = [0, 88, 2, 150]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-engine-llama")
    save_checkpoint("llama", path, damp=True)
    return path


def load(path, mode: str, tokens_per_step: int = 1, max_seq_len: int = 48, num_slots: int = 2) -> Engine:
    return Engine.load(path, num_slots=num_slots, max_seq_len=max_seq_len, dtype="bfloat16", fast_path=mode,
                       fast_path_options=OPTIONS, fast_path_tokens_per_step=tokens_per_step)


def run(engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], str, set[str]]:
    """Prefill, start, decode alone: (first token + every emitted token, finish reason, paths stepped)."""
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, reason, paths = [first], None, set()
    while engine.active_slots():
        out = engine.step()[slot]
        assert len(out.token_ids) <= (engine.fast_path.tokens_per_step if engine.fast_path else 1)
        tokens, reason = tokens + out.token_ids, out.finish_reason
        paths.add(engine.last_step_path)
    engine.release(slot)
    return tokens, reason, paths


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load(checkpoint, "off")


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_fast_path_greedy_tokens_equal_the_reference_engine(checkpoint, reference, tokens_per_step):
    engine = load(checkpoint, "on", tokens_per_step)
    assert engine.fast_path_reason is None
    engine.prefill(1, OTHER)
    other_cache = engine.slot_buffer(1).clone()
    greedy = SamplingParams(max_tokens=9, ignore_eos=True)  # 4 tokens a step: 4 + 4 + 1, max_tokens cuts the last
    expected = run(reference, 0, PROMPT, greedy)
    assert expected[1:] == ("length", {"reference"})
    assert run(engine, 0, PROMPT, greedy) == (expected[0], "length", {"fast"})
    assert len(expected[0]) == 10
    assert torch.equal(engine.slot_buffer(1), other_cache)  # the fast path wrote only its own slot
    assert engine.free_slots() == [0] and engine.spec_stats(0).num_steps == 0


def test_fast_path_stops_at_stop_ids_and_max_seq_len_like_the_reference(checkpoint, reference):
    tokens = run(reference, 0, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = SamplingParams(max_tokens=12, stop_token_ids=[tokens[6]], ignore_eos=True)
    expected = run(reference, 0, PROMPT, stop)
    assert expected[0] == tokens[: tokens.index(tokens[6], 1) + 1] and expected[1] == "stop"
    engine = load(checkpoint, "on", tokens_per_step=4)  # the stop id lands inside a 4-token step
    assert run(engine, 0, PROMPT, stop) == (expected[0], "stop", {"fast"})
    short_ref, short = load(checkpoint, "off", max_seq_len=14), load(checkpoint, "on", 4, max_seq_len=14)
    long_request = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = run(short_ref, 0, PROMPT, long_request)
    assert expected[1] == "length" and len(PROMPT) + len(expected[0]) == 14
    assert run(short, 0, PROMPT, long_request) == (expected[0], "length", {"fast"})


def test_mixed_batches_take_the_reference_step_and_requests_move_between_paths(checkpoint, reference):
    alone = run(reference, 1, OTHER, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    expected_sampled = run(reference, 0, PROMPT, sampled)[0]
    engine = load(checkpoint, "on", tokens_per_step=4)
    first = int(engine.prefill(0, PROMPT).argmax())
    engine.start(0, first, SamplingParams(max_tokens=3, ignore_eos=True, bad_words_token_ids=[[3] * 17]))
    engine.prefill(1, OTHER)
    engine.start(1, alone[0], SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.slot_fast_path_reason(0) is not None and engine.slot_fast_path_reason(1) is None
    got, paths = {0: [first], 1: [alone[0]]}, []
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
        paths.append(engine.last_step_path)
    assert paths == ["reference"] * 3 + ["fast"] * 2  # two slots batched, then slot 1 alone: 7 tokens in 4 + 3
    assert got[1] == alone
    engine.release(0)
    engine.release(1)
    tokens, reason, paths = run(engine, 0, PROMPT, sampled)  # alone: the fast path samples it, same tokens
    assert (tokens, reason, paths) == (expected_sampled, "length", {"fast"})


def test_sampling_requests_take_the_fast_path_unless_they_overflow_its_buffers(checkpoint):
    engine = load(checkpoint, "on")
    engine.prefill(0, PROMPT)
    engine.start(0, 5, SamplingParams(max_tokens=2, temperature=1.0, seed=1, repetition_penalty=1.2))
    assert engine.slot_fast_path_reason(0) is None
    engine.release(0)
    engine.prefill(0, PROMPT)
    engine.start(0, 5, SamplingParams(max_tokens=2, temperature=1.0, bad_words_token_ids=[[3] * 17]))
    assert "bad word of 17 tokens" in engine.slot_fast_path_reason(0)
    engine.release(0)


def test_cancel_and_release_on_the_fast_path(checkpoint, reference):
    expected = run(reference, 0, OTHER, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    engine = load(checkpoint, "on", tokens_per_step=2)
    first = int(engine.prefill(0, PROMPT).argmax())
    engine.start(0, first, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(engine.step()[0].token_ids) == 2 and engine.last_step_path == "fast"
    engine.cancel(0)
    assert engine.active_slots() == [] and engine.step() == {}
    engine.release(0)
    assert engine.free_slots() == [0, 1]
    # the slot's decoder is re-armed for the next request: same tokens as a fresh reference run
    assert run(engine, 0, OTHER, SamplingParams(max_tokens=5, ignore_eos=True)) == (expected, "length", {"fast"})
    assert engine.free_slots() == [0, 1]


def test_engine_bench_measures_the_path_it_names(checkpoint):
    """bench/decode_engine.py's measurement helper: the paths it reports are the ones that ran, and its
    token ids are what the engine emitted (the CUDA table compares fast and reference with them)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "decode_engine_bench", Path(__file__).resolve().parents[3] / "bench" / "decode_engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fast = bench.engine_tokens_per_s(load(checkpoint, "on", tokens_per_step=4, num_slots=1), PROMPT, 3)
    ref = bench.engine_tokens_per_s(load(checkpoint, "off", num_slots=1), PROMPT, 3)
    assert (fast["paths"], ref["paths"]) == (["fast"], ["reference"])
    assert fast["token_ids"] == ref["token_ids"] and fast["tokens"] == 3


def test_auto_turns_the_fast_path_off_when_a_decoder_fails_to_build(checkpoint, reference, monkeypatch, caplog):
    """Under "auto" a build or capture failure (e.g. a GPU the kernels do not compile for) costs the
    request nothing: the engine logs it, records it, and decodes on the reference step; "on" fails."""
    from services.decode.engine import fastpath

    expected = run(reference, 0, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    engine = load(checkpoint, "on", tokens_per_step=2)
    engine.fast_path_mode = "auto"  # as an "auto" engine on CUDA would be (the CPU needs "on" to get here)

    def broken(self, *args):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(fastpath.FastPath, "prepare", broken)
    with caplog.at_level("WARNING", logger="services.decode.engine.fastpath"):
        assert run(engine, 0, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)) == (expected, "length", {"reference"})
    assert "no kernel image" in engine.fast_path_reason and "no kernel image" in caplog.text
    with pytest.raises(RuntimeError, match="no kernel image"):  # "on" builds every slot's decoder at load
        load(checkpoint, "on")
    monkeypatch.setattr(fastpath, "engine_reason", lambda *args: None)  # "auto" as on a CUDA device
    at_load = load(checkpoint, "auto")
    assert at_load.fast_path is None and "no kernel image" in at_load.fast_path_reason
    assert run(at_load, 1, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)) == (expected, "length", {"reference"})


def test_fast_path_continues_injected_kv(checkpoint, reference):
    """KV written into the slot's receive buffer from outside (here: the reference engine's own
    prefill bytes) is what the fast path attends to: same tokens as the reference run."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    first = int(reference.prefill(0, PROMPT).argmax())
    sent = reference.slot_buffer(0).clone()
    reference.start(0, first, greedy)
    expected = [first]
    while reference.active_slots():
        expected += reference.step()[0].token_ids
    reference.release(0)
    engine = load(checkpoint, "on", tokens_per_step=3)
    engine.slot_buffer(1).copy_(sent)
    engine.inject(1, len(PROMPT))
    engine.start(1, first, greedy)
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[1].token_ids
        assert engine.last_step_path == "fast"
    assert tokens == expected
    engine.release(1)
