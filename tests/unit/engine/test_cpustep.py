"""The fused CPU step (services/decode/engine/cpustep.py), the Llama family's and the DeepSeek-V3 family's: the torch
step's tokens, logits and cache rows for steps of one token a slot, alone or batched, beside drafting steps, and the
torch step where it cannot be built or applied."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine, EngineConfig, cpustep
from shared.events import SamplingParams

PROMPT = [0, 17, 42, 99, 3, 250, 7, 8, 120, 64, 5, 31, 77]
NUM_STEPS = 24
DRAFTED_PROMPT = [0, 88, 2, 150]  # the near-bigram DeepSeek-V3 accepts most of its MTP drafts after it


def cache_views(engine: Engine) -> list[torch.Tensor]:
    """Every cache view the steps write: K and V a layer (Llama family) or the latent a layer (DeepSeek family)."""
    c = engine.cache
    return [*c.k_caches, *c.v_caches] if engine.cfg.family == "gqa" else list(c.kv)


def run(engine: Engine, slot: int, sampling: SamplingParams,
        prompt: list[int] = PROMPT) -> tuple[list[int], list[torch.Tensor], set[str]]:
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, logits, paths = [first], [], set()
    while engine.active_slots():
        out = engine.step()[slot]
        tokens += out.token_ids
        logits.append(engine.last_logits[0, 0].clone())
        paths.add(engine.last_step_path)
    return tokens, logits, paths


# GQA; llama3 rope; qkv bias + tied head; q/k norm; MLA with q LoRA, two routing groups, a shared expert and a dense
# first layer; with YaRN's mscale; without q LoRA in one routing group (DeepSeek-V2-Lite-like)
@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3", "deepseek_v3", "deepseek_v3_yarn",
                                  "deepseek_v3_lite"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.9, seed=11)])
def test_fused_step_gives_the_torch_steps_tokens_logits_and_cache_rows(hf_checkpoint, arch, sampling):
    path, _ = hf_checkpoint(arch)
    params = SamplingParams(max_tokens=NUM_STEPS, ignore_eos=True, **sampling)
    fused = Engine.load(path, num_slots=2, max_seq_len=128, dtype=torch.float32)
    plain = Engine.load(path, num_slots=2, max_seq_len=128, dtype=torch.float32, cpu_step="off")
    assert fused.model.cpu_step is not None, fused.model.cpu_step_reason  # this host builds it
    assert plain.model.cpu_step is None and plain.model.cpu_step_reason == "cpu_step='off'"
    got, got_logits, got_paths = run(fused, 1, params)
    want, want_logits, want_paths = run(plain, 1, params)
    assert got_paths == {cpustep.PATH} and want_paths == {"reference"}
    assert got == want and len(got) == NUM_STEPS + 1
    for a, b in zip(got_logits, want_logits, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    n = len(PROMPT) + NUM_STEPS  # rows written: the prompt's, then each step's input token
    for ours, theirs in zip(cache_views(fused), cache_views(plain), strict=True):
        torch.testing.assert_close(ours[1, :n], theirs[1, :n], rtol=1e-5, atol=1e-5)
        assert not ours[1, :n].eq(0).all(dim=-1).any() and ours[1, n:].eq(0).all()  # these rows, no others
        assert ours[0].eq(0).all()  # the other slot untouched


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_slots_stepped_together_each_get_the_torch_steps_tokens_and_rows(hf_checkpoint, arch):
    """Three slots of different lengths in one step (one greedy, two sampled), one leaving mid-run: each slot's
    token attends to its own keys, as the torch step's causal mask over the batch has it."""
    path, _ = hf_checkpoint(arch)
    prompts = {0: PROMPT, 1: PROMPT[5:], 2: PROMPT[::-1] + PROMPT}
    params = {0: SamplingParams(max_tokens=10, ignore_eos=True),
              1: SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=3),
              2: SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.1, top_k=20, seed=5)}
    runs = []
    for mode in ("auto", "off"):
        engine = Engine.load(path, num_slots=3, max_seq_len=64, dtype=torch.float32, cpu_step=mode)
        for slot, prompt in prompts.items():
            engine.start(slot, int(engine.prefill(slot, prompt).argmax()), params[slot])
        steps = []
        while engine.active_slots():
            out = engine.step()
            steps.append(({k: v.token_ids for k, v in out.items()}, engine.last_step_slots, engine.last_step_path))
        runs.append((steps, engine))
    (fused, fe), (plain, pe) = runs
    assert [s[1] for s in fused] == [3] * 4 + [2] * 6  # slot 1 done after its 4 steps
    assert {s[2] for s in fused} == {cpustep.PATH} and {s[2] for s in plain} == {"reference"}
    assert [s[0] for s in fused] == [s[0] for s in plain]
    for ours, theirs in zip(cache_views(fe), cache_views(pe), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=7)])
