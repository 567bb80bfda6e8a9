"""How many MTP drafts a request's next step should verify: speculation that never slows it down.

Pure Python, no torch. A draft step verifying ``k`` drafts costs ``cost[k]`` plain steps (``cost[0]``
is 1) and emits ``1 + p + p^2 + ... + p^k`` tokens on average when each draft is accepted with
probability ``p`` given the ones before it were. Per request (``Drafting``), ``observe`` learns ``p``
from what its steps accepted (decayed counts: a draft accepted is a success; the first rejection of a
step is a failure, the drafts after it are never tried) and picks the ``k`` with the most tokens per
unit of cost; ``k = 0`` (drafting does not pay) turns drafting off for ``backoff`` steps, after which
a probe turns it on again at the request's maximum for ``PROBE_STEPS`` steps to measure anew; each
probe that finds drafting still not paying doubles the backoff (``MIN_BACKOFF`` .. ``MAX_BACKOFF``),
one that finds it paying resets it. A model whose drafts are rarely accepted (an MTP head that does
not fit, random weights) so decodes plain steps but for a probe every ``MAX_BACKOFF`` steps; a
request whose drafts are accepted keeps drafting, at the ``k`` its acceptance pays for.

``costs(k_max, per_draft)``: the cost table ``1 + per_draft * k``, fixed per engine: a policy that
followed measured times would draft differently from run to run, and a seeded sampled request's
tokens depend on where its drafts were (greedy output never depends on any of this: every draft is
verified, engine.py). The default (0.35) sits between what the H200 measured for a k-draft step on
the DeepSeek-V2-Lite shape (1 + 0.1 k when drafts route to the experts the verified token uses, 1 +
0.32 k with random routing: bench/NOTES-gpu.md); requests that sample draft against their own, higher
table (``SAMPLED_COST_PER_DRAFT``): speculative sampling costs more a draft; a greedy request whose step ran in a
batch of slots against the batched step's (``BATCH_COST_PER_DRAFT``).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past per observed step: acceptance follows the request's current text
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 1.5  # a fresh request starts out drafting (p = 2/3)
MIN_BACKOFF, MAX_BACKOFF = 8, 256  # steps drafting stays off before the next probe
PROBE_STEPS = 2  # steps a probe drafts (the first may have no drafts to verify yet)
COST_PER_DRAFT = 0.35  # a k-draft step costs ~ 1 + 0.35 k plain steps
# ... and ~ 1 + 0.5 k when it samples: each draft and the verify also build their processed distribution
# over the vocabulary (DeepSeek-family fast path, run SS3 in bench/NOTES-gpu.md: +0.4 ms a draft on the H200)
SAMPLED_COST_PER_DRAFT = 0.5
# ... and ~ 1 + 0.5 k for a greedy request drafting in a batched step beside other slots (the DeepSeek-family fast
# path's MlaBatchSpecDecoder, run G56 on an H100, V2-Lite shape: one draft a slot 1.53-1.61x the plain batched step
# of 2-8 slots, three drafts 2.38-2.47x): a batch reads the experts once for all its rows, so the draft rows' share
# of the step is larger than alone. Greedy requests only: greedy output never depends on where the drafts were, a
# seeded sampled request's does, so a sampled request keeps one table whatever decodes beside it
BATCH_COST_PER_DRAFT = 0.5
# ... and on an engine whose steps run on the CPU (the torch step or the fused one, cpustep.py): a step verifying k
# drafts runs the model, and its MTP layer, over k + 1 tokens at about k + 1 steps' cost or more (the tiny
# DeepSeek-V3, 79% of its drafts accepted: one draft costs 3.5 plain steps fused, 2.3 in torch). Drafting cannot
# pay there whatever is accepted (can_pay): under adaptive speculation its requests do not draft at all
CPU_COST_PER_DRAFT = 1.5


def tokens_per_step(p: float, k: int) -> float:
    """Expected tokens a step verifying k drafts emits at per-draft acceptance p (geometric)."""
    return sum(p ** j for j in range(k + 1))


def best_k(p: float, costs: list[float]) -> int:
    """The draft count 0..len(costs)-1 with the most expected tokens per unit of step cost (ties:
    fewer drafts)."""
    best, rate = 0, 1.0 / costs[0]
    for k in range(1, len(costs)):
        r = tokens_per_step(p, k) / costs[k]
        if r > rate * (1 + 1e-9):
            best, rate = k, r
    return best


def can_pay(costs: list[float]) -> bool:
    """Whether any draft count pays for its cost at all, were every draft accepted (a CPU engine's
    table: none does, so its requests never draft under adaptive speculation)."""
    return best_k(1.0, costs) > 0


def costs(k_max: int, per_draft: float = COST_PER_DRAFT) -> list[float]:
    """Step cost of 0..k_max drafts, in plain steps."""
    return [1.0 + per_draft * k for k in range(k_max + 1)]


@dataclass
class Drafting:
    """One request's drafting state: ``k`` is what its next step drafts / verifies."""

    k_max: int
    k: int = 0
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    off_steps: int = 0  # steps left with drafting off (k == 0 and k_max > 0)
    backoff: int = MIN_BACKOFF
    probing: int = 0  # steps left of a probe

    def __post_init__(self) -> None:
        self.k = self.k_max

    @property
    def p(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    def observe(self, verified: int, accepted: int, cost: list[float]) -> int:
        """After one step that verified ``verified`` drafts and accepted ``accepted`` of them: the
        draft count of the next step."""
        if self.k_max == 0:
            return 0
        if self.k == 0:  # off: wait out the backoff, then probe
            self.off_steps -= 1
            if self.off_steps <= 0:
                self.k, self.probing = self.k_max, PROBE_STEPS
            return self.k
        if verified > 0:
            self.accepted = self.accepted * DECAY + accepted
            self.tried = self.tried * DECAY + accepted + (1 if accepted < verified else 0)
        was_probing = self.probing > 0
        if was_probing:
            self.probing -= 1
            if self.probing > 0:
                return self.k  # the probe's steps first
        k = best_k(self.p, cost[: self.k_max + 1])
        if k == 0:
            if was_probing:  # still not paying: wait longer this time
                self.backoff = min(self.backoff * 2, MAX_BACKOFF)
            self.off_steps = self.backoff
        elif was_probing:
            self.backoff = MIN_BACKOFF
        self.k = k
        return k
