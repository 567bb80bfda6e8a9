"""Speculative sampling acceptance (Leviathan et al. / Chen et al.), exact for greedy rows.

Step layout: the verify forward ran on ``[pending, d_1 .. d_K]``; ``target[:, i]`` is the target
distribution of the token after input i, ``draft[:, i]`` the distribution d_{i+1} was drawn from.
Draft i+1 is accepted when ``u * q(d) < p(d)``; at the first rejection the next token is drawn from
``max(0, p - q)`` renormalized, and after K acceptances from ``p`` itself. For one-hot (greedy)
distributions this accepts exactly the drafts that equal the target argmax and returns the target
argmax, so speculative greedy output equals plain greedy output. Static shapes, no host sync.
"""

from __future__ import annotations

import torch

from .sampling import row_sum, sample


def verify(
    target: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K, V]
    drafts: torch.Tensor,  # [B, K] token ids
    num_valid: torch.Tensor,  # [B] drafts to consider per row (0..K)
    uniform: torch.Tensor,  # [B, K]
    noise: torch.Tensor,  # [B, V] exponential noise for the next token
    greedy: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [B], next_token [B])."""
    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    p_d = target[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = draft.gather(-1, drafts[..., None])[..., 0]
    ok = (uniform * q_d < p_d) & (torch.arange(k, device=drafts.device)[None] < num_valid[:, None])
    num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)
    p_a = target[rows, num_accepted]
    q_a = draft[rows, num_accepted.clamp(max=k - 1)]
    residual = (p_a - q_a).clamp(min=0)
    use_residual = (num_accepted < num_valid)[:, None] & (row_sum(residual) > 0)
    dist = torch.where(use_residual, residual, p_a)
    return num_accepted, sample(dist, noise, greedy)
