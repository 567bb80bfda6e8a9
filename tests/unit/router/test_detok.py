"""Incremental detokenization: pieces add up to the full decode, stop strings cut exactly."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.router.detok import Detokenizer

TEXT = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé wörds: naïve café, 東京 タワー 🙂🚀.",
    "Express lanes carry latency critical traffic while the standard lane keeps the rest.",
    "Stop here STOP and never after. 12345 + 67890 = 80235; <END> tokens end things.",
]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 3, trainer)
    return tok


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([  # what Llama/Mistral tokenizer.json files use
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(TEXT[1:] * 3, trainer)  # the unicode line is unseen: byte fallback
    return tok


TOKENIZERS = {"byte_level": _byte_level(), "metaspace": _metaspace()}

CASES = [
    # (prompt, completion, batch size)
    ("Say:", " The quick brown fox jumps over the lazy dog.", 1),
    ("Say:", " Ünïcödé wörds: naïve café, 東京 タワー 🙂🚀.", 1),
    ("", "Express lanes carry traffic.", 3),
    ("Go", " 東京🙂 and 🚀 again", 4),
    ("x", " 12345 + 67890 = 80235;", 2),
]


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("prompt,completion,batch", CASES)
def test_pieces_equal_full_decode(tok_name, prompt, completion, batch):
    tok = TOKENIZERS[tok_name]
    prompt_ids = tok.encode(prompt).ids if prompt else []
    full_ids = tok.encode(prompt + completion).ids
    out_ids = full_ids[len(prompt_ids):]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    d = Detokenizer(tok, prompt_ids)
    text, seen = "", []
    for i in range(0, len(out_ids), batch):
        delta = d.add(out_ids[i : i + batch])
        assert "\ufffd" not in delta.text
        text += delta.text
        seen += delta.token_ids
    text += d.flush()
    expect = tok.decode(full_ids)[len(tok.decode(prompt_ids)):] if prompt_ids else tok.decode(out_ids)
    assert seen == out_ids
    assert text == expect
    assert d.num_tokens == len(out_ids)


STOP_CASES = [
    # (completion, stop, include, expected text, expected finish)
    (" Stop here STOP and never after.", ["STOP"], False, " Stop here ", "stop"),
    (" Stop here STOP and never after.", ["STOP"], True, " Stop here STOP", "stop"),
    (" Stop here STOP and never after.", ["never", "here"], False, " Stop ", "stop"),
    (" Stop here STOP and never after.", ["absent"], False, " Stop here STOP and never after.", None),
    (" 12345 + 67890 = 80235;", ["+ 6"], False, " 12345 ", "stop"),
    (" 12345 + 67890 = 80235;", [";"], False, " 12345 + 67890 = 80235", "stop"),
]


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("completion,stop,include,expected,finish", STOP_CASES)
def test_stop_strings(tok_name, completion, stop, include, expected, finish):
    tok = TOKENIZERS[tok_name]
    prompt_ids = tok.encode("Q:").ids
    out_ids = tok.encode("Q:" + completion).ids[len(prompt_ids):]
    d = Detokenizer(tok, prompt_ids, stop=stop, include_stop_str_in_output=include)
    text, reason, consumed = "", None, []
    for t in out_ids:
        delta = d.add([t])
        text += delta.text
        consumed += delta.token_ids
        if delta.finish_reason:
            reason = delta.finish_reason
            break
    text += d.flush()
    assert text == expected
    assert reason == finish
    # ids consumed up to and including the one that completed the stop string, none after
    assert consumed == out_ids[: len(consumed)]
    assert d.num_tokens == len(consumed)
    if finish is None:
        assert consumed == out_ids
    # text held back while a stop string might still be forming is never shown before the end
    assert d.add(out_ids[:1]).token_ids == ([] if finish else out_ids[:1])


def test_batch_after_stop_not_consumed():
    tok = TOKENIZERS["byte_level"]
    out_ids = tok.encode(" Stop here STOP and never after.").ids
    d = Detokenizer(tok, [], stop=["STOP"])
    delta = d.add(out_ids)
    assert delta.finish_reason == "stop" and delta.stop_reason == "STOP"
    assert len(delta.token_ids) < len(out_ids)
    assert delta.text + d.flush() == " Stop here "


def test_special_tokens_skipped_or_kept():
    tok = TOKENIZERS["byte_level"]
    eos = tok.token_to_id("</s>")
    ids = tok.encode(" lazy dog").ids + [eos]
    skip = Detokenizer(tok, [], skip_special_tokens=True)
    keep = Detokenizer(tok, [], skip_special_tokens=False)
    assert (skip.add(ids).text + skip.flush()) == tok.decode(ids, skip_special_tokens=True)
    assert (keep.add(ids).text + keep.flush()).endswith("</s>")


def test_a_stop_token_is_consumed_without_its_text_as_vllm_does():
    tok = TOKENIZERS["byte_level"]
    eos = tok.token_to_id("</s>")
    ids = tok.encode(" lazy dog").ids + [eos]
    for include, text in ((False, " lazy dog"), (True, " lazy dog</s>")):
        d = Detokenizer(tok, [], skip_special_tokens=False, stop_token_ids=[eos],
                        include_stop_str_in_output=include)
        delta = d.add(ids)
        assert (delta.text + d.flush(), d.num_tokens, delta.token_ids) == (text, len(ids), ids)
