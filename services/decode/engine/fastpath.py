"""The engine's side of the fast CUDA decode path (services/decode/engine/cuda): when it applies, and
one batch-1 decoder + CUDA graph per slot.

Contract:
- ``engine_reason(mode, model, device, dtype, num_speculative_tokens)``: why this engine cannot run
  the fast path (``None``: it can). The fast path runs greedy batch-1 steps of bfloat16 Llama-family
  models with plain blocks (no qkv/o bias, no q/k norm) on CUDA; on CPU only when asked for with
  ``mode="on"`` while Triton's interpreter is active (tests).
- ``request_reason(greedy, num_spec)``: why a request cannot (``None``: it can).
- ``FastPath.step(slot, slot_state, max_seq_len)``: one engine step of a lone active greedy slot.
- ``FastPath.prepare(slot, token, pos)`` builds a slot's decoder and graph (the engine calls it first,
  so that under ``auto`` a build or capture failure turns the fast path off instead of failing the
  request); ``FastPath.decode(slot, token, pos, n)``: ``n`` greedy tokens after ``token`` at position ``pos``
  (their K/V land in the slot's cache at ``pos .. pos + n - 1``): ``n`` graph replays, then one host
  copy of the ``n`` tokens. The decoder keeps its device state between calls while the caller's
  ``(token, pos)`` continue where it stopped; anything else (a reference step in between, a new
  request) re-arms it from ``(token, pos)``. The first call for a slot builds its decoder over the
  engine's weights and the slot's cache views (no copies) and captures its graph with one warm-up
  step at ``pos``: the engine does it for every slot at load with ``pos`` 0 of the still empty
  slot (later, ``pos`` is the position the first real step writes anyway).
"""

from __future__ import annotations

import logging
import os

import torch

from .slots import SlotState, emit

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


def _interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (tests)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def engine_reason(mode: str, model, device: torch.device, dtype: torch.dtype, num_speculative_tokens: int) -> str | None:
    """Why the engine cannot decode on the fast path; None when it can (mode "off" always has a reason)."""
    if mode not in MODES:
        raise ValueError(f"fast_path must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return "fast_path='off'"
    cfg = model.cfg
    if getattr(model, "family", "") != "gqa":
        return f"{cfg.model_type}: the engine drives the fast path for Llama-family (GQA) models only"
    if num_speculative_tokens:
        return "speculative decoding: the fast path decodes one token per step"
    for blk in model.layers:
        if blk.bqkv is not None or blk.bo is not None:
            return f"{cfg.model_type}: attention biases (qkv/o) are not on the fast path"
        if blk.q_norm is not None:
            return f"{cfg.model_type}: q/k norm is not on the fast path"
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')}: the fast path runs bfloat16 only"
    if device.type != "cuda" and not (device.type == "cpu" and mode == "on" and _interpreting()):
        return (f"device {device.type}: the fast path's Triton kernels need CUDA "
                "(on CPU only with fast_path='on' under TRITON_INTERPRET, for tests)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def request_reason(greedy: bool, num_spec: int) -> str | None:
    """Why a request decodes on the reference path; None when the fast path can serve it."""
    if not greedy:
        return "sampling (temperature > 0): the fast path decodes greedy requests only"
    if num_spec:
        return "speculative decoding requested: the fast path decodes one token per step"
    return None


class FastPath:
    """Per-slot fast decoders over one engine model, built on first use and kept for the slot."""

    def __init__(self, model, device: torch.device, options=None, tokens_per_step: int = 1, max_steps: int = 256):
        if tokens_per_step < 1:
            raise ValueError(f"fast_path_tokens_per_step must be >= 1, got {tokens_per_step}")
        self.model, self.device, self.options = model, device, options
        self.tokens_per_step = tokens_per_step
        self.max_steps = max(max_steps, tokens_per_step)  # out_tokens rows; re-armed when full
        self.decoders: dict[int, tuple] = {}  # slot -> (GqaDecoder, GraphRunner)
        self.held: dict[int, tuple[int, int, int]] = {}  # slot -> (token, pos, step_idx) on device

    def prepare(self, slot: int, token: int, pos: int):
        """The slot's (decoder, runner), built and captured on first use (errors propagate)."""
        if slot not in self.decoders:
            from .cuda import GraphRunner
            from .cuda.adapter import gqa_decoder_from_engine

            dec = gqa_decoder_from_engine(self.model, slot, self.options, self.max_steps)
            dec.set_state(token, pos)
            runner = GraphRunner(dec.step, self.device, warmup_calls=1,
                                 before_capture=lambda: dec.set_state(token, pos))
            self.decoders[slot] = (dec, runner)
            self.held[slot] = (token, pos, 0)
        return self.decoders[slot]

    def decode(self, slot: int, token: int, pos: int, n: int) -> list[int]:
        """``n`` >= 1 greedy tokens following ``token`` (at ``pos``); one host sync."""
        dec, runner = self.prepare(slot, token, pos)
        held = self.held.get(slot)
        if held is not None and held[:2] == (token, pos) and held[2] + n <= self.max_steps:
            idx = held[2]
        else:
            dec.set_state(token, pos)
            idx = 0
        for _ in range(n):
            runner.replay()
        out = dec.out_tokens[idx : idx + n].tolist()  # the one sync
        self.held[slot] = (out[-1], pos + n, idx + n)
        return out

    def step(self, slot: int, s: SlotState, max_seq_len: int) -> tuple[list[int], str | None]:
        """One engine step of an active slot: up to tokens_per_step greedy tokens, never past its
        max_tokens or max_seq_len (so cache writes stay inside the slot), cut at stop ids by
        slots.emit as the reference step cuts them; (emitted tokens, finish reason)."""
        room = min(s.max_tokens - s.num_generated, max_seq_len - 1 - s.seq_len)
        n = min(self.tokens_per_step, room)
        tokens = self.decode(slot, s.pending, s.seq_len, n) if n > 0 else []
        s.num_steps += max(n, 1)
        out, reason = emit(s, tokens, max_seq_len)
        if reason is not None:
            s.state = "done"
        return out, reason

    def forget(self, slot: int) -> None:
        """The slot starts another request: re-arm its decoder at the next decode."""
        self.held.pop(slot, None)


def setup(mode: str, model, device: torch.device, dtype: torch.dtype, num_speculative_tokens: int,
          options=None, tokens_per_step: int = 1) -> tuple[FastPath | None, str | None]:
    """(FastPath or None, reason it is off). Mode "on" raises ValueError where "auto" logs the reason."""
    reason = engine_reason(mode, model, device, dtype, num_speculative_tokens)
    if reason is None:
        return FastPath(model, device, options, tokens_per_step), None
    if mode == "on":
        raise ValueError(f"fast_path='on' cannot run this engine: {reason}; use fast_path='auto' or 'off'")
    if mode == "auto":
        log.info("decode fast path off, reference step in use: %s", reason)
    return None, reason
