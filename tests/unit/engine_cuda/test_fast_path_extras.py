"""Logprobs and grammars on the fast path (Triton interpreted on CPU) against the reference step.

Kernel level: the grammar mask kernel sets exactly the forbidden logits to -inf (xgrammar's own
CPU apply as the oracle), the logprobs ops give the reference computation's logprob, rank and top n.
Engine level: requests with logprobs and/or a grammar decode on the fast path, alone and batched
with another request (graphs with the mask before the sampling kernels and the logprobs after),
with the reference step's tokens and finish, and logprobs equal to it within bfloat16 logits' noise.
"""

from __future__ import annotations

import re

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine import logprobs as lpmod
from services.decode.engine.cuda import FastOptions
from services.decode.engine.cuda import sampling as K
from services.decode.engine.cuda import sampling_state as S
from shared.events import SamplingParams, StructuredOutput
from tests.unit.engine.hf_models import VOCAB, save_checkpoint

OPTIONS = FastOptions(tiles={"qkv": (8, 64, 4, 1), "o": (64, 64, 4, 1), "gate_up": (128, 64, 4, 1),
                             "down": (64, 128, 4, 1), "lm_head": (256, 64, 4, 1)}, num_splits=2, block_s=32)
PROMPT = [0, 17, 42, 99, 3, 250, 7]
EOS = 1


def char_vocab() -> list[str]:
    """Token i is the character chr(i) for printable ASCII, a placeholder otherwise (EOS is 1)."""
    return [chr(i) if 32 <= i < 127 else f"<t{i}>" for i in range(VOCAB)]


