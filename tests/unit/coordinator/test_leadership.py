"""Table-driven tests of the leader lease (pure: the local clock is an argument).

Each case is a list of steps ``(t_ms, op, args, expect)`` fed to one ``Leadership``; ``expect`` is
what the step must return (``observe``: take the key now?) or, for ``check``, whether it leads.
Every case ends by checking that a standby is left with nothing to serve.
"""

from __future__ import annotations

import pytest

from services.coordinator.core import CoordinatorCore
from services.coordinator.leadership import Leadership, LeadershipConfig
from shared.events import ClaimRequest
from tests.unit.coordinator.test_core import hb

CFG = LeadershipConfig(ttl_ms=1000, renew_ms=200, margin_ms=300)

CASES = {
    "no key: lead at once": [
        (0, "observe", (0, False), True),
        (5, "won", (1,), None),
        (5, "check", (), True),
        (704, "check", (), True),
        (705, "check", (), False),  # 5 + ttl - margin: no renewal, no leading
    ],
    "renewals keep the lease": [
        (0, "won", (1,), None),
        (200, "renewed", (2,), None),
        (400, "renewed", (3,), None),
        (1099, "check", (), True),
        (1100, "check", (), False),
    ],
    "a late renewal ack never shortens the lease": [
        (0, "won", (1,), None),
        (500, "renewed", (2,), None),
        (100, "renewed", (3,), None),  # sent earlier, acknowledged later
        (1199, "check", (), True),
    ],
    # The leader stalled past its lease; nobody took the key (the late renewal's compare-and-set
    # found our revision): it leads on from the late renewal.
    "a late renewal that still finds our revision leads on": [
        (0, "won", (1,), None),
        (800, "check", (), False),
        (800, "renewed", (2,), None),
        (800, "check", (), True),
        (1499, "check", (), True),
        (1500, "check", (), False),
    ],
    "standby waits ttl of its own clock on one revision": [
        (0, "observe", (7, True), False),
        (400, "observe", (7, True), False),
        (999, "observe", (7, True), False),
        (1000, "observe", (7, True), True),
    ],
    "every renewal seen restarts the standby's wait": [
        (0, "observe", (7, True), False),
        (900, "observe", (8, True), False),
        (1800, "observe", (8, True), False),
        (1900, "observe", (8, True), True),
    ],
    "a released key is taken at once": [
        (0, "observe", (7, True), False),
        (10, "observe", (8, False), True),
    ],
    "lost race: watch the winner's revision anew": [
        (0, "observe", (7, True), False),
        (1000, "observe", (7, True), True),
        (1001, "lost_race", (), None),
        (1002, "observe", (7, True), False),  # the winner's renewal may not be visible yet
        (1010, "observe", (9, True), False),
        (2009, "observe", (9, True), False),
        (2010, "observe", (9, True), True),
    ],
    "the old leader stops before the standby may take over": [
        # leader renews at 0 (sent), the standby first sees that revision at 3, then it dies
        (0, "won", (4,), None),
        (3, "observe_other", (4, True), False),
        (699, "check", (), True),
        (700, "check", (), False),
        (1002, "observe_other", (4, True), False),
        (1003, "observe_other", (4, True), True),  # 303 ms after the old leader stopped
    ],
    "a fenced write steps down; the own stale key is waited out like any other": [
        (0, "won", (1,), None),
        (100, "step_down", ("write_fenced",), None),
        (100, "check", (), False),
        (150, "observe", (1, True), False),
        (1150, "observe", (1, True), True),
    ],
    "a leader does not observe": [
        (0, "won", (1,), None),
        (5000, "observe", (1, True), False),
    ],
}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_leadership(steps):
    lead, other = Leadership(CFG), Leadership(CFG)
    for t, op, args, expect in steps:
        if op == "check":
            got = lead.is_leading(t)
        elif op == "observe_other":
            got = other.observe(*args, t)
        elif op in ("observe", "won", "renewed"):
            got = getattr(lead, op)(*args, t)
        else:
            got = getattr(lead, op)(*args)
        assert got == expect, (t, op, args)
    lead.step_down("test_end")
    assert lead.role == "standby" and not lead.is_leading(10**9)


def test_counters_name_wins_and_why_leadership_ended():
    lead = Leadership(CFG)
    lead.won(1, 0)
    lead.step_down("lease_expired")
    lead.step_down("lease_expired")  # already a standby: not counted again
    lead.won(3, 2000)
    lead.step_down("key_taken")
    assert dict(lead.counters) == {"won": 2, "lost.lease_expired": 1, "lost.key_taken": 1}


@pytest.mark.parametrize("config, message", [
    (LeadershipConfig(ttl_ms=600, renew_ms=200, margin_ms=300), "must leave room for two renewals"),
    (LeadershipConfig(renew_ms=0), "--leader-renew-ms must be >= 1"),
    (LeadershipConfig(margin_ms=-1), "--leader-margin-ms must be >= 0"),
])
def test_bad_timing_names_the_flag(config, message):
    with pytest.raises(ValueError, match=message):
        Leadership(config)


def test_standby_learns_nodes_and_a_lost_leader_keeps_only_them():
    core = CoordinatorCore()
    core.observe_node(hb(node="n1", free=(0, 1)), 0)
    assert core.free_slots("n1") == [0, 1] and core.leases == {} and core.queue == []
    core.restore([], [], 40, 10)
    claim = ClaimRequest(request_id="r1", model="m", num_prompt_tokens=4, max_tokens=4,
                         transports=["mooncake"])
    effects = core.on_claim(claim, "inbox.r1", 20)
    assert core.leases and core.next_generation == 41 and effects
    core.drop_state()
    assert core.leases == {} and core.queue == [] and core.next_generation == 1
    assert core.free_slots("n1") == [0, 1]  # the nodes are still known
