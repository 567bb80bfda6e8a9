"""What the decode node's slot core (slots.py) asks its shell to do: effects, performed in order as
they come (bus messages, availability, the engine slot, the log and trace), and engine work, taken
between engine steps (start = inject + arm a slot, stop = cancel it)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.events import Event, SamplingParams, SlotReleased


@dataclass(frozen=True)
class Publish:
    """Publish on the bus; ``lease_id`` names the lease whose trace span it belongs to."""

    subject: str
    event: Event
    lease_id: str = ""


@dataclass(frozen=True)
class Heartbeat:
    """Republish availability now (a slot became busy or free); ``released``: the release that
    freed it, carried in the beat so the coordinator can free the slot without waiting for the
    report stream (the report still follows)."""

    released: SlotReleased | None = None


@dataclass(frozen=True)
class ReleaseEngine:
    slot: int


@dataclass(frozen=True)
class Finished:
    """A lease the engine held (or was about to) ended: for the log and the trace span."""

    slot: int
    lease_id: str
    request_id: str
    outcome: str
    reason: str
    finish_reason: str
    num_completion_tokens: int
    decode_ms: float


@dataclass(frozen=True)
class Forget:
    """The lease left the node: drop whatever the shell keeps for it (trace context, span)."""

    lease_id: str


Effect = Publish | Heartbeat | ReleaseEngine | Finished | Forget


@dataclass(frozen=True)
class StartEngine:
    """Adopt ``num_kv_tokens`` of KV already in the slot and arm it with its first token."""

    slot: int
    lease_id: str
    request_id: str
    num_kv_tokens: int
    first_token_id: int
    sampling: SamplingParams
    migration: int = 0  # DecodeStart.migration: 0 on a request's first leg


@dataclass(frozen=True)
class StopEngine:
    slot: int
    lease_id: str


EngineWork = StartEngine | StopEngine
