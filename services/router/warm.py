"""Warm leases: a granted claim held ready per model, so that an express request skips the claim's
round trip to the coordinator (docs/design/warm-leases.md says why this and not another way).

Contract (``WarmLeases``):
- ``take(model, num_tokens, now_ms, is_current=None)``: a held grant for ``model`` whose slot holds
  ``num_tokens`` (prompt + output), whose transfer deadline is at least half its lifetime away and,
  with ``is_current``, whose node still receives where the grant says (a grant on a node that
  restarted since is left for ``stale`` to release, never handed out: its prefill's write would
  fail), or None. The grant's request id becomes the id of the request's first leg.
- ``wanted(model, free_slots)``: how many warm claims to send now: up to ``size`` held (or in
  flight) per model, and only while each leaves ``RESERVE`` of ``free_slots`` unheld, so that a
  warm lease does not take the last free slot a claim would have queued for. ``free_slots``: the
  nodes' free slots by their heartbeats, less the slots the router's open legs hold (a node beats
  only every so often); held warm leases still count in it (their nodes have not heard of them).
- ``add(model, grant, now_ms)``: a warm claim was granted; ``aged(now_ms)``: held grants past half
  their lifetime, removed (the caller cancels them before any prefill: they hold no KV);
  ``stale(is_current)``: held grants whose node is gone or came back as a new process (another
  transfer endpoint), removed likewise.
- ``held_ids()``: the request ids of every held grant (health, leak checks).

Pure: the router's loop (``services.router.app``) sends the claims and the cancels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.events import ClaimGranted

RESERVE = 1  # free slots (node table) a warm claim must leave unheld


@dataclass
class _Held:
    grant: ClaimGranted
    received_ms: int

    def fresh(self, now_ms: int) -> bool:
        lifetime = max(self.grant.expires_at_ms - self.received_ms, 0)
        return self.grant.expires_at_ms - now_ms >= lifetime / 2


@dataclass
class WarmLeases:
    size: int = 1  # held grants per model; 0: off
    held: dict[str, list[_Held]] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # claims in flight per model

    def take(self, model: str, num_tokens: int, now_ms: int,
             is_current: Callable[[ClaimGranted], bool] | None = None) -> ClaimGranted | None:
        for i, h in enumerate(self.held.get(model, [])):
            if (h.fresh(now_ms) and num_tokens <= h.grant.target.layout.max_tokens
                    and (is_current is None or is_current(h.grant))):
                return self.held[model].pop(i).grant
        return None

    def wanted(self, model: str, free_slots: int) -> int:
        have = len(self.held.get(model, [])) + self.pending.get(model, 0)
        # the node table counts held slots as free: their nodes have not heard of them yet
        return max(0, min(self.size - have, free_slots - have - RESERVE))

    def claiming(self, model: str, n: int = 1) -> None:
        self.pending[model] = self.pending.get(model, 0) + n

    def claimed(self, model: str) -> None:
        self.pending[model] = max(0, self.pending.get(model, 0) - 1)

    def add(self, model: str, grant: ClaimGranted, now_ms: int) -> None:
        self.held.setdefault(model, []).append(_Held(grant, now_ms))

    def aged(self, now_ms: int) -> list[ClaimGranted]:
        return self._remove(lambda h: not h.fresh(now_ms))

    def stale(self, is_current: Callable[[ClaimGranted], bool]) -> list[ClaimGranted]:
        return self._remove(lambda h: not is_current(h.grant))

    def _remove(self, doomed: Callable[[_Held], bool]) -> list[ClaimGranted]:
        """The held grants ``doomed`` picks, removed."""
        out = []
        for model, held in self.held.items():
            out += [h.grant for h in held if doomed(h)]
            self.held[model] = [h for h in held if not doomed(h)]
        return out

    def drain(self) -> list[ClaimGranted]:
        """Every held grant, removed (the router is stopping)."""
        out = [h.grant for held in self.held.values() for h in held]
        self.held.clear()
        return out

    def held_ids(self) -> list[str]:
        return sorted(h.grant.request_id for held in self.held.values() for h in held)
