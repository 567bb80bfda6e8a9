"""Log-probabilities of generated tokens, as vLLM computes them (``logprobs_mode=raw_logprobs``).

vLLM's sampler (vllm/v1/sample/sampler.py): ``logits.log_softmax(-1, dtype=float32)`` of the logits
it is handed (the model's, with a grammar's bitmask already applied; before penalties, bias,
temperature and the other processors); the sampled token's logprob; its rank
``(logprobs >= logprob).sum(-1)`` (1 + the tokens strictly more likely + the other tokens tied
with it: ``batched_count_greater_than``); the top n by ``torch.topk`` (most likely first).

On the wire a logprob of -inf (a token a grammar or a processor forbids) travels as ``FLOOR``
(-9999.0: JSON has no -inf; vLLM's OpenAI server renders ``max(logprob, -9999.0)`` anyway).
"""

from __future__ import annotations

import torch

from shared.events import TokenLogprobs

FLOOR = -9999.0


def compute(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """logits [N, V] (any float dtype), tokens [N] -> (logprob [N] f32, rank [N] int64,
    top_logprobs [N, num_top] f32, top_ids [N, num_top] int64)."""
    lp = logits.log_softmax(dim=-1, dtype=torch.float32)
    tok_lp = lp.gather(-1, tokens.long()[:, None])
    rank = (lp >= tok_lp).sum(dim=-1)
    top_lp, top_ids = torch.topk(lp, num_top, dim=-1) if num_top else (lp[:, :0], tokens[:, None][:, :0].long())
    return tok_lp[:, 0], rank, top_lp, top_ids


def _finite(x: float) -> float:
    return x if x > FLOOR else FLOOR  # -inf and NaN-free floor (JSON has no -inf)


def to_wire(logprob: list[float], rank: list[int], top_lp: list[list[float]], top_ids: list[list[int]]
            ) -> list[TokenLogprobs]:
    """Host lists of ``compute``'s results as the TokensGenerated entries, one per token."""
    return [TokenLogprobs(logprob=_finite(lp), rank=r, top_ids=list(ids), top_logprobs=[_finite(v) for v in tl])
            for lp, r, tl, ids in zip(logprob, rank, top_lp, top_ids)]
