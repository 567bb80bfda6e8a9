"""Adaptive drafting (spec_policy): the draft count a request's next step uses, from its acceptance."""

from __future__ import annotations

import pytest

from services.decode.engine.spec_policy import COST_PER_DRAFT, CPU_COST_PER_DRAFT, MAX_BACKOFF, MIN_BACKOFF, \
    PROBE_STEPS, SAMPLED_COST_PER_DRAFT, Drafting, best_k, can_pay, costs, tokens_per_step

COSTS = costs(3)  # 1, 1.35, 1.7, 2.05


@pytest.mark.parametrize("p, k", [(0.0, 0), (0.2, 0), (0.3, 0), (0.5, 1), (0.7, 2), (0.9, 3), (1.0, 3)])
def test_best_k_is_the_draft_count_with_the_most_tokens_per_cost(p, k):
    assert best_k(p, COSTS) == k


@pytest.mark.parametrize("p, greedy_k, sampled_k", [(0.4, 1, 0), (0.5, 1, 0), (0.6, 1, 1), (0.8, 3, 2), (0.95, 3, 3)])
def test_sampled_requests_draft_against_their_dearer_table(p, greedy_k, sampled_k):
    """Speculative sampling costs more a draft (each draft and the verify build a distribution): at the
    same acceptance a sampled request drafts as many or fewer."""
    from services.decode.engine.spec_policy import SAMPLED_COST_PER_DRAFT

    assert best_k(p, COSTS) == greedy_k
    assert best_k(p, costs(3, SAMPLED_COST_PER_DRAFT)) == sampled_k


@pytest.mark.parametrize("k_max, per_draft, pays", [
    (3, COST_PER_DRAFT, True), (1, SAMPLED_COST_PER_DRAFT, True), (3, 0.99, True),  # k drafts: k + 1 tokens
    (3, 1.0, False), (1, CPU_COST_PER_DRAFT, False), (3, CPU_COST_PER_DRAFT, False),  # ... for 1 + k * per_draft
    (0, COST_PER_DRAFT, False)])  # no drafts to pay for
def test_drafting_can_pay_only_where_full_acceptance_beats_its_cost(k_max, per_draft, pays):
    """A CPU engine's price a draft (a verify of k drafts ~ k + 1 plain steps) never pays; the fast path's does."""
    assert can_pay(costs(k_max, per_draft)) is pays


@pytest.mark.parametrize("p, k, tokens", [(0.0, 3, 1.0), (1.0, 3, 4.0), (0.5, 2, 1.75)])
def test_tokens_per_step_is_geometric(p, k, tokens):
    assert tokens_per_step(p, k) == pytest.approx(tokens)


def drive(d: Drafting, accept, steps: int) -> list[int]:
    """k of each step over ``steps`` steps; ``accept(k)`` drafts accepted of k verified."""
    ks, valid = [], d.k  # drafts the first step verifies (drawn at start)
    for _ in range(steps):
        ks.append(d.k)
        verified = min(valid, d.k)
        drawn = d.k
        d.observe(verified, accept(verified), COSTS)
        valid = drawn  # what this step drew for the next one
    return ks


def test_drafts_never_accepted_turn_drafting_off_with_rare_probes():
    d = Drafting(3)
    ks = drive(d, lambda verified: 0, 2000)
    assert ks[0] == 3 and 0 in ks[:4]  # off after a few unaccepted steps
    drafted = sum(1 for k in ks if k)
    assert drafted < 0.03 * len(ks)  # probes only
    assert d.backoff == MAX_BACKOFF
    first_off = ks.index(0)
    gaps, run = [], 0  # lengths of the off stretches: the backoff doubling
    for k in ks[first_off:]:
        if k == 0:
            run += 1
        elif run:
            gaps.append(run)
            run = 0
    assert gaps[:4] == [MIN_BACKOFF, 2 * MIN_BACKOFF, 4 * MIN_BACKOFF, 8 * MIN_BACKOFF]
    assert max(gaps) == MAX_BACKOFF


def test_drafts_always_accepted_keep_the_maximum():
    d = Drafting(3)
    assert set(drive(d, lambda verified: verified, 300)) == {3}


def test_a_probe_that_finds_drafts_accepted_turns_drafting_back_on():
    d = Drafting(2)
    drive(d, lambda verified: 0, 200)  # off, backoff grown
    assert d.backoff > MIN_BACKOFF
    ks = drive(d, lambda verified: verified, 2 * MAX_BACKOFF + 10)  # the text got predictable
    assert ks[-1] == 2 and d.backoff == MIN_BACKOFF
    assert ks.count(2) > len(ks) // 2


def test_middling_acceptance_drafts_fewer():
    d = Drafting(3)
    ks = drive(d, lambda verified: min(verified, 1), 200)  # the first draft of a step accepted, never the second
    assert set(ks[-50:]) <= {1, 2}


def test_no_drafts_stay_no_drafts():
    d = Drafting(0)
    assert d.k == 0 and drive(d, lambda verified: 0, 10) == [0] * 10


def test_a_probe_lasts_its_steps():
    d = Drafting(3)
    ks = drive(d, lambda verified: 0, 3 + MIN_BACKOFF + PROBE_STEPS + 1)
    first_off = ks.index(0)
    assert ks[first_off:first_off + MIN_BACKOFF] == [0] * MIN_BACKOFF
    assert ks[first_off + MIN_BACKOFF:first_off + MIN_BACKOFF + PROBE_STEPS] == [3] * PROBE_STEPS
