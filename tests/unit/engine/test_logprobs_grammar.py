"""Logprobs and grammars on the reference step (CPU, float32).

Logprobs are the raw distribution's (vLLM's raw_logprobs): checked against an independent float64
log_softmax of the HF model's logits over the whole sequence, for greedy and sampled requests
(penalties and temperature do not change them) and with MTP drafts (each accepted token scored by
the target model at its position). Grammars (xgrammar, compiled as vLLM compiles them) constrain
the tokens: JSON that parses and fits the schema, a regex match, one of the choices, each finished
with "stop"; drafts are checked against the grammar and the tokens equal those without drafts.
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine import logprobs as lpmod
from services.decode.engine.grammar import GrammarError, choice_as_grammar, grammar_is_likely_lark
from shared.events import SamplingParams, StructuredOutput

PROMPT = [1, 5, 9, 13, 2, 7, 3]
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                     "required": ["ok", "n"], "additionalProperties": False})


def run(engine: Engine, prompt: list[int], sampling: SamplingParams, first: int | None = None):
    logits = engine.prefill(0, prompt)
    first = int(logits.argmax()) if first is None else first
    engine.start(0, first, sampling)
    tokens, lps, reason = [first], [], None
    while engine.active_slots():
        out = engine.step()[0]
        tokens += out.token_ids
        lps += out.logprobs or []
        reason = out.finish_reason
    engine.last_spec = engine.spec_stats(0)
    engine.release(0)
    return tokens, lps, reason


# ------------------------------------------------------------------ pure pieces


@pytest.mark.parametrize("row, token, n, want_rank, want_top", [
    ([0.0, 1.0, 2.0, 3.0], 1, 2, 3, [3, 2]),
    ([0.0, 1.0, 2.0, 3.0], 3, 0, 1, []),
    ([1.0, 1.0, 0.0, 1.0], 1, 1, 3, None),  # ties count: rank = tokens with logprob >= its own
    ([float("-inf"), 2.0, 2.0, 0.0], 0, 4, 4, None),  # a forbidden token is ranked last
])
def test_rank_and_top_n_as_vllm(row, token, n, want_rank, want_top):
    logits = torch.tensor([row])
    lp, rank, top_lp, top_ids = lpmod.compute(logits, torch.tensor([token]), n)
    ref = torch.log_softmax(logits.double(), -1)[0]
    assert rank.tolist() == [want_rank]
    assert lp.dtype == torch.float32 and abs(lp.item() - ref[token].item()) < 1e-6 or ref[token] == float("-inf")
    assert top_lp.shape == (1, n) and top_lp[0].tolist() == sorted(top_lp[0].tolist(), reverse=True)
    if want_top is not None:
        assert top_ids[0].tolist() == want_top
    wire = lpmod.to_wire(lp.tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist())[0]
    assert all(v >= lpmod.FLOOR for v in [wire.logprob, *wire.top_logprobs])  # no -inf on the wire


@pytest.mark.parametrize("choices, grammar", [
    (["yes", "no"], 'root ::= "yes" | "no"'),
    (['say "hi"', "a\\b", "x\ny"], 'root ::= "say \\"hi\\"" | "a\\\\b" | "x\\ny"'),
    (["\x01"], 'root ::= "\\u0001"'),
])
def test_choice_as_grammar_escapes_like_vllm(choices, grammar):
    assert choice_as_grammar(choices) == grammar


@pytest.mark.parametrize("text, lark", [("root ::= 'a'", False), ("start: 'a'", True), ("# c\nroot ::= x", False),
                                        ("", False)])
def test_grammar_is_likely_lark(text, lark):
    assert grammar_is_likely_lark(text) is lark


# ------------------------------------------------------------------ logprobs


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """float64 log_softmax of the HF model's logits: row i scores the token after tokens[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5),
    SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, temperature=0.8, top_k=20, repetition_penalty=1.5,
                   presence_penalty=1.0, logit_bias={40: 3.0}, seed=7),
    SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0),
], ids=["greedy", "sampled", "zero"])
def test_logprobs_are_the_raw_distribution(hf_checkpoint, sampling):
    path, model = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32)
    tokens, lps, _ = run(engine, PROMPT, sampling)
    assert len(lps) == len(tokens) - 1 == sampling.max_tokens
    ref = hf_logprobs(model, PROMPT + tokens)[len(PROMPT):]  # row j scores tokens[j + 1]
    for j, got in enumerate(lps):
        want = ref[j]
        tok = tokens[j + 1]
        assert abs(got.logprob - want[tok].item()) < 1e-4
        assert got.rank == int((want >= want[tok] - 1e-9).sum())
        assert len(got.top_ids) == len(got.top_logprobs) == sampling.logprobs
        assert got.top_ids == want.topk(sampling.logprobs).indices.tolist()
        assert max(abs(a - b) for a, b in zip(got.top_logprobs, want[got.top_ids].tolist())) < 1e-4 if got.top_ids else True


