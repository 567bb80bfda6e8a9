"""Which coordinator leads: a lease on one key of the coordinator's KV bucket (pure: no NATS, the
local monotonic clock is passed in as ``now_ms``).

Why a lease key and not a NATS queue group: a queue group picks *a* live subscriber per message,
but two subscribers are both live while one is paused or cut off, and nothing tells the other one
to stop; the coordinator's state (leases, waiting claims, generations) must have exactly one
writer. A key written only by compare-and-set on its revision gives one winner per revision, and
the same revision fences every state write (below), with no second bucket or permission.

Contract:
- ``LEADER_KEY`` holds the leader's id. Every write to it is a compare-and-set on the revision
  last seen (revision 0: the key never existed), so each revision has one writer.
- A leader renews every ``renew_ms``. It leads while ``now < sent_at + ttl_ms - margin_ms``, with
  ``sent_at`` the time it *sent* its last renewal that succeeded; past that it neither grants nor
  writes. It tries one more renewal (compare-and-set on its revision): if that succeeds nobody took
  over, and it leads on with its state; if not, or if it cannot reach NATS, it steps down.
- A standby polls the key every ``poll_ms``. It takes the lease (compare-and-set on the revision it
  saw) at once when the key is absent or deleted (a leader let go), or when the same revision has
  stood for ``ttl_ms`` of its own clock. It first saw that revision after the leader sent it, so the
  old leader stopped ``margin_ms`` before the takeover (with clock rates closer than margin/ttl).
- Every state write of a leader is conditional on the revision it last wrote to the key (the shell
  sends ``Nats-Expected-Last-Subject-Sequence`` for the key's subject): a leader that lost the key
  cannot write, even when it paused between its last check and its write.
- A leader that stops leading for any reason drops its state (the bucket and the next leader own
  it) and becomes a standby; it may lead again later, after restoring from the bucket.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

LEADER_KEY = "leader"
Role = Literal["standby", "leader"]


class NotLeading(RuntimeError):
    """This coordinator does not lead (any more): it must not grant, answer or write."""


@dataclass(frozen=True)
class LeadershipConfig:
    """The leader lease's timing (milliseconds)."""

    ttl_ms: int = 1000  # a standby takes over after the key stood still this long
    renew_ms: int = 200  # how often the leader renews
    margin_ms: int = 300  # the leader steps down this long before a standby may take over

    @property
    def poll_ms(self) -> int:
        """How often a standby reads the key."""
        return max(1, self.renew_ms // 2)

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.renew_ms < 1:
            raise ValueError(f"--leader-renew-ms must be >= 1, got {self.renew_ms}")
        if self.margin_ms < 0:
            raise ValueError(f"--leader-margin-ms must be >= 0, got {self.margin_ms}")
        if self.ttl_ms - self.margin_ms < 2 * self.renew_ms:
            raise ValueError(
                f"--leader-ttl-ms ({self.ttl_ms}) minus --leader-margin-ms ({self.margin_ms}) "
                f"must leave room for two renewals (2 x --leader-renew-ms = {2 * self.renew_ms})")


class Leadership:
    """This coordinator's side of the leader lease; the shell does the reads and writes."""

    def __init__(self, config: LeadershipConfig | None = None) -> None:
        self.config = config or LeadershipConfig()
        self.config.validate()
        self.role: Role = "standby"
        self.revision = 0  # leader: the key's revision we wrote; standby: the one we saw
        self.seen_since_ms: int | None = None  # standby: when ``revision`` was first seen
        self.valid_until_ms = 0  # leader: lead only before this
        self.counters: Counter[str] = Counter()

    def observe(self, revision: int, is_held: bool, now_ms: int) -> bool:
        """Standby: the key as just read (``is_held`` False: absent or deleted). True: try to take
        it now, by compare-and-set on ``revision``."""
        if self.role == "leader":
            return False
        if revision != self.revision or self.seen_since_ms is None:
            self.revision, self.seen_since_ms = revision, now_ms
        return not is_held or now_ms - self.seen_since_ms >= self.config.ttl_ms

    def won(self, revision: int, sent_at_ms: int) -> None:
        """Our compare-and-set on the key, sent at ``sent_at_ms``, succeeded: we lead."""
        self.role, self.revision, self.seen_since_ms = "leader", revision, None
        self.valid_until_ms = sent_at_ms + self.config.ttl_ms - self.config.margin_ms
        self.counters["won"] += 1

    def renewed(self, revision: int, sent_at_ms: int) -> None:
        """A renewal sent at ``sent_at_ms`` succeeded; also one sent late (past ``valid_until``):
        the key still had our revision, so nobody took over, and we lead on from there."""
        if self.role == "leader":
            self.revision = revision
            self.valid_until_ms = max(self.valid_until_ms,
                                      sent_at_ms + self.config.ttl_ms - self.config.margin_ms)

    def is_leading(self, now_ms: int) -> bool:
        """Whether we may grant and write now."""
        return self.role == "leader" and now_ms < self.valid_until_ms

    def step_down(self, reason: str) -> None:
        """Stop leading (lease expired, key taken, a fenced write); the state must be dropped."""
        if self.role == "leader":
            self.counters[f"lost.{reason}"] += 1
        self.role, self.seen_since_ms, self.valid_until_ms = "standby", None, 0

    def lost_race(self) -> None:
        """Standby: another coordinator's compare-and-set came first; watch its revision anew."""
        self.seen_since_ms = None
