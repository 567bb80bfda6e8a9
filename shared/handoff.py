"""Wire contract: the express hand-off inside vLLM's ``kv_transfer_params`` (msgspec only).

Router -> prefill vLLM (request): ``kv_transfer_params={"expresslane": Handoff}``, built with
:func:`request_params` from the claim's grant; the prefill connector claims exactly the requests
that carry the key (:func:`is_marked`) and reads them with :func:`parse_request`. Every other
request is not ours.

Prefill connector -> router (response): ``request_finished`` answers ``{"expresslane":
HandoffStatus}`` (:func:`status_params`), which vLLM returns in the non-streaming response's
``kv_transfer_params``; the router reads it with :func:`parse_status`. ``handed_off`` true means
the KV is staged and a KV-ready or KV-failed event follows; false means the router falls back now.

Both sides are plain JSON builtins on the wire (vLLM passes the dicts through untouched); new
fields get defaults, so an older reader keeps decoding (unknown fields are ignored).
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.events import ClaimGranted, SamplingParams, TransferTarget

KEY = "expresslane"


class Handoff(msgspec.Struct, kw_only=True):
    """What a claimed request carries to the prefill: the lease and where its KV goes."""

    request_id: str
    lease_id: str
    generation: int
    target: TransferTarget
    traceparent: str = ""
    # The lease's expiry (ms since the epoch, ClaimGranted.expires_at_ms); no write starts after
    # it or runs past it, so a writer never outlives the coordinator's fence. 0: no bound.
    expires_at_ms: int = 0
    # The decode node's sampling for the rest of the request (None: the router starts the decode
    # itself). With it the prefill starts the decode the moment its scheduler has the first token:
    # ``PrefillToken`` to the router, then ``DecodeStart`` (this sampling, the first token, the
    # prompt's length; ``prompt_token_ids`` filled in when ``repetition_penalty`` needs them) to the
    # node, unless vLLM stopped on that token or the KV was not handed off. A first leg only
    # (``DecodeStart.migration`` 0, nothing sent before it).
    start: SamplingParams | None = None

    @classmethod
    def from_grant(cls, grant: ClaimGranted, traceparent: str = "",
                   start: SamplingParams | None = None) -> "Handoff":
        """The hand-off of a granted claim (the router's side)."""
        return cls(request_id=grant.request_id, lease_id=grant.lease_id, generation=grant.generation,
                   target=grant.target, traceparent=traceparent, expires_at_ms=grant.expires_at_ms,
                   start=start)


class HandoffStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the prefill did with a claimed request's KV."""

    request_id: str
    handed_off: bool
    num_tokens: int = 0
    staging_slot: int = -1
    reason: str = ""


def is_marked(kv_transfer_params: Any) -> bool:
    """True when a request carries the express-lane key (the only requests the connector touches)."""
    return isinstance(kv_transfer_params, dict) and KEY in kv_transfer_params


def request_params(handoff: Handoff) -> dict[str, Any]:
    """The ``kv_transfer_params`` a router sends for ``handoff``."""
    return {KEY: msgspec.to_builtins(handoff)}


def parse_request(kv_transfer_params: dict[str, Any]) -> Handoff:
    """The hand-off of a marked request; raises msgspec.ValidationError naming the bad field."""
    return msgspec.convert(kv_transfer_params[KEY], Handoff, strict=False)


def status_params(status: HandoffStatus) -> dict[str, Any]:
    """The ``kv_transfer_params`` the connector returns for a claimed request."""
    return {KEY: msgspec.to_builtins(status)}


def parse_status(kv_transfer_params: Any) -> HandoffStatus | None:
    """The status in a prefill response's ``kv_transfer_params``; None when it carries none.
    Raises msgspec.ValidationError naming the bad field."""
    if not is_marked(kv_transfer_params):
        return None
    return msgspec.convert(kv_transfer_params[KEY], HandoffStatus, strict=False)


def not_handed_off_reason(kv_transfer_params: Any) -> str:
    """Why the prefill kept the KV, from its response ("" when it handed it off or said nothing)."""
    try:
        status = parse_status(kv_transfer_params)
    except msgspec.ValidationError as exc:
        return f"unreadable hand-off status from the prefill: {exc}"
    if status is None or status.handed_off:
        return ""
    return status.reason or "the prefill did not hand the KV off"
