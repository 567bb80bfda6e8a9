"""Sampling without host syncs: logits -> processed probabilities -> tokens.

Per row of a step: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), applied in that order
(vLLM's order). Greedy rows become one-hot distributions at the argmax, so the speculative
acceptance rule in spec.py is exact for them. Randomness comes from per-slot torch.Generators
(per-request seeds) as exponential noise: argmax(p / E) with E ~ Exp(1) samples from p.
"""

from __future__ import annotations

import torch


def process_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] (float32), per-row params [B] -> probabilities [B, T, V]."""
    b, t, v = logits.shape
    greedy = (temperature <= 0)[:, None, None]
    x = logits / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=logits.device)
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)[:, None, None]
    remove_sorted = (rank >= k).expand(b, t, v)
    p_sorted = sorted_x.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
    remove_sorted = remove_sorted | ((p_sorted.cumsum(dim=-1) - p_sorted) > top_p[:, None, None])
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    probs = x.masked_fill(remove, float("-inf")).softmax(dim=-1)
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def sample(probs: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """probs [B, ..., V], exponential noise of the same shape, greedy [B] -> tokens [B, ...]."""
    g = greedy.view(-1, *([1] * (probs.dim() - 2)))
    return torch.where(g, probs.argmax(dim=-1), (probs / noise).argmax(dim=-1))


def exponential_noise(generators: list[torch.Generator], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(generators), *shape] Exp(1) noise, row b drawn from generators[b]."""
    return torch.stack([torch.empty(shape, device=device).exponential_(generator=g) for g in generators])


def uniform_noise(generators: list[torch.Generator], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(generators), *shape] U[0, 1) noise, row b drawn from generators[b]."""
    return torch.stack([torch.rand(shape, device=device, generator=g) for g in generators])
