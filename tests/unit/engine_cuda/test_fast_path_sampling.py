"""Sampling on the fast path (cuda/sampling.py, Triton interpreted on CPU) against the reference sampler.

Kernel level, table-driven: the sampling kernels and ``ReferenceSampler`` read the same slot row and the
same float32 logits for several consecutive positions (logits built so that every processor changes
something: the last output tokens, stop ids and bad words' last ids sit at the top), and pick the
same tokens, in every mode of the kernels (all tokens, candidates, the exact slow search), with the
kernel advancing the slot's counts, recent tokens and banned ids itself.

Engine level: seeded sampled requests through ``Engine(fast_path="on")`` decode on the fast path with
the tokens of ``Engine(fast_path="off")``'s reference step, one or several tokens per step, also when
a request moves between the paths mid-way; plain greedy requests never run the sampling kernels;
unseeded requests differ.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.cuda import FastOptions
from services.decode.engine.cuda import sampling as K
from services.decode.engine.cuda import sampling_state as S
from services.decode.engine.sampling import ReferenceSampler
from shared.events import SamplingParams
from tests.unit.engine.hf_models import save_checkpoint

V = 512
CASES = [  # (name, request, candidate capacity, the kernels' mode it must exercise)
    ("temperature", S.RequestSampling(temperature=0.8, seed=1), 64, K.MODE_ALL),
    ("min_p", S.RequestSampling(temperature=1.0, min_p=0.1, seed=2), 64, K.MODE_ALL),
    ("top_k", S.RequestSampling(temperature=0.7, top_k=20, seed=3), 64, K.MODE_CAND),
    ("top_p", S.RequestSampling(temperature=1.0, top_p=0.5, seed=4), 128, K.MODE_CAND),
    ("bench_mix", S.RequestSampling(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                    prompt_ids=[5, 6, 7], seed=5), 64, K.MODE_CAND),
    ("top_p_overflow", S.RequestSampling(temperature=1.0, top_p=0.9, seed=6), 16, K.MODE_OVER),
    ("top_k_top_p_overflow", S.RequestSampling(temperature=0.9, top_k=40, top_p=0.8, seed=7), 16, K.MODE_OVER),
    ("penalties", S.RequestSampling(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.7,
                                    presence_penalty=0.6, prompt_ids=[1, 2, 3], seed=8), 64, K.MODE_ALL),
    ("bias_allowed", S.RequestSampling(temperature=0.9, logit_bias={3: 4.0, 9: -100.0, 40: 2.5},
                                       allowed_token_ids=list(range(0, 200)), top_k=8, seed=9), 64, K.MODE_CAND),
    ("bad_words", S.RequestSampling(temperature=0.6, bad_words=[[11], [7, 7, 9], [300, 301], [7, 13]],
                                    seed=10), 64, K.MODE_ALL),
    ("min_tokens", S.RequestSampling(temperature=1.0, top_k=5, stop_ids=[1, 2, 3], min_pos=23, seed=11), 64,
     K.MODE_CAND),
    ("greedy_processors", S.RequestSampling(temperature=0.0, repetition_penalty=3.0, frequency_penalty=1.0,
                                            bad_words=[[7, 7]], prompt_ids=[4], logit_bias={100: 1.0}), 64, None),
]


def hot_logits(gen: torch.Generator, req: S.RequestSampling, history: list[int]) -> torch.Tensor:
    """Random logits with some exact ties, and the ids every processor acts on at the top."""
    x = torch.randn(V, generator=gen) * 2.0
    x[::9] = x[::9].round()
    hot = history[-3:] + req.stop_ids + [w[-1] for w in req.bad_words] + list(req.logit_bias)[:2]
    for j, t in enumerate(hot):
        x[t] = float(x.max()) + 0.25 * (j % 3)
    return x


@pytest.mark.parametrize("name, req, cap, mode", CASES, ids=[c[0] for c in CASES])
def test_sampling_kernels_pick_the_reference_samplers_tokens(name, req, cap, mode):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    bufs = S.SamplingBuffers(3, V, "cpu")
    history, pos0 = [7, 7, 5], 20
    bufs.arm(2, req, history, pos0 + 1)
    fast = K.FastSampler(bufs.row(2), V, "cpu", block_v=128, cap=cap, block_c=16, block_j=16)
    ref = ReferenceSampler(bufs)
    token, step = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    out, pos = torch.zeros(8, dtype=torch.int64), torch.tensor([pos0], dtype=torch.int32)
    embed, h = torch.randn(V, 8), torch.zeros(8)
    got, expected, modes = [], [], set()
    for t in range(5):
        logits = hot_logits(gen, req, history)
        banned = [S.banned_ids(req.bad_words, history)]
        expected.append(int(ref.tokens(logits[None], torch.tensor([2]), torch.tensor([pos0 + 1 + t]), req.flags,
                                       banned)[0]))
        fast.finish(logits.clone(), token, out, step, pos, embed, h)  # advances the row's counts / bad-word state
        got.append(int(token))
        modes.add(fast.mode)
        history.append(got[-1])
    assert got == expected
    assert out[:5].tolist() == got and int(step) == 5 and int(pos) == pos0 + 5
    assert torch.equal(h, embed[got[-1]])
    if mode is not None:
        assert mode in modes
    if req.flags & S.TRACK_COUNTS:
        assert torch.equal(bufs.counts[2], torch.bincount(torch.tensor(history), minlength=V).int())


# ---------------------------------------------------------------- through the Engine API

OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPT = [0, 17, 42, 99, 3, 250, 7]
OTHER = [0, 88, 2, 150]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-sampling-llama")
    save_checkpoint("llama", path, damp=True)
    return path


def load(path, mode: str, tokens_per_step: int = 1) -> Engine:
    return Engine.load(path, num_slots=2, max_seq_len=48, dtype="bfloat16", fast_path=mode,
                       fast_path_options=OPTIONS, fast_path_tokens_per_step=tokens_per_step)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load(checkpoint, "off")


def run(engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], str, set[str]]:
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens, reason, paths = [first], None, set()
    while engine.active_slots():
        out = engine.step()[slot]
        tokens, reason = tokens + out.token_ids, out.finish_reason
        paths.add(engine.last_step_path)
    engine.release(slot)
    return tokens, reason, paths


ENGINE_CASES = [  # (sampling, tokens per step)
    (SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True), 1),
    (SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=4,
                    ignore_eos=True), 4),
    (SamplingParams(max_tokens=8, temperature=1.2, top_p=0.8, presence_penalty=1.5, frequency_penalty=0.5,
                    logit_bias={42: 3.0, 105: -5.0}, bad_words_token_ids=[[200], [42, 43]], seed=5,
                    ignore_eos=True), 4),
    (SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.8, seed=6, ignore_eos=True), 1),
    (SamplingParams(max_tokens=12, temperature=1.5, top_k=3, min_tokens=4, stop_token_ids=[24, 8], seed=7),  # 24 held back
     4),
]


@pytest.mark.parametrize("sampling, tokens_per_step", ENGINE_CASES)
def test_seeded_sampled_requests_decode_on_the_fast_path_with_the_reference_tokens(checkpoint, reference, sampling,
                                                                                    tokens_per_step):
    expected = run(reference, 0, PROMPT, sampling)
    assert expected[2] == {"reference"}
    engine = load(checkpoint, "on", tokens_per_step)
    engine.prefill(0, PROMPT)
    engine.start(0, 5, sampling)
    assert engine.slot_fast_path_reason(0) is None
    engine.release(0)
    assert run(engine, 0, PROMPT, sampling) == (expected[0], expected[1], {"fast"})


def test_a_sampled_request_moves_between_the_paths_with_the_same_tokens(checkpoint, reference):
    """Batched with another request (reference step), then alone (fast path): its penalties' counts and
    bad-word state follow it across, and the tokens equal a reference run of it alone."""
    sampled = SamplingParams(max_tokens=10, temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.5,
                             bad_words_token_ids=[[42, 105], [197]], seed=21, ignore_eos=True)
    expected = run(reference, 0, PROMPT, sampled)[0]
    engine = load(checkpoint, "on", tokens_per_step=2)
    first = int(engine.prefill(0, PROMPT).argmax())
    engine.start(0, first, sampled)
    engine.prefill(1, OTHER)
    engine.start(1, 9, SamplingParams(max_tokens=3, temperature=0.5, seed=1, ignore_eos=True,
                                      bad_words_token_ids=[[3] * 17]))  # beyond the fast path: reference steps
    got, paths = [first], []
    while engine.active_slots():
        outs = engine.step()
        got += outs[0].token_ids if 0 in outs else []
        paths.append(engine.last_step_path)
    assert paths[:3] == ["reference"] * 3 and set(paths[3:]) == {"fast"}
    assert got == expected


def test_plain_greedy_keeps_the_argmax_graph_and_unseeded_requests_differ(checkpoint, monkeypatch):
    calls = []
    finish = K.FastSampler.finish
    monkeypatch.setattr(K.FastSampler, "finish", lambda self, *a, **kw: (calls.append(1), finish(self, *a, **kw)))
    engine = load(checkpoint, "on", tokens_per_step=4)
    calls.clear()
    run(engine, 0, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))  # one step of 4 tokens
    assert calls == []  # greedy without processors: the decoder's own argmax
    unseeded = SamplingParams(max_tokens=8, temperature=1.5, ignore_eos=True)
    a, b = run(engine, 0, PROMPT, unseeded), run(engine, 0, PROMPT, unseeded)
    assert a[2] == b[2] == {"fast"} and len(calls) == 16 and a[0] != b[0]


def test_gpu_bench_builds_the_engine_over_the_decoders_weights():
    """bench/decode_gpu_sampling.py measures the Engine over the bench model's weights: its HF names
    map back onto the same fused tensors."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[3] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import decode_gpu_sampling as B
    finally:
        sys.path.remove(str(bench))
    from services.decode.engine.cuda import llama as L

    s = dict(hidden=64, layers=2, hq=4, hkv=2, d=16, inter=128, vocab=256, eps=1e-5)
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()

    layers = [L.GqaLayer(torch.ones(64).bfloat16(), w(128, 64), w(64, 64), torch.ones(64).bfloat16(), w(256, 64),
                         w(64, 128)) for _ in range(2)]
    model = L.GqaModel(layers, w(256, 64), torch.ones(64).bfloat16(), w(256, 64), 4, 2, 16, 1e-5)
    engine = Engine.from_hf_tensors({**B.hf_config(s), "max_position_embeddings": 512}, B.hf_tensors(model, s),
                                    max_seq_len=32, dtype=torch.bfloat16, fast_path="off")
    for mine, theirs in zip(engine.model.layers, layers):
        assert torch.equal(mine.wqkv, theirs.wqkv) and torch.equal(mine.w_gate_up, theirs.w_gate_up)
        assert torch.equal(mine.wo, theirs.wo) and torch.equal(mine.w_down, theirs.w_down)
    assert torch.equal(engine.model.lm_head, model.lm_head) and torch.equal(engine.model.embed, model.embed)
