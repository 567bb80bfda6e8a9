"""Scheduler side of the connector: which requests are ours, when their prompt is computed, which
staging slot they get. Pure bookkeeping (no torch, no vLLM, no I/O).

- A request is claimed at its first allocation when its ``kv_transfer_params`` carry the
  express-lane key (the contract: shared.handoff); every other request is ignored entirely (no
  state, no metadata), so the connector composes under MultiConnector.
- Block ids are followed step by step (chunked prefill appends blocks; a request resumed after
  preemption gets its whole block table again).
- The step in which ``num_computed + num_scheduled`` reaches the prompt length is the step whose
  forward writes the last prompt KV: the scheduler then reserves a staging slot and emits one
  ``SaveRequest`` for the worker. No free slot (or a prompt longer than a slot): a ``SaveRequest``
  with ``fail_reason`` instead, so the worker reports KV-failed, and ``request_finished`` says
  ``handed_off: false``; nothing blocks, nothing is overwritten. A prefill that cannot hand over
  at all (``refusal``: its KV heads do not split over its tensor-parallel ranks) fails every
  claim so, with that reason.
- ``on_first_token`` (before ``on_finished``, for a request vLLM finished with its one token):
  when the hand-off carries ``start``, what to publish at once: ``PrefillToken`` to the router,
  then ``DecodeStart`` to the node, unless vLLM stopped on the token (the router ends the lease) or
  the KV was not staged (the worker reports KV-failed and the router migrates). An aborted request
  gives nothing.
- ``on_finished`` forgets the request and returns its status dict; vLLM frees its blocks at once
  (the KV, if handed off, is already staged).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import msgspec

from shared import subjects
from shared.events import DecodeStart, Event, PrefillToken
from shared.handoff import Handoff, HandoffStatus, is_marked, parse_request, status_params


class Slots(Protocol):
    def reserve(self) -> int | None: ...

    def count(self, counter: str, n: int = 1) -> None: ...


@dataclasses.dataclass
class SaveRequest:
    """Scheduler -> worker: stage (or report failure of) one claimed request."""

    request_id: str
    handoff: Handoff | None
    block_ids: list[list[int]]  # per KV cache group
    num_tokens: int
    staging_slot: int = -1
    fail_reason: str = ""


@dataclasses.dataclass
class Claim:
    request_id: str
    handoff: Handoff | None
    num_prompt_tokens: int
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    is_saved: bool = False
    staging_slot: int = -1
    reason: str = ""


class ExpressScheduler:
    """Claims, block tracking and slot reservation for the express lane."""

    def __init__(self, slots: Slots, max_tokens: int, refusal: str = "") -> None:
        self.slots = slots
        self.max_tokens = max_tokens
        self.refusal = refusal  # set: no request is handed off, for this reason
        self.claims: dict[str, Claim] = {}
        self._pending_failures: list[SaveRequest] = []

    def on_alloc(self, request_id: str, kv_transfer_params, num_prompt_tokens: int) -> None:
        """First allocation of any request: claim it when it is marked, else do nothing."""
        if request_id in self.claims or not is_marked(kv_transfer_params):
            return
        try:
            handoff, reason = parse_request(kv_transfer_params), ""
        except (msgspec.ValidationError, TypeError) as exc:
            handoff, reason = None, f"invalid expresslane kv_transfer_params: {exc}"
        self.claims[request_id] = Claim(request_id, handoff, num_prompt_tokens, reason=reason)
        self.slots.count("claimed")

    def on_step(
        self,
        new_reqs: Iterable[tuple[str, tuple[list[int], ...], int]],
        cached_reqs: Iterable[tuple[str, tuple[list[int], ...] | None, int, bool]],
        num_scheduled: dict[str, int],
    ) -> list[SaveRequest]:
        """One scheduler step: (req_id, block_ids, num_computed) of new requests, (req_id,
        new_block_ids, num_computed, resumed) of running ones -> what the worker saves now."""
        saves, self._pending_failures = self._pending_failures, []
        for req_id, block_ids, num_computed in new_reqs:
            claim = self.claims.get(req_id)
            if claim is not None:
                claim.block_ids = [list(g) for g in block_ids]
                self._maybe_save(claim, num_computed + num_scheduled.get(req_id, 0), saves)
        for req_id, new_block_ids, num_computed, resumed in cached_reqs:
            claim = self.claims.get(req_id)
            if claim is None:
                continue
            if new_block_ids is not None:
                if resumed or not claim.block_ids:
                    claim.block_ids = [list(g) for g in new_block_ids]
                else:
                    for group, extra in zip(claim.block_ids, new_block_ids):
                        group.extend(extra)
            self._maybe_save(claim, num_computed + num_scheduled.get(req_id, 0), saves)
        return saves

    def _maybe_save(self, claim: Claim, num_computed: int, saves: list[SaveRequest]) -> None:
        if claim.is_saved or claim.reason or num_computed < claim.num_prompt_tokens:
            return
        claim.is_saved = True
        n = claim.num_prompt_tokens
        if self.refusal:
            claim.reason = self.refusal
        elif n > self.max_tokens:
            claim.reason = (f"prompt of {n} tokens exceeds the staging slot size of "
                            f"{self.max_tokens} tokens (staging_max_tokens)")
        else:
            slot = self.slots.reserve()
            if slot is None:
                claim.reason = "no free staging slot"
            else:
                claim.staging_slot = slot
        saves.append(SaveRequest(claim.request_id, claim.handoff, claim.block_ids, n,
                                 claim.staging_slot, claim.reason))

    def on_first_token(self, request_id: str, output_token_ids: list[int], finish_reason: str | None,
                       prompt_token_ids: list[int]) -> list[tuple[str, Event, str]]:
        """(subject, event, traceparent) to publish now for a request vLLM just finished;
        ``finish_reason`` "stop" or "length" (anything else, e.g. an abort: nothing)."""
        claim = self.claims.get(request_id)
        h = claim.handoff if claim is not None else None
        if h is None or h.start is None or finish_reason not in ("stop", "length") or len(output_token_ids) != 1:
            return []
        token = output_token_ids[0]
        out: list[tuple[str, Event, str]] = [(subjects.req_tokens(h.request_id), PrefillToken(
            request_id=h.request_id, token_id=token, finish_reason=finish_reason,
            prompt_token_ids=list(prompt_token_ids)), h.traceparent)]
        if finish_reason == "length" and claim.staging_slot >= 0 and h.start.max_tokens > 0:
            sampling = h.start
            if sampling.repetition_penalty != 1.0 and sampling.prompt_token_ids is None:
                sampling = msgspec.structs.replace(sampling, prompt_token_ids=list(prompt_token_ids))
            if sampling.structured is not None:  # a reasoning gate's state at the prompt (StructuredOutput)
                sampling = msgspec.structs.replace(sampling,
                                                   structured=sampling.structured.with_prompt(prompt_token_ids))
            out.append((subjects.decode_start(h.target.node_id), DecodeStart(
                request_id=h.request_id, lease_id=h.lease_id, generation=h.generation,
                slot=h.target.slot.slot, first_token_id=token, num_prompt_tokens=claim.num_prompt_tokens,
                sampling=sampling), h.traceparent))
            self.slots.count("decode_started")
        return out

    def on_finished(self, request_id: str) -> dict | None:
        """Forget the request; the status dict for its response (None when it is not ours)."""
        claim = self.claims.pop(request_id, None)
        if claim is None:
            return None
        if not claim.is_saved and not claim.reason:
            claim.reason = "request finished before its prompt was computed"
            if claim.handoff is not None:  # tell the decode side at the next step
                self._pending_failures.append(
                    SaveRequest(request_id, claim.handoff, [], 0, -1, claim.reason))
        handed_off = claim.staging_slot >= 0
        if not handed_off:
            self.slots.count("not_handed_off")
        express_id = claim.handoff.request_id if claim.handoff is not None else request_id
        status = HandoffStatus(request_id=express_id, handed_off=handed_off,
                               num_tokens=claim.num_prompt_tokens if handed_off else 0,
                               staging_slot=claim.staging_slot, reason=claim.reason)
        return status_params(status)

    @property
    def has_work(self) -> bool:
        """Whether a step may produce metadata (claims in progress or failures to report)."""
        return bool(self.claims or self._pending_failures)

    def has_claim(self, request_id: str) -> bool:
        return request_id in self.claims

    @property
    def num_claims(self) -> int:
        return len(self.claims)