def use_char_vocab(engine: Engine) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(char_vocab(), vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
    engine.grammars._compiler = xgr.GrammarCompiler(info, max_threads=1)


def test_grammar_mask_kernel_matches_xgrammars_apply():
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    bufs = S.SamplingBuffers(3, VOCAB, "cpu")
    words = torch.randint(-(2**31), 2**31 - 1, ((VOCAB + 31) // 32,), generator=gen, dtype=torch.int64).to(torch.int32)
    bufs.gmask[2] = words
    sampler = K.FastSampler(bufs.row(0), VOCAB, "cpu", row=torch.tensor([2], dtype=torch.int32))
    logits = torch.randn(VOCAB, generator=gen)
    want = logits.clone()[None]
    xgr.apply_token_bitmask_inplace(want, words[None])
    sampler.apply_grammar_mask(logits)
    assert torch.equal(logits, want[0])
    assert bool((logits == float("-inf")).any()) and bool((logits > float("-inf")).any())


@pytest.mark.parametrize("vocab", [VOCAB, 3 * K.LP_CHUNK + 7])  # one padded chunk; several, the last padded
def test_logprobs_ops_match_the_reference_computation(vocab):
    gen = torch.Generator().manual_seed(1)
    bufs = S.SamplingBuffers(1, vocab, "cpu")
    sampler = K.FastSampler(bufs.row(0), vocab, "cpu")
    logits = torch.randn(vocab, generator=gen)
    logits[::7] = logits[::7].round()  # ties
    logits[5] = float("-inf")
    for step, token in enumerate([3, 7, 5]):
        sampler.logprobs(logits, torch.tensor([token]), torch.tensor([step + 1]), 4)
        lp, rank, top_lp, top_ids = lpmod.compute(logits[None], torch.tensor([token]), S.MAX_LOGPROBS)
        assert abs(sampler.lp_val[step, 0].item() - lp.item()) < 1e-5 or lp.item() == float("-inf")
        assert sampler.lp_ids[step, 0].item() == rank.item()
        assert torch.allclose(sampler.lp_val[step, 1:], top_lp[0], atol=1e-5, rtol=0)
        # the same values chosen (ties in any order, as torch.topk's own order among them is unspecified)
        assert torch.equal(logits[sampler.lp_ids[step, 1:]], logits[top_ids[0]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fast-extras-llama")
    save_checkpoint("llama", path, damp=True)
    return path


def load(path, mode: str, tokens_per_step: int = 1) -> Engine:
    engine = Engine.load(path, num_slots=2, max_seq_len=48, dtype="bfloat16", fast_path=mode,
                         fast_path_options=OPTIONS, fast_path_tokens_per_step=tokens_per_step)
    use_char_vocab(engine)
    return engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load(checkpoint, "off")


@pytest.fixture(scope="module")
def fast(checkpoint):
    return load(checkpoint, "on", tokens_per_step=4)


def first_token(engine: Engine, spec: StructuredOutput | None) -> int:
    import xgrammar as xgr

    logits = engine.prefill(0, PROMPT)[None].float().clone()
    if spec is not None:
        mask = xgr.allocate_token_bitmask(1, VOCAB)
        xgr.GrammarMatcher(engine.grammars.compile(spec)).fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
    return int(logits.argmax())


def run(engine: Engine, sampling: SamplingParams):
    first = first_token(engine, sampling.structured)
    engine.start(0, first, sampling)
    tokens, lps, reason, paths = [first], [], None, set()
    while engine.active_slots():
        out = engine.step()[0]
        tokens, reason = tokens + out.token_ids, out.finish_reason
        lps += out.logprobs or []
        paths.add(engine.last_step_path)
    engine.release(0)
    return tokens, lps, reason, paths


REGEX = StructuredOutput(kind="regex", regex="[a-e]{2,6}x")
CASES = [  # greedy with logprobs: in the batched test below
    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, temperature=1.0, top_k=30, seed=3,
                   repetition_penalty=1.3),
    SamplingParams(max_tokens=20, structured=REGEX),
    SamplingParams(max_tokens=20, structured=REGEX, logprobs=3, temperature=0.9, seed=5),
]


@pytest.mark.parametrize("sampling", CASES, ids=["sampled_lp0", "regex", "regex_sampled_lp"])
def test_logprobs_and_grammars_decode_on_the_fast_path_as_the_reference(reference, fast, sampling):
    want = run(reference, sampling)
    assert want[3] == {"reference"}
    got = run(fast, sampling)
    assert got[3] == {"fast"}
    assert got[0] == want[0] and got[2] == want[2]
    assert len(got[1]) == len(want[1]) == (len(got[0]) - 1 if sampling.logprobs is not None else 0)
    for a, b in zip(got[1], want[1]):
        assert abs(a.logprob - b.logprob) < 0.05 and len(a.top_ids) == len(b.top_ids) == sampling.logprobs
        assert a.top_ids[:1] == b.top_ids[:1] and all(abs(x - y) < 0.05 for x, y in zip(a.top_logprobs, b.top_logprobs))
    if sampling.structured is not None:
        text = "".join(char_vocab()[t] for t in got[0] if t != EOS)
        assert got[2] == "stop" and got[0][-1] == EOS
        assert re.fullmatch("[a-e]{2,6}x", text)


def run_pair(engine: Engine, first_sp: SamplingParams, second_sp: SamplingParams):
    """Two requests decoding together (slot 0 first_sp after PROMPT, slot 1 second_sp after OTHER)."""
    got = {0: [first_token(engine, first_sp.structured)]}
    engine.start(0, got[0][0], first_sp)
    got[1] = [int(engine.prefill(1, OTHER).argmax())]
    engine.start(1, got[1][0], second_sp)
    lps, reasons, paths = {0: [], 1: []}, {}, []
    while engine.active_slots():
        outs = engine.step()
        paths.append((engine.last_step_path, engine.last_step_slots))
        for slot, out in outs.items():
            got[slot] += out.token_ids
            lps[slot] += out.logprobs or []
            reasons[slot] = out.finish_reason
    engine.release(0)
    engine.release(1)
    return got, lps, reasons, paths


OTHER = [0, 88, 2, 150]


@pytest.mark.parametrize("first_sp, second_sp", [
    (SamplingParams(max_tokens=12, structured=REGEX, logprobs=3), SamplingParams(max_tokens=6, ignore_eos=True)),
    (SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2),
     SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=9)),
], ids=["grammar_lp_and_plain", "lp_and_sampled"])
def test_extras_slots_decode_batched_on_the_fast_path_as_the_reference(reference, fast, first_sp, second_sp):
    want = run_pair(reference, first_sp, second_sp)
    got = run_pair(fast, first_sp, second_sp)
    assert {p for p, _ in want[3]} == {"reference"}
    assert ("fast", 2) in got[3] and {p for p, _ in got[3]} == {"fast"}  # batched while both run, then alone
    assert got[0] == want[0] and got[2] == want[2]
    for slot in (0, 1):
        assert len(got[1][slot]) == len(want[1][slot])
        for a, b in zip(got[1][slot], want[1][slot]):
            assert abs(a.logprob - b.logprob) < 0.05 and a.top_ids[:1] == b.top_ids[:1]
    if first_sp.structured is not None:
        assert got[2][0] == "stop" and re.fullmatch("[a-e]{2,6}x", "".join(char_vocab()[t] for t in got[0][0][:-1]))