def test_mtp_drafts_give_the_target_models_logprobs(hf_checkpoint):
    path, _ = hf_checkpoint("deepseek_v3")
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=4)
    plain = run(Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32), PROMPT, sp)
    spec_engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32, num_speculative_tokens=2,
                              adaptive_speculation=False)  # every step drafts: the drafts' logprobs are tested
    spec = run(spec_engine, PROMPT, sp)
    assert spec[0] == plain[0]
    assert spec_engine.last_spec.num_accepted_tokens > 0
    for a, b in zip(spec[1], plain[1], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank and a.top_ids == b.top_ids


def test_a_request_without_logprobs_gets_none(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32)
    engine.prefill(0, PROMPT)
    engine.start(0, 5, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step()[0].logprobs is None


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def llama(tiny_model):
    from transformers import AutoTokenizer

    path = tiny_model("llama")
    return Engine.load(path, num_slots=2, max_seq_len=160, dtype=torch.float32), AutoTokenizer.from_pretrained(str(path))


def first_under(engine: Engine, spec: StructuredOutput, prompt: list[int]) -> int:
    """The prefill's first token, sampled under the grammar (greedy), as the prefill does."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(engine.grammars.compile(spec))
    mask = xgr.allocate_token_bitmask(1, engine.cfg.vocab_size)
    m.fill_next_token_bitmask(mask)
    logits = engine.prefill(0, prompt)[None].clone()
    xgr.apply_token_bitmask_inplace(logits, mask)
    engine.release(0)
    return int(logits.argmax())


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput(kind="json", json_schema=SCHEMA, any_whitespace=False),
     lambda t: isinstance(json.loads(t)["ok"], bool) and json.loads(t)["n"] in (1, 2, 3) and len(json.loads(t)) == 2),
    (StructuredOutput(kind="regex", regex="[ab]{3}x"), lambda t: re.fullmatch("[ab]{3}x", t)),
    (StructuredOutput(kind="choice", choices=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    (StructuredOutput(kind="grammar", grammar='root ::= "(" [0-9] [0-9]? ")"'), lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    (StructuredOutput(kind="grammar", grammar='start: "x" "y"+ "z"'), lambda t: re.fullmatch("xy+z", t)),
], ids=["json", "regex", "choice", "ebnf", "lark"])
def test_grammar_constrains_the_output_and_stops(llama, spec, check):
    engine, tok = llama
    prompt = tok.encode("Answer:")
    for sampling in (SamplingParams(max_tokens=60, structured=spec),
                     SamplingParams(max_tokens=60, structured=spec, temperature=1.0, seed=3, logprobs=1)):
        tokens, lps, reason = run(engine, prompt, sampling, first_under(engine, spec, prompt))
        assert reason == "stop", tok.decode(tokens)
        assert tokens[-1] in engine.eos_token_ids  # the grammar allows EOS only once complete
        assert check(tok.decode(tokens, skip_special_tokens=True))
        assert all(lp.logprob > lpmod.FLOOR for lp in lps)  # every sampled token is allowed


def test_grammar_mask_changes_the_logprobs_as_vllm_does(llama):
    """vLLM applies the bitmask to the logits before its sampler: forbidden tokens get -inf."""
    engine, tok = llama
    spec = StructuredOutput(kind="choice", choices=["yes", "no"])
    prompt = tok.encode("Answer:")
    _, lps, _ = run(engine, prompt, SamplingParams(max_tokens=5, structured=spec, logprobs=3), first_under(
        engine, spec, prompt))
    assert lpmod.FLOOR in lps[-1].top_logprobs or lps[-1].logprob == 0.0


@pytest.mark.parametrize("spec, what", [
    (StructuredOutput(kind="json", json_schema="{not json"), "json_schema is not valid JSON"),
    (StructuredOutput(kind="regex", regex="(unclosed"), "regex grammar does not compile"),
    (StructuredOutput(kind="grammar", grammar="root ::= undefined_rule"), "grammar grammar does not compile"),
    (StructuredOutput(kind="choice", choices=[]), "at least one"),
])
def test_a_bad_grammar_fails_the_start_with_its_reason(llama, spec, what):
    engine, _ = llama
    engine.prefill(0, PROMPT)
    with pytest.raises(GrammarError, match=re.escape(what)):
        engine.start(0, 5, SamplingParams(max_tokens=4, structured=spec))
    assert engine.slots[0].state == "ready"  # nothing armed; the node releases the slot
    engine.release(0)


def test_a_first_token_outside_the_grammar_fails_the_start(llama):
    engine, tok = llama
    engine.prefill(0, PROMPT)
    with pytest.raises(GrammarError, match="does not match"):
        engine.start(0, tok.encode("zzz", add_special_tokens=False)[0],
                     SamplingParams(max_tokens=4, structured=StructuredOutput(kind="choice", choices=["yes"])))
    engine.release(0)


def test_grammar_and_plain_requests_share_a_step(llama):
    engine, tok = llama
    spec = StructuredOutput(kind="regex", regex="[ab]{3}x")
    prompt = tok.encode("Answer:")
    alone = run(engine, prompt, SamplingParams(max_tokens=30, structured=spec), first_under(engine, spec, prompt))[0]
    plain_alone = run(engine, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    got = {0: [alone[0]], 1: [int(engine.prefill(1, PROMPT).argmax())]}
    engine.prefill(0, prompt)
    engine.start(0, alone[0], SamplingParams(max_tokens=30, structured=spec))
    engine.start(1, got[1][0], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.active_slots():
        for slot, out in engine.step().items():
            got[slot] += out.token_ids
    engine.release(0)
    engine.release(1)
    assert got == {0: alone, 1: plain_alone}


@pytest.mark.parametrize("drafts, valid", [("abx", 3), ("aba", 2), ("azb", 1), ("x", 0), ("", 0), ("bbx", 3)])
def test_drafts_are_checked_up_to_the_first_the_grammar_refuses(llama, drafts, valid):
    """Per-position masks after each grammar-valid draft prefix; the matcher ends where it began."""
    import xgrammar as xgr

    engine, tok = llama
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abxz"}
    g = engine.grammars.matcher(engine.grammars.compile(StructuredOutput(kind="regex", regex="[ab]{3}x")), [1], 3)
    assert g.accept([ids["a"]])  # one token in: two more [ab], then x
    mask = xgr.allocate_token_bitmask(4, engine.cfg.vocab_size)
    assert g.fill_through([ids[c] for c in drafts[:3]], mask, 0) == valid
    allowed = lambda row, c: bool(mask[row, ids[c] // 32] >> (ids[c] % 32) & 1)  # noqa: E731
    assert allowed(0, "a") and not allowed(0, "x")
    if valid >= 2:
        assert allowed(2, "x") and not allowed(2, "a")  # after [a] + 2 drafts: only x
    assert g.accept([ids["b"], ids["b"], ids["x"]])  # rolled back: the original state goes on


def test_mtp_drafts_are_checked_against_the_grammar(tiny_model):
    """Drafts from an oracle (the tokens the request gets without drafts, one of them replaced by a
    token the grammar refuses every other step): accepted up to the grammar's cut, same tokens."""
    from transformers import AutoTokenizer

    path = tiny_model("deepseek_v3")
    tok = AutoTokenizer.from_pretrained(str(path))
    spec = StructuredOutput(kind="json", json_schema=SCHEMA, any_whitespace=False)
    prompt = tok.encode("Answer:")
    plain = Engine.load(path, num_slots=1, max_seq_len=128, dtype=torch.float32)
    first = first_under(plain, spec, prompt)
    sp = SamplingParams(max_tokens=40, structured=spec, logprobs=2)
    want, want_lps, want_reason = run(plain, prompt, sp, first)
    engine = Engine.load(path, num_slots=1, max_seq_len=128, dtype=torch.float32, num_speculative_tokens=2,
                         adaptive_speculation=False)  # every step verifies the drafts planted here
    engine.prefill(0, prompt)
    engine.start(0, first, sp)
    got, lps, reason, bad = [first], [], None, tok.convert_tokens_to_ids("z")
    while engine.active_slots():
        ahead = want[len(got):len(got) + 2]
        if engine.slots[0].num_steps % 2 and len(ahead) == 2:
            ahead = [ahead[0], bad]
        engine.drafts[0, :len(ahead)] = torch.tensor(ahead)
        engine.slots[0].num_valid_drafts = len(ahead)
        out = engine.step()[0]
        got, lps, reason = got + out.token_ids, lps + out.logprobs, out.finish_reason
    stats = engine.spec_stats(0)
    assert (got, reason) == (want, want_reason) and reason == "stop"
    assert stats.num_accepted_tokens > 0 and stats.num_steps < len(got) - 1  # drafts ran and were accepted
    assert stats.num_draft_tokens < 2 * stats.num_steps  # the grammar cut the refused ones before verifying
    assert [(a.rank, a.top_ids) for a in lps] == [(b.rank, b.top_ids) for b in want_lps]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, want_lps)) < 1e-4
    json.loads(tok.decode(got, skip_special_tokens=True))


