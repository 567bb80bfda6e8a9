"""Lane policy: which lane serves one request, and why.

Contract (``choose_lane``), in this order:
1. Wish: the ``x-expresslane: on|off`` header (when ``header_override`` is allowed), else the
   tenant's lane, else the model's lane, else ``default_lane``. Any other header value is a 400.
2. A wish for ``standard`` is final.
3. Capability gate: parameters the express lane cannot honour (``blockers``) send the request to
   the standard lane (``capability_gate="standard"``) or refuse it with a 400 naming them
   (``"reject"``); never ignored.
4. Availability: no live decode node serving the model, a prompt plus ``max_tokens`` that does not
   fit a decode slot, or ``max_tokens == 1`` (nothing left to decode) -> standard lane.

Pure: no I/O; the caller gathers the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.router.errors import bad_request

Lane = Literal["express", "standard"]
LANES = ("express", "standard")
HEADER = "x-expresslane"
_HEADER_VALUES = {"on": "express", "off": "standard", "express": "express", "standard": "standard"}


@dataclass(frozen=True)
class PolicyConfig:
    default_lane: Lane = "express"
    tenant_lanes: dict[str, Lane] = field(default_factory=dict)
    model_lanes: dict[str, Lane] = field(default_factory=dict)
    header_override: bool = True
    capability_gate: Literal["standard", "reject"] = "standard"

    def validate(self) -> "PolicyConfig":
        """Raise ValueError naming the bad entry."""
        if self.default_lane not in LANES:
            raise ValueError(f"default lane {self.default_lane!r} is not one of {LANES}")
        for what, table in (("tenant", self.tenant_lanes), ("model", self.model_lanes)):
            for key, lane in table.items():
                if lane not in LANES:
                    raise ValueError(f"{what} {key!r}: lane {lane!r} is not one of {LANES}")
        if self.capability_gate not in ("standard", "reject"):
            raise ValueError(f"capability gate {self.capability_gate!r} is not standard|reject")
        return self


@dataclass(frozen=True)
class LaneInputs:
    model: str
    tenant: str = ""
    header: str | None = None  # raw x-expresslane header value
    blockers: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: up to the context limit
    num_prompt_tokens: int = 0
    slot_capacity: int | None = None  # tokens a live node's slot holds for this model; None: no node


@dataclass(frozen=True)
class LaneDecision:
    lane: Lane
    reason: str


def parse_lane_table(text: str) -> dict[str, Lane]:
    """``"a=express,b=standard"`` -> dict; raises ValueError on a malformed entry."""
    table: dict[str, Lane] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, lane = item.partition("=")
        if not sep or not key.strip() or lane.strip() not in LANES:
            raise ValueError(f"bad lane entry {item!r}: expected NAME=express|standard")
        table[key.strip()] = lane.strip()  # type: ignore[assignment]
    return table


def _wish(cfg: PolicyConfig, inp: LaneInputs) -> tuple[Lane, str]:
    if inp.header is not None and cfg.header_override:
        value = _HEADER_VALUES.get(inp.header.strip().lower())
        if value is None:
            raise bad_request(f"header {HEADER} must be 'on' or 'off', got {inp.header!r}", HEADER)
        return value, "header"  # type: ignore[return-value]
    if inp.tenant and inp.tenant in cfg.tenant_lanes:
        return cfg.tenant_lanes[inp.tenant], "tenant"
    if inp.model in cfg.model_lanes:
        return cfg.model_lanes[inp.model], "model"
    return cfg.default_lane, "default"


def choose_lane(cfg: PolicyConfig, inp: LaneInputs) -> LaneDecision:
    """Pick the lane for one request; raises ApiError (400) when the gate refuses it."""
    lane, why = _wish(cfg, inp)
    if lane == "standard":
        return LaneDecision("standard", why)
    if inp.blockers:
        names = ", ".join(inp.blockers)
        if cfg.capability_gate == "reject":
            raise bad_request(
                f"the express lane cannot honour: {names}; send the request with "
                f"'{HEADER}: off' or without these parameters",
                param=inp.blockers[0],
                code="unsupported_on_express_lane",
            )
        return LaneDecision("standard", f"unsupported: {names}")
    if inp.slot_capacity is None:
        return LaneDecision("standard", "no live decode node serves the model")
    if inp.max_tokens == 1:
        return LaneDecision("standard", "max_tokens=1: nothing to decode")
    if inp.num_prompt_tokens + (inp.max_tokens or 1) > inp.slot_capacity:
        return LaneDecision("standard", "does not fit a decode slot")
    return LaneDecision("express", why)
