"""Sampling parameters through the Engine API on the reference step (CPU, float32): a request's tokens
do not depend on what shares its batch (every random number is keyed by seed and position), the
processors act on the output as vLLM defines it (earlier legs' tokens and the first token count),
and the prompt ids ride along where the node did not prefill the prompt."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import Engine
from shared.events import SamplingParams

PROMPTS = [[1, 5, 9, 13, 2, 7, 3], [1, 40, 41, 42]]
MIXED = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.3, logit_bias={17: 2.0}, bad_words_token_ids=[[9, 13]],
                       min_tokens=5, stop_token_ids=[3], seed=11)


def run(engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams) -> list[int]:
    first = int(engine.prefill(slot, prompt).argmax())
    engine.start(slot, first, sampling)
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[slot].token_ids
    engine.release(slot)
    return tokens


def test_a_request_samples_the_same_tokens_alone_and_batched(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    alone = run(Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32), 0, PROMPTS[0], MIXED)
    engine = Engine.load(path, num_slots=2, max_seq_len=96, dtype=torch.float32)
    other = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=2.0, ignore_eos=True)
    got = {}
    for slot, (prompt, sp) in enumerate(((PROMPTS[0], MIXED), (PROMPTS[1], other))):
        got[slot] = [int(engine.prefill(slot, prompt).argmax())]
        engine.start(slot, got[slot][0], sp)
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
    assert got[0] == alone
    assert 3 not in alone[1:6]  # min_tokens: the stop id is held back for 5 tokens


def test_penalties_and_bad_words_count_earlier_legs_output(hf_checkpoint):
    """A migrated leg: ``output_token_ids`` (earlier legs) and the first token are the output so far."""
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32)
    free = run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first, x = free[0], free[1]
    assert x != first

    def second(**kw) -> int:
        return run(engine, 0, PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, **kw))[1]

    assert second(presence_penalty=2.0, frequency_penalty=2.0) == x  # x is not in the output yet
    assert second(presence_penalty=2.0, frequency_penalty=2.0, output_token_ids=[x]) != x
    assert second(bad_words_token_ids=[[first, x]]) != x  # the first token is output: the prefix matches
    assert second(bad_words_token_ids=[[77, first, x]], output_token_ids=[77]) != x
    assert second(bad_words_token_ids=[[78, first, x]], output_token_ids=[77]) == x
    assert second(bad_words_token_ids=[[PROMPTS[0][-1], first, x]]) == x  # prompt ids are not output


def test_repetition_penalty_needs_the_prompt_where_the_node_did_not_prefill_it(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32)
    expected = run(engine, 0, PROMPTS[0], MIXED)
    sender = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32)
    first = int(sender.prefill(0, PROMPTS[0]).argmax())
    kv = sender.slot_buffer(0).clone()
    engine.slot_buffer(0).copy_(kv)
    engine.inject(0, len(PROMPTS[0]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.start(0, first, MIXED)
    engine.release(0)
    engine.slot_buffer(0).copy_(kv)
    engine.inject(0, len(PROMPTS[0]))
    from msgspec import structs

    engine.start(0, first, structs.replace(MIXED, prompt_token_ids=PROMPTS[0]))
    tokens = [first]
    while engine.active_slots():
        tokens += engine.step()[0].token_ids
    assert tokens == expected


def test_requests_with_output_dependent_processors_do_not_speculate(hf_checkpoint):
    path, _ = hf_checkpoint("deepseek_v3")
    engine = Engine.load(path, num_slots=1, max_seq_len=96, dtype=torch.float32, num_speculative_tokens=2,
                         adaptive_speculation=False)  # a CPU engine drafts only when told to draft every step
    plain = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    penalised = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, frequency_penalty=0.5, ignore_eos=True)
    for sp, drafts in ((plain, True), (penalised, False)):
        first = int(engine.prefill(0, PROMPTS[0]).argmax())
        engine.start(0, first, sp)
        while engine.active_slots():
            engine.step()
        assert (engine.spec_stats(0).num_draft_tokens > 0) == drafts
        engine.release(0)
