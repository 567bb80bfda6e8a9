"""The coordinator's view of decode nodes, rebuilt from heartbeats (pure, not persisted).

Contract:
- ``heartbeat(hb, now_ms)`` records a ``NodeAvailable``; returns True when the node restarted
  (its ``seq`` went backwards), so the caller fails its old leases first.
- A node is expired after ``heartbeat_misses`` intervals without a message (``postpone`` moves
  that back for time the coordinator did not listen: services.coordinator.core); a draining node gets
  no new lease; a node known only from restored leases (``info`` None) gets none either until it
  beats again.
- ``transport_for(node, claim)``: the transport to use when the node could ever serve the claim
  (the model by any of its names, matched as the router matches it: shared.models; protocol
  version, layout version, the KV cache dtype the prefill's vLLM keeps when the claim names it,
  room for prompt + max_tokens, a shared transport).
- ``free_slots(node_id, held)``: slots the node's last heartbeat lists free, that it advertises a
  buffer for, minus ``held`` (slots under a lease).
"""

from __future__ import annotations

from services.coordinator.model import CoordinatorConfig, Node
from shared.events import PROTOCOL_VERSION, ClaimRequest, NodeAvailable, NodeDraining
from shared.kvlayout import LAYOUT_VERSION, kv_cache_dtypes_pair
from shared.models import serves


class NodeRegistry:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.nodes: dict[str, Node] = {}

    def heartbeat(self, hb: NodeAvailable, now_ms: int) -> bool:
        """Record a heartbeat; True when it shows the node restarted."""
        node = self.nodes.get(hb.node_id)
        has_restarted = node is not None and node.info is not None and hb.seq < node.info.seq
        if node is None or has_restarted:
            node = self.nodes[hb.node_id] = Node(hb.node_id, hb, now_ms, hb.heartbeat_interval_ms)
        node.info, node.last_seen_ms = hb, now_ms
        node.interval_ms, node.is_draining = max(1, hb.heartbeat_interval_ms), False
        return has_restarted

    def draining(self, msg: NodeDraining, now_ms: int) -> None:
        node = self.nodes.get(msg.node_id)
        if node is not None:
            node.is_draining, node.last_seen_ms = True, now_ms

    def remember(self, node_id: str, now_ms: int) -> None:
        """A node named by a restored lease: seen now, details unknown until it beats."""
        if node_id not in self.nodes:
            self.nodes[node_id] = Node(node_id, None, now_ms, self.config.default_heartbeat_interval_ms)

    def touch(self, node_id: str, now_ms: int) -> None:
        """The node was heard from (a known node only: a new one registers by its heartbeat)."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.last_seen_ms = max(node.last_seen_ms, now_ms)

    def touch_all(self, now_ms: int) -> None:
        for node in self.nodes.values():
            node.last_seen_ms = max(node.last_seen_ms, now_ms)

    def postpone(self, unheard_since_ms: int, by_ms: int) -> list[str]:
        """Move the deadline of every node not heard from since ``unheard_since_ms`` back by
        ``by_ms``; returns their ids."""
        moved = [n for n in self.nodes.values() if n.last_seen_ms <= unheard_since_ms]
        for node in moved:
            node.last_seen_ms += by_ms
        return [n.node_id for n in moved]

    def expired(self, now_ms: int) -> list[Node]:
        limit = self.config.heartbeat_misses
        return [n for n in self.nodes.values() if now_ms - n.last_seen_ms > limit * n.interval_ms]

    def remove(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def transport_for(self, node: Node, claim: ClaimRequest) -> str | None:
        info = node.info
        if info is None or node.is_draining or node.node_id in claim.exclude_nodes:
            return None
        if not serves(info.model, {claim.model, *claim.model_aliases}):
            return None
        if info.protocol_version != PROTOCOL_VERSION or info.layout.layout_version != LAYOUT_VERSION:
            return None
        if claim.kv_cache_dtype and not kv_cache_dtypes_pair(claim.kv_cache_dtype, info.layout):
            return None
        if claim.num_prompt_tokens + claim.max_tokens > info.capacity_tokens:
            return None
        for transport in claim.transports:
            if transport in info.transports and transport in info.endpoints:
                return transport
        return None

    def free_slots(self, node_id: str, held: set[int]) -> list[int]:
        node = self.nodes.get(node_id)
        if node is None or node.info is None or node.is_draining:
            return []
        advertised = {s.slot for s in node.info.slots}
        return sorted(s for s in set(node.info.free_slots) if s in advertised and s not in held)
