"""Structural tags (vLLM's tool_choice required/named under strict tool calling) on the decode node.

The tags are the JSON texts vLLM 0.32 hands to xgrammar: hermes's ``tags_with_separator`` for
tool_choice required (``stop_after_first`` false) and named (true), and the legacy
``structures``/``triggers`` form that vLLM still compiles through ``StructuralTagItem``. The mask
allows what the tag allows: a call envelope byte for byte, any JSON object as arguments, nothing
before the envelope when a call is required, free text before a trigger in the legacy form. On
the planted tool-call model the reference step decodes the planted call under the tag, and a tag
naming another tool bends the output to that tool.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.decode.engine import Engine
from services.decode.engine.grammar import GrammarError, Grammars
from shared.events import SamplingParams, StructuredOutput


def _hermes(name: str, stop_after_first: bool) -> str:
    """hermes's structural tag for one tool, as vLLM 0.32's parser builds it (json.dumps of its model)."""
    content = {"type": "json_schema", "json_schema": True, "style": "json", "any_order": False,
               "max_whitespace_cnt": None, "excludes": []}
    tags = [{"type": "tag", "begin": f'<tool_call>{nl}{{"name": "{name}", "arguments": ', "content": content,
             "end": f"}}{nl}</tool_call>"} for nl in ("\n", "")]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
        "stop_after_first": stop_after_first}})


LEGACY = json.dumps({"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [{
    "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
    "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "end": "}\n</tool_call>"}]})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def planted(tiny_model):
    from transformers import AutoTokenizer

    path = tiny_model("llama", plant="tool-call")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return path, AutoTokenizer.from_pretrained(str(path)), Grammars(path, vocab), vocab


def _walk(planted, tag: str, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, EOS allowed after it) under ``tag``."""
    import xgrammar as xgr

    _, tok, grammars, vocab = planted
    g = grammars.matcher(grammars.compile(StructuredOutput(kind="structural_tag", structural_tag=tag)),
                         [tok.eos_token_id], 0)
    if not g.accept(tok.encode(text, add_special_tokens=False)):
        return False, False
    mask = xgr.allocate_token_bitmask(1, vocab)
    g.fill(mask, 0)
    return True, bool((mask[0, tok.eos_token_id // 32] >> (tok.eos_token_id % 32)) & 1)


@pytest.mark.parametrize("tag, text, accepted, may_end", [
    (_hermes("get_weather", False), CALL, True, True),
    (_hermes("get_weather", False), CALL + CALL, True, True),  # required: more calls may follow
    (_hermes("get_weather", False), CALL.replace("\n", ""), True, True),  # the compact envelope
    (_hermes("get_weather", False), '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n'
                                    "</tool_call>", True, True),  # arguments: any JSON object
    (_hermes("get_weather", False), '<tool_call>\n{"name": "get_weather", "arguments": {"city"', True, False),
    (_hermes("get_weather", False), "", True, False),  # a call is required
    (_hermes("get_weather", False), "Sunny.", False, False),  # no text before the call
    (_hermes("get_weather", False), CALL.replace("get_weather", "get_time"), False, False),
    (_hermes("get_time", True), CALL.replace("get_weather", "get_time"), True, True),  # named
    (_hermes("get_time", True), CALL.replace("get_weather", "get_time") * 2, False, False),  # only one
    (LEGACY, "Sunny. " + CALL, True, True),  # free text, then the triggered call
    (LEGACY, "", True, True),
    (LEGACY, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}', False, False),  # schema
], ids=["call", "two-calls", "compact", "any-args", "unfinished", "empty", "text-first", "other-name",
        "named", "named-twice", "legacy-text-then-call", "legacy-empty", "legacy-schema"])
def test_the_mask_allows_what_the_tag_allows(planted, tag, text, accepted, may_end):
    assert _walk(planted, tag, text) == (accepted, may_end)


@pytest.mark.parametrize("tag", ["{not json", json.dumps({"type": "structural_tag", "format": {"type": "nope"}})])
def test_a_bad_structural_tag_fails_with_its_reason(planted, tag):
    with pytest.raises(GrammarError, match="structural_tag"):
        planted[2].compile(StructuredOutput(kind="structural_tag", structural_tag=tag))


def test_the_reference_step_decodes_under_the_tag(planted):
    path, tok, _, _ = planted
    engine = Engine.load(path, num_slots=1, max_seq_len=192, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Weather?"}], add_generation_prompt=True,
                                     tokenize=False)
    prompt = tok.encode(prompt, add_special_tokens=False)
    first = tok.convert_tokens_to_ids("<tool_call>")
    outputs = {}
    for name in ("get_weather", "get_time"):
        spec = StructuredOutput(kind="structural_tag", structural_tag=_hermes(name, True))
        engine.prefill(0, prompt)
        engine.start(0, first, SamplingParams(max_tokens=64, structured=spec))
        tokens, reason = [first], None
        while engine.active_slots():
            out = engine.step()[0]
            tokens += out.token_ids
            reason = out.finish_reason
        engine.release(0)
        outputs[name] = (tok.decode(tokens, skip_special_tokens=True), reason)
    assert outputs["get_weather"] == (CALL, "stop")  # the planted call, inside the tag
    text, reason = outputs["get_time"]  # the tag bends the planted model to the named tool
    assert reason == "stop" and text.startswith('<tool_call>\n{"name": "get_time", "arguments": {')
    assert text.endswith("}\n</tool_call>") or text.endswith("}</tool_call>")
    json.loads(text[text.index('"arguments": ') + 13:text.rindex("}")])


def test_the_wire_carries_the_tag_and_older_messages_still_decode():
    import msgspec

    spec = StructuredOutput(kind="structural_tag", structural_tag=LEGACY)
    sampling = SamplingParams(max_tokens=4, structured=spec)
    assert msgspec.json.decode(msgspec.json.encode(sampling), type=SamplingParams).structured == spec
    older = b'{"kind": "regex", "json_schema": "", "regex": "a+", "choices": [], "grammar": "", "any_whitespace": true}'
    assert msgspec.json.decode(older, type=StructuredOutput) == StructuredOutput(kind="regex", regex="a+")
