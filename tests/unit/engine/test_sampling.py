"""Sampling and speculative acceptance: greedy exactness, filters, and distribution preservation."""

from __future__ import annotations

import torch

from services.decode.engine.sampling import process_probs, sample
from services.decode.engine.spec import verify


def test_process_probs_filters():
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1.0, 3.0]]]).expand(4, 1, 5).contiguous()
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.7])
    probs = process_probs(logits, temperature, top_k, top_p)[:, 0]
    assert probs[0].tolist() == [0, 0, 0, 0, 1]  # greedy: one-hot at the argmax
    assert torch.allclose(probs[1], logits[1, 0].softmax(-1))
    assert (probs[2] > 0).tolist() == [True, False, False, False, True]
    full = logits[3, 0].softmax(-1)  # sorted: 3.0 (0.61), 2.0 (0.22) -> keep until the cumulative mass reaches 0.7
    assert (probs[3] > 0).tolist() == [True, False, False, False, True]
    assert torch.allclose(probs[3].sum(), torch.tensor(1.0)) and full[4] < 0.7


def test_greedy_verify_accepts_exactly_the_matching_prefix():
    v, k = 6, 3
    target_tokens = torch.tensor([[4, 2, 5, 1], [4, 2, 5, 1], [4, 2, 5, 1]])
    target = torch.nn.functional.one_hot(target_tokens, v).float()
    drafts = torch.tensor([[4, 2, 5], [4, 3, 5], [4, 2, 5]])
    draft = torch.nn.functional.one_hot(drafts, v).float()
    num_valid = torch.tensor([3, 3, 1])
    greedy = torch.tensor([True, True, True])
    n, nxt = verify(target, draft, drafts, num_valid, torch.rand(3, k), torch.ones(3, v), greedy)
    assert n.tolist() == [3, 1, 1] and nxt.tolist() == [1, 2, 2]


def test_speculative_sampling_preserves_the_target_distribution():
    torch.manual_seed(0)
    v, trials = 5, 40000
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1])
    target = p.expand(trials, 2, v).contiguous()
    draft = q.expand(trials, 1, v).contiguous()
    greedy = torch.zeros(trials, dtype=torch.bool)
    drafts = sample(draft, torch.empty(trials, 1, v).exponential_(), greedy)
    n, nxt = verify(target, draft, drafts, torch.ones(trials, dtype=torch.long), torch.rand(trials, 1),
                    torch.empty(trials, v).exponential_(), greedy)
    first = torch.where(n == 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=v).float() / trials
    assert (freq - p).abs().max() < 0.015
    assert abs(float(n.float().mean()) - float(torch.minimum(p, q).sum())) < 0.015
