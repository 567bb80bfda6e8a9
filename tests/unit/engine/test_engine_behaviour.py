"""Engine behaviour on tiny random checkpoints: injected KV, slot batching, seeded sampling, lifecycle."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams

PROMPTS = [[0, 17, 42, 99, 3, 250, 7], [0, 5, 6, 200, 201, 9, 77, 31, 12, 4, 66], [0, 88, 1 + 1, 150]]
ARCHS = ["llama", "qwen2", "qwen3", "deepseek_v3"]


def run(engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams) -> list[int]:
    """Prefill, start and decode one request alone; returns every token after the prompt."""
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[slot].token_ids
    engine.release(slot)
    return tokens


def hf_cache_to_native(engine: Engine, slot: int, cache, num_tokens: int) -> None:
    """Write an HF DynamicCache into the slot's receive buffer following engine.layout's segments."""
    tensors = []
    for layer in cache.layers:
        if engine.layout.kind == "gqa":
            tensors += [layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]  # [S, Hkv, D]
        else:  # HF caches the normalized latent and the roped shared key, as the native layout does
            tensors.append(torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1))
    buf = engine.slot_buffer(slot)
    for seg, t in zip(engine.layout.segments, tensors):
        raw = t.to(engine.dtype).contiguous().view(torch.uint8).flatten()
        assert raw.numel() == num_tokens * seg.bytes_per_token
        buf[seg.offset_bytes : seg.offset_bytes + raw.numel()] = raw


@pytest.mark.parametrize("arch", ARCHS)
def test_injected_hf_kv_continues_like_own_prefill(hf_checkpoint, arch):
    from transformers import DynamicCache

    path, hf = hf_checkpoint(arch)
    engine = Engine.load(path, num_slots=2, max_seq_len=96, dtype=torch.float32)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[1]
    expected = run(engine, 0, prompt, greedy)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    hf_cache_to_native(engine, 1, cache, len(prompt))
    engine.inject(1, len(prompt))
    engine.start(1, expected[0], greedy)
    tokens = [expected[0]]
    while engine.active_slots():
        tokens += engine.step()[1].token_ids
    assert tokens == expected
    engine.release(1)
    assert engine.free_slots() == [0, 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_two_slots_decode_together_and_match_single_slot(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=45, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)]
    single = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32)
    expected = [run(single, 0, PROMPTS[i], params[i]) for i in range(2)]
    engine = Engine.load(path, num_slots=2, max_seq_len=96, dtype=torch.float32)
    got = {}
    for slot in (0, 1):
        first = int(engine.prefill(slot, PROMPTS[slot]).argmax())
        engine.start(slot, first, params[slot])
        got[slot] = [first]
    batch_sizes = []
    while engine.active_slots():
        batch_sizes.append(len(engine.active_slots()))
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
    assert [got[0], got[1]] == expected
    assert batch_sizes.count(2) == 30 and len(got[1]) == 46
    for slot in (0, 1):
        engine.release(slot)
    assert engine.free_slots() == [0, 1] and engine.active_slots() == []


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32)
    seeded = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=1234)
    a, b = run(engine, 0, PROMPTS[0], seeded), run(engine, 0, PROMPTS[0], seeded)
    other = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=99))
    assert a == b and a != other
    greedy = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
    top1 = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.5, top_k=1, seed=3))
    assert top1 == greedy
    assert engine.free_slots() == [0]


def test_stop_token_and_cancel(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=2, max_seq_len=96, dtype=torch.float32)
    free_run = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    stop_at = free_run[5]
    cut = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]))
    assert cut == free_run[: free_run.index(stop_at, 1) + 1]
    engine.prefill(1, PROMPTS[2])
    engine.start(1, 5, SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(engine.step()[1].token_ids) == 1
    engine.cancel(1)
    assert engine.step() == {} and engine.active_slots() == []
    with pytest.raises(RuntimeError):
        engine.prefill(1, PROMPTS[2]) if False else engine.start(1, 5, SamplingParams(max_tokens=1))
    engine.release(1)
    assert engine.free_slots() == [0, 1]


def test_max_seq_len_finishes_with_length(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=16, dtype=torch.float32)
    tokens = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(PROMPTS[0]) + len(tokens) == 16  # the last token is emitted, never cached
    with pytest.raises(ValueError):
        engine.prefill(0, list(range(16)))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_writes_hf_kv_into_the_native_layout(hf_checkpoint, arch):
    """Byte offsets from engine.layout (shared.kvlayout) hold exactly what HF's cache holds."""
    from transformers import DynamicCache

    path, hf = hf_checkpoint(arch)
    engine = Engine.load(path, num_slots=2, max_seq_len=64, dtype=torch.float32)
    prompt = PROMPTS[1]
    engine.prefill(1, prompt)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    buf, n = engine.slot_buffer(1), len(prompt)
    segments = iter(engine.layout.segments)
    for layer in cache.layers:
        if engine.layout.kind == "gqa":
            expected = [layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]
        else:
            expected = [torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)]
        for want in expected:
            seg = next(segments)
            raw = buf[seg.offset_bytes : seg.offset_bytes + n * seg.bytes_per_token]
            got = raw.view(torch.float32).view(want.shape)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (seg.layer, seg.name)
    engine.release(1)
