"""Byte-level BPE tokenizers for the tiny models, trained on ``tinymodel_corpus.txt``.

Two families, each built exactly the way HF transformers rebuilds it, so that
``tokenizers.Tokenizer.from_file("tokenizer.json")``, ``AutoTokenizer`` and vLLM all give the same
ids for the same text:

- ``llama`` style (llama, deepseek_v3): GPT-2 byte-level pre-tokenizer, ``<|begin_of_text|>``
  prepended by the post-processor, ``<|end_of_text|>`` eos, ``<|pad|>`` pad.
- ``qwen`` style (qwen2, qwen3): NFC + the Qwen2 split regex + byte-level, no bos,
  ``<|endoftext|>`` as eos/pad/unk (transformers 5 always loads qwen2 checkpoints with its own
  ``Qwen2Tokenizer``, which builds exactly this pipeline).

Both have ``<|im_start|>``/``<|im_end|>`` and the same ChatML chat template; special tokens take
the first ids. Training is deterministic. The template renders ``tools`` the way Hermes/Qwen2.5
models see them (a system block with the functions as JSON, calls as
``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, which vLLM's ``hermes`` parser
reads); without tools and tool calls it renders exactly what it always did.

``add_planted_tokens(tok, pieces)`` appends non-special added tokens (a planted model's pieces,
infra.tinymodel ``--plant``) after the trained vocabulary, so the base ids do not move.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

CORPUS = Path(__file__).with_name("tinymodel_corpus.txt")
TARGET_VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 2048
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools>\nCall a function as <tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is not none or not message.get('tool_calls') %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TokenizerStyle:
    name: str
    specials: tuple[str, ...]  # ids 0..n-1, in this order
    bos: str | None
    eos: str
    pad: str
    unk: str | None

    def id_of(self, token: str | None) -> int | None:
        return None if token is None else self.specials.index(token)


LLAMA_STYLE = TokenizerStyle(
    "llama", ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"),
    bos="<|begin_of_text|>", eos="<|end_of_text|>", pad="<|pad|>", unk=None)
QWEN_STYLE = TokenizerStyle(
    "qwen", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None, eos="<|endoftext|>", pad="<|endoftext|>", unk="<|endoftext|>")
IM_END = "<|im_end|>"


def style_for(arch: str) -> TokenizerStyle:
    return QWEN_STYLE if arch.startswith("qwen") else LLAMA_STYLE


def train_tokenizer(style: TokenizerStyle):
    """Train the byte-level BPE of ``style`` on the bundled corpus (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if style is QWEN_STYLE:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE, min_frequency=2, special_tokens=list(style.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), trainer)
    if style.bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{style.bos} $A", pair=f"{style.bos} $A {style.bos} $B",
            special_tokens=[(style.bos, style.id_of(style.bos))])
    return tok


def add_planted_tokens(tok, pieces: list[str]) -> list[int]:
    """Append ``pieces`` as plain (non-special, not normalized) added tokens; returns their ids."""
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(p, normalized=False, special=False, single_word=False, lstrip=False,
                               rstrip=False) for p in pieces])
    return [tok.token_to_id(p) for p in pieces]


def tokenizer_config_files(style: TokenizerStyle, planted: dict[int, str] | None = None) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json contents."""
    names = {"bos_token": style.bos, "eos_token": style.eos, "pad_token": style.pad}
    if style.unk is not None:
        names["unk_token"] = style.unk
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(style.specials)}
    added |= {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": False} for i, t in (planted or {}).items()}
    config = {"tokenizer_class": "Qwen2Tokenizer" if style is QWEN_STYLE else "PreTrainedTokenizerFast",
              **names, "added_tokens_decoder": added,
              "additional_special_tokens": [t for t in style.specials if t not in names.values()],
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
              "model_max_length": MODEL_MAX_LENGTH, "padding_side": "left"}
    if style is QWEN_STYLE:
        config["add_prefix_space"] = False
    return {"tokenizer_config.json": config,
            "special_tokens_map.json": {k: v for k, v in names.items() if v is not None}}
