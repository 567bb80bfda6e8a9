"""What a claimed request carries and what the connector reports back (pure, msgspec only).

The router marks an express request with ``kv_transfer_params={"expresslane": {...}}``:
``request_id``, ``lease_id``, ``generation``, ``target`` (a shared.events.TransferTarget as JSON
builtins) and ``traceparent``. Every other request is not ours.

``request_finished`` answers with ``{"expresslane": HandoffStatus}`` (as builtins), which vLLM
returns in the non-streaming response's ``kv_transfer_params``: ``handed_off`` true means the KV is
staged and a KV-ready or KV-failed event will follow; false means the router must fall back now.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.events import TransferTarget

KEY = "expresslane"


class Handoff(msgspec.Struct, kw_only=True):
    request_id: str
    lease_id: str
    generation: int
    target: TransferTarget
    traceparent: str = ""
    # The lease's expiry (ms since the epoch, ClaimGranted.expires_at_ms); no write starts after
    # it or runs past it, so a writer never outlives the coordinator's fence. 0: no bound.
    expires_at_ms: int = 0


class HandoffStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    handed_off: bool
    num_tokens: int = 0
    staging_slot: int = -1
    reason: str = ""


def is_marked(kv_transfer_params: Any) -> bool:
    """True when a request carries the express-lane key (the only requests the connector touches)."""
    return isinstance(kv_transfer_params, dict) and KEY in kv_transfer_params


def parse_handoff(kv_transfer_params: dict) -> Handoff:
    """Decode the express-lane dict; raises msgspec.ValidationError with the offending field."""
    return msgspec.convert(kv_transfer_params[KEY], Handoff, strict=False)


def make_params(handoff: Handoff) -> dict:
    """The ``kv_transfer_params`` a router sends for ``handoff``."""
    return {KEY: msgspec.to_builtins(handoff)}


def status_params(status: HandoffStatus) -> dict:
    return {KEY: msgspec.to_builtins(status)}
