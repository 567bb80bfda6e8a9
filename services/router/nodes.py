"""The router's view of live decode nodes, from their heartbeats (``NodeAvailable``, ``NodeDraining``).

Contract (``NodeTable``):
- ``observe(event, now_s)`` records a heartbeat or a drain notice (older ``seq`` ignored).
- A node is live while its last heartbeat is younger than ``ttl_factor`` heartbeat intervals and it
  has not announced draining; a later heartbeat revives a draining node.
- ``slot_capacity(aliases, now_s)``: the most tokens one slot of a live node serving the model holds
  (``None`` when no live node serves it): the policy's availability input. The coordinator, not the
  router, picks the node; the router only needs to know whether the express lane is open.
  ``free_slots(aliases, now_s)``: their free (node, slot) pairs by the last heartbeats (warm
  leases' input). ``describe(now_s)``: each node heard of, live or not, and its endpoints (/health).
- A node serves a model when ``shared.models.serves`` says so: the coordinator matches claims the
  same way.

Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shared.events import NodeAvailable, NodeDraining, TransferTarget
from shared.models import serves


@dataclass
class _Node:
    last: NodeAvailable
    seen_s: float
    draining: bool = False


class NodeTable:
    def __init__(self, ttl_factor: float = 3.0) -> None:
        self._nodes: dict[str, _Node] = {}
        self._ttl_factor = ttl_factor

    def observe(self, event: NodeAvailable | NodeDraining, now_s: float) -> None:
        """Record one heartbeat or drain notice."""
        node = self._nodes.get(event.node_id)
        if isinstance(event, NodeDraining):
            if node is not None:
                node.draining = True
            return
        if node is not None and event.seq < node.last.seq and event.sent_at_ms <= node.last.sent_at_ms:
            return  # an older heartbeat overtaken by a newer one
        self._nodes[event.node_id] = _Node(last=event, seen_s=now_s)

    def _is_live(self, node: _Node, now_s: float) -> bool:
        ttl_s = self._ttl_factor * max(node.last.heartbeat_interval_ms, 1) / 1000.0
        return not node.draining and now_s - node.seen_s <= ttl_s

    def live(self, now_s: float, aliases: Collection[str] | None = None) -> list[NodeAvailable]:
        """Heartbeats of the live nodes (serving a model named by ``aliases`` when given)."""
        return [
            n.last
            for _, n in sorted(self._nodes.items())
            if self._is_live(n, now_s) and (aliases is None or serves(n.last.model, aliases))
        ]

    def slot_capacity(self, aliases: Collection[str], now_s: float) -> int | None:
        """Tokens one slot of a live node serving the model holds; None when none is live."""
        nodes = self.live(now_s, aliases)
        return max((n.capacity_tokens for n in nodes), default=None)

    def smallest_slot_capacity(self, aliases: Collection[str], now_s: float) -> int | None:
        """Tokens the smallest slot among the live nodes serving the model holds; None when none is live."""
        return min((n.capacity_tokens for n in self.live(now_s, aliases)), default=None)

    def serves_target(self, target: TransferTarget, now_s: float) -> bool:
        """Whether the target's node is live and still receives there (endpoint and slot buffer):
        a restarted node process registers other ones."""
        node = self._nodes.get(target.node_id)
        return (node is not None and self._is_live(node, now_s)
                and node.last.endpoints.get(target.transport) == target.endpoint
                and target.slot in node.last.slots)

    def describe(self, now_s: float) -> dict[str, dict]:
        """Each node heard of as /health shows it: live or not, its model, the endpoints its last heartbeat
        gave (a restarted node process registers other ones: a restart is over, for the router, once they
        show)."""
        return {node_id: {"live": self._is_live(n, now_s), "model": n.last.model, "endpoints": dict(n.last.endpoints)}
                for node_id, n in sorted(self._nodes.items())}

    def free_slots(self, aliases: Collection[str], now_s: float) -> set[tuple[str, int]]:
        """(node, slot) of the free slots of the live nodes serving the model, as their last
        heartbeats say."""
        return {(n.node_id, i) for n in self.live(now_s, aliases) for i in n.free_slots}

    def models(self, now_s: float) -> set[str]:
        return {n.model for n in self.live(now_s)}

    def forget_stale(self, now_s: float, keep_s: float = 300.0) -> None:
        """Drop nodes not heard from for ``keep_s``."""
        for node_id, n in list(self._nodes.items()):
            if now_s - n.seen_s > keep_s:
                del self._nodes[node_id]
