"""Every NATS subject of expresslane, defined once.

All subjects live under the root ``xl.``. Nothing else in the project spells a subject literally:
services build them with the functions below and subscribe with the wildcards below.

| subject                              | direction                     | messages (see shared.events)       |
| ------------------------------------ | ----------------------------- | ---------------------------------- |
| xl.coord.claim                       | router -> coordinator (req)   | ClaimRequest -> ClaimReply         |
| xl.coord.report                      | decode -> coordinator         | DecodeStarted, SlotReleased        |
| xl.node.<node>.avail                 | decode -> all (heartbeat)     | NodeAvailable, NodeDraining        |
| xl.kv.ready.<node>                   | prefill sender -> decode/coord| KvReady, KvFailed                  |
| xl.decode.<node>.start               | router -> decode              | DecodeStart                        |
| xl.decode.<node>.ended               | coordinator -> decode         | HandoffEvent (a lease of that node |
|                                      |                               | ended: failed/cancelled/completed) |
| xl.req.<request_id>.tokens           | decode -> router              | TokensGenerated, RequestFinished,  |
|                                      |                               | RequestFailed                      |
| xl.req.<request_id>.cancel           | router -> decode/coordinator  | CancelRequest                      |
| xl.handoff.<request_id>.<state>      | coordinator -> anyone         | HandoffEvent                       |
"""

from __future__ import annotations

ROOT = "xl"
ALL = f"{ROOT}.>"

CLAIM = f"{ROOT}.coord.claim"
COORD_REPORT = f"{ROOT}.coord.report"

NODE_AVAIL_ALL = f"{ROOT}.node.*.avail"
KV_READY_ALL = f"{ROOT}.kv.ready.*"
DECODE_START_ALL = f"{ROOT}.decode.*.start"
DECODE_LEASE_ENDED_ALL = f"{ROOT}.decode.*.ended"
REQ_TOKENS_ALL = f"{ROOT}.req.*.tokens"
REQ_CANCEL_ALL = f"{ROOT}.req.*.cancel"
HANDOFF_ALL = f"{ROOT}.handoff.>"

# JetStream key-value bucket holding the coordinator's leases and queue.
COORD_KV_BUCKET = "xl_coord"


def _token(value: str, what: str) -> str:
    """Refuse values that would change a subject's shape (dots, wildcards, spaces)."""
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(
            f"{what} {value!r} cannot be used in a NATS subject: "
            "use letters, digits, '-' and '_' only"
        )
    return value


def node_avail(node_id: str) -> str:
    return f"{ROOT}.node.{_token(node_id, 'node id')}.avail"


def kv_ready(node_id: str) -> str:
    return f"{ROOT}.kv.ready.{_token(node_id, 'node id')}"


def decode_start(node_id: str) -> str:
    return f"{ROOT}.decode.{_token(node_id, 'node id')}.start"


def decode_lease_ended(node_id: str) -> str:
    """Where the coordinator tells one decode node that a lease of its ended."""
    return f"{ROOT}.decode.{_token(node_id, 'node id')}.ended"


def req_tokens(request_id: str) -> str:
    return f"{ROOT}.req.{_token(request_id, 'request id')}.tokens"


def req_cancel(request_id: str) -> str:
    return f"{ROOT}.req.{_token(request_id, 'request id')}.cancel"


def handoff(request_id: str, state: str) -> str:
    return f"{ROOT}.handoff.{_token(request_id, 'request id')}.{_token(state, 'state')}"


def handoff_all(request_id: str) -> str:
    return f"{ROOT}.handoff.{_token(request_id, 'request id')}.*"