def test_speculative_steps_take_the_fused_step_and_keep_the_torch_steps_output(hf_checkpoint, sampling):
    """An MTP engine (DeepSeek-V3 near-bigram, whose drafts are accepted; two drafts a step): the steps verifying
    drafts (their tokens one after another), the MTP layer over them and each further draft all take native calls;
    the tokens, the drafts verified and accepted, the main layers' latent rows and the MTP layer's are those of an
    engine that never takes the fused step (greedy, and speculative sampling with a seed)."""
    path, _ = hf_checkpoint("deepseek_v3")
    params = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    runs = {}
    for mode in ("auto", "off"):
        engine = Engine.load(path, num_slots=1, max_seq_len=128, dtype=torch.float32, cpu_step=mode,
                             num_speculative_tokens=2, adaptive_speculation=False)
        assert (engine.model.cpu_step is not None and engine.model.cpu_step.num_mtp == 1) == (mode == "auto")
        runs[mode] = (*run(engine, 0, params, DRAFTED_PROMPT), engine)
    (tokens, _, paths, fe), (want, _, want_paths, pe) = runs["auto"], runs["off"]
    assert paths == {cpustep.PATH} and want_paths == {"reference"}
    assert tokens == want and len(tokens) == 41
    spec = fe.spec_counters
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0  # drafts were verified, some accepted
    assert (spec["draft_tokens"], spec["accepted_tokens"]) == (pe.spec_counters["draft_tokens"],
                                                                pe.spec_counters["accepted_tokens"])
    views, want_views = cache_views(fe), cache_views(pe)
    assert len(views) == fe.cfg.num_layers + 1  # the MTP layer's latent rows too
    for ours, theirs in zip(views, want_views, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_prefill_keeps_the_torch_step_and_rows_past_a_step_s_reach_are_refused(hf_checkpoint):
    """The prompt (many tokens a slot) runs torch's batched forward; the kernel takes at most MAX_TOKENS_A_SLOT
    tokens a slot, at consecutive positions, as many in every slot."""
    path, _ = hf_checkpoint("deepseek_v3")
    engine = Engine.load(path, num_slots=2, max_seq_len=64, dtype=torch.float32)
    engine.prefill(0, PROMPT)
    assert not engine.model.fused  # the prompt's forward was torch's
    kernel = engine.model.cpu_step
    assert kernel.forward([[5, 6, 7, 8]], [1], [[0, 1, 2, 3]]).shape == (1, 4, 64)
    for tokens, slots, positions in (([[5] * 5], [1], [list(range(5))]), ([[5, 6]], [1], [[0, 2]]),
                                     ([[5, 6], [5]], [0, 1], [[3, 4], [3]])):
        with pytest.raises(ValueError, match="consecutive positions"):
            kernel.forward(tokens, slots, positions)


def test_without_a_compiler_the_engine_keeps_the_torch_step_and_says_why(hf_checkpoint, monkeypatch, tmp_path):
    path, _ = hf_checkpoint("llama")
    monkeypatch.setattr(cpustep, "_lib", {})  # nothing built in this process yet
    monkeypatch.setenv("EXPRESSLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32)
    assert engine.model.cpu_step is None and "no C compiler" in engine.model.cpu_step_reason
    assert list(tmp_path.iterdir()) == []
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens, _, paths = run(engine, 0, params)
    assert paths == {"reference"}
    monkeypatch.setattr(cpustep, "_lib", {})
    monkeypatch.delenv("CC")
    built = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32)  # a compiler: built into the dir
    assert built.model.cpu_step is not None and [p.suffix for p in (tmp_path / "cpustep").iterdir()] == [".so"]
    assert run(built, 0, params)[::2] == (tokens, {cpustep.PATH})


@pytest.mark.parametrize("arch,dtype,kv,env,words", [
    ("llama", torch.bfloat16, "auto", None, "not float32"),
    ("llama", torch.float32, "fp8", None, "FP8 KV cache"),
    ("llama", torch.float32, "auto", "off", "EXPRESSLANE_CPU_STEP=off"),
    ("deepseek_v3", torch.bfloat16, "auto", None, "not float32"),
    ("deepseek_v32", torch.float32, "auto", None, "sparse attention"),
    ("glm_moe_dsa", torch.float32, "auto", None, "sparse attention"),
])
def test_engines_the_fused_step_cannot_serve_keep_the_torch_step(hf_checkpoint, monkeypatch, arch, dtype, kv, env,
                                                                 words):
    path, _ = hf_checkpoint(arch)
    if env:
        monkeypatch.setenv("EXPRESSLANE_CPU_STEP", env)
    engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=dtype, kv_cache_dtype=kv)
    assert engine.model.cpu_step is None and words in engine.model.cpu_step_reason
    assert run(engine, 0, SamplingParams(max_tokens=2, ignore_eos=True))[2] == {"reference"}


def test_cpu_step_setting_is_checked():
    with pytest.raises(ValueError, match="cpu_step must be one of auto, off"):
        EngineConfig(cpu_step="fast").validate()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_the_fused_step_refuses_what_it_would_read_out_of_bounds(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    engine = Engine.load(path, num_slots=2, max_seq_len=64, dtype=torch.float32)
    kernel = engine.model.cpu_step
    assert kernel.forward([5], [2], [63]).shape == (1, 1, 64)  # the scratch row, the last position
    for tokens, slots, positions in (([256], [0], [0]), ([-1], [0], [0]), ([5], [3], [0]), ([5], [0], [64]),
                                     ([5, 5], [1, 3], [4, 0])):  # a bad row after a good one: neither is run
        rows = [c.clone() for c in cache_views(engine)]
        with pytest.raises(IndexError, match="out of range"):
            kernel.forward(tokens, slots, positions)
        assert all(torch.equal(a, b) for a, b in zip(rows, cache_views(engine)))
