"""Per-slot request bookkeeping of the engine: pure Python, no torch.

A slot is free, then ``ready`` (its cache holds ``seq_len`` tokens, from the engine's prefill or
an inject), then ``active`` (decoding; ``pending`` is the last emitted token, not yet in the cache),
then ``done`` (finished or cancelled) until released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SlotState:
    state: str = "free"  # free | ready | active | done
    seq_len: int = 0  # tokens whose KV is in the cache
    pending: int = 0
    num_generated: int = 0
    max_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    is_greedy: bool = True  # greedy without logits processors: the argmax of the raw logits
    sampling: Any = None  # the request's sampling.RequestSampling
    output_ids: list[int] = field(default_factory=list)  # the output so far (earlier legs', then ours), pending last
    prompt_ids: list[int] | None = None  # the prompt, when the engine prefilled it itself
    num_spec: int = 0  # drafts per step for this request, at most
    drafting: Any = None  # spec_policy.Drafting: how many its next step drafts (adaptive speculation)
    num_valid_drafts: int = 0  # drafts held for the next step
    has_prefill_hidden: bool = False
    num_logprobs: int | None = None  # SamplingParams.logprobs: None off, n: logprob, rank and top n per token
    grammar: Any = None  # grammar.SlotGrammar of a structured-output request
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def spec_k(self) -> int:
        """Drafts the next step verifies / draws for this request."""
        if self.state != "active":
            return 0
        return self.drafting.k if self.drafting is not None else self.num_spec


def emit(state: SlotState, tokens: list[int], max_seq_len: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens at the first stop token or at max_tokens; return (emitted, finish_reason).

    Updates the counters of ``state``; the last emitted token becomes ``pending``.
    """
    out: list[int] = []
    reason = None
    for tok in tokens:
        if state.num_generated + len(out) >= state.max_tokens or state.seq_len + 1 + len(out) >= max_seq_len:
            reason = "length"
            break
        out.append(tok)
        if tok in state.stop_token_ids:
            reason = "stop"
            break
    state.num_generated += len(out)
    state.seq_len += len(out)
    state.output_ids += out
    if out:
        state.pending = out[-1]
    if reason is None and state.num_generated >= state.max_tokens:
        reason = "length"
    if reason is None and state.seq_len + 1 >= max_seq_len:  # prompt + output reached max_seq_len
        reason = "length"
    return out, reason