def test_a_node_without_tokenizer_files_fails_structured_starts_retryably(hf_checkpoint):
    """Not the request's fault: a plain error (retryable: another node may have them), saying what is missing."""
    path, _ = hf_checkpoint("llama")  # weights and config only
    engine = Engine.load(path, num_slots=1, max_seq_len=64, dtype=torch.float32)
    engine.prefill(0, PROMPT)
    with pytest.raises(RuntimeError, match="tokenizer files") as err:
        engine.start(0, 5, SamplingParams(max_tokens=2, structured=StructuredOutput(kind="json_object")))
    assert getattr(err.value, "retryable", True)
    engine.start(0, 5, SamplingParams(max_tokens=2, logprobs=1))  # logprobs need no tokenizer
    assert len(engine.step()[0].logprobs) == 1


# ---------------------------------------------------------------- the grammar after the reasoning


@pytest.mark.parametrize("ids, ended", [([], False), ([7], False), ([9], True), ([7, 3, 9], True),
                                        ([9, 3, 7], False), ([9, 7, 9, 3], True), ([3, 4], False)])
def test_the_prompt_ends_the_reasoning_as_vllms_think_tag_parsers_decide(ids, ended):
    from shared.events import prompt_ends_reasoning

    assert prompt_ends_reasoning(ids, 7, 9) is ended  # start 7, end 9: the last of them decides
    gate = StructuredOutput(kind="regex", regex="a", reasoning_start_token_id=7, reasoning_end_token_id=9)
    decided = ended if ids else None  # no ids: left unknown for whoever holds them
    assert gate.with_prompt(ids).reasoning_ended is decided and gate.with_prompt(ids).gated is not ended
    if ids:
        assert gate.with_prompt(ids).with_prompt([9]).reasoning_ended is ended  # decided once, by the first prompt
    plain = StructuredOutput(kind="regex", regex="a")
    assert plain.with_prompt(ids) is plain and not plain.gated


