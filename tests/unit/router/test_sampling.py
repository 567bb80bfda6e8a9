"""The router's bad_words tokenization is vLLM's (SamplingParams.update_from_tokenizer)."""

from __future__ import annotations

import pytest

from services.router.sampling import bad_words_token_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model("llama")))


@pytest.mark.parametrize("words", [["hello"], [" hello", "world peace"], ["the", "The", "ing"], ["!"]])
def test_bad_words_tokenize_as_vllm_does(tokenizer, words):
    from vllm import SamplingParams

    class AsVllmSees:  # the two things vLLM asks of its tokenizer here
        encode = staticmethod(tokenizer.encode)
        max_token_id = len(tokenizer) - 1

    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(AsVllmSees())
    assert bad_words_token_ids(tokenizer, words) == params.bad_words_token_ids