def test_a_gated_grammar_masks_and_feeds_nothing_until_the_reasoning_ends(llama):
    """Tokens up to and including the end token go unmasked and unfed (any token, even one the grammar
    refuses); after it, the grammar's own masks; drafts while reasoning are valid up to the end token,
    the row after it the grammar's first mask, and the matcher stays where it was."""
    import xgrammar as xgr

    engine, tok = llama
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abxz"}
    end = ids["z"]
    compiled = engine.grammars.compile(StructuredOutput(kind="regex", regex="[ab]{3}x"))
    allowed = lambda m, row, c: bool(m[row, ids[c] // 32] >> (ids[c] % 32) & 1)  # noqa: E731
    g = engine.grammars.matcher(compiled, [1], 3, reasoning_end=end)
    mask = xgr.allocate_token_bitmask(5, engine.cfg.vocab_size)
    assert g.fill_through([ids["x"], ids["x"]], mask, 0) == 2  # reasoning: every row all allowed
    assert all(allowed(mask, r, "x") and allowed(mask, r, "z") for r in range(3))
    assert g.fill_through([ids["x"], end, ids["a"], ids["a"]], mask, 0) == 2  # stops at the end token
    assert allowed(mask, 1, "x") and allowed(mask, 2, "a") and not allowed(mask, 2, "x")  # row 2: the grammar's
    assert g.accept([ids["x"], ids["x"]]) and g.reasoning  # refused by the grammar, but still reasoning
    g.fill(mask, 0)
    assert allowed(mask, 0, "x")
    assert g.accept([end]) and not g.reasoning  # the end token itself is not fed to the grammar
    g.fill(mask, 0)
    assert allowed(mask, 0, "a") and not allowed(mask, 0, "x") and not allowed(mask, 0, "z")
    assert g.accept([ids["a"], ids["b"], ids["a"], ids["x"]]) and not g.accept([ids["a"]])  # complete: stop only
    refused = engine.grammars.matcher(compiled, [1], 3, reasoning_end=end)
    assert refused.accept([end]) and not refused.accept([ids["x"]])  # after the end, the grammar decides


def test_the_engine_decodes_unconstrained_until_the_reasoning_ends_then_under_the_grammar(llama):
    """A request whose grammar starts after a reasoning end token (here a token the model emits greedily on its
    own): its tokens are the unconstrained greedy tokens up to and including that token, then the grammar's."""
    engine, tok = llama
    prompt = tok.encode("Answer:")
    free = run(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    cut = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # its first occurrence
    spec = StructuredOutput(kind="regex", regex="[ab]{3}x", reasoning_start_token_id=-2,
                            reasoning_end_token_id=free[cut], reasoning_ended=False)
    tokens, _, reason = run(engine, prompt, SamplingParams(max_tokens=40, structured=spec), free[0])
    assert tokens[:cut + 1] == free[:cut + 1]
    assert reason == "stop" and re.fullmatch("[ab]{3}x", tok.decode(tokens[cut + 1:], skip_special_tokens=True))
    ended = msgspec.structs.replace(spec, reasoning_ended=True)  # the prompt ended it: constrained from the start
    with pytest.raises(GrammarError, match="does not match"):
        engine.prefill(0, prompt)
        engine.start(0, free[0], SamplingParams(max_tokens=4, structured=ended))
    engine.release(0)
