"""The coordinator's persisted state in a JetStream KV bucket.

Contract:
- Keys: ``lease.<lease_id>`` (a Lease as JSON), ``queue.<request_id>`` (a QueuedClaim),
  ``meta`` (``{"next_generation": N}``: no coordinator ever handed out a generation >= N).
- ``await store.load() -> (leases, queued, next_generation)``: everything readable; a record that
  cannot be decoded is logged and skipped (it must not keep the coordinator down).
- ``await store.write(effects)``: the persistence part of one batch of core effects: the last
  write per key wins, and all keys are written at once; returns when every write is acknowledged.
- Every call retries while NATS is away, for up to ``retry_s``, then raises.
- ``await store.compact(older_than_s)``: drop the delete markers ended leases leave behind.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from services.coordinator.model import (
    DeleteLease, DeleteQueued, Effect, Lease, PutLease, PutMeta, PutQueued, QueuedClaim,
)
from shared.log import get_logger


class StateStore:
    def __init__(self, kv: KeyValue, retry_s: float = 30.0) -> None:
        self.kv, self.retry_s = kv, retry_s
        self.log = get_logger("coordinator.store")

    async def load(self) -> tuple[list[Lease], list[QueuedClaim], int]:
        leases, queued, next_generation = [], [], 1
        try:
            keys = await self._retry(self.kv.keys)
        except nats.js.errors.NoKeysError:
            keys = []
        for key in keys:
            try:
                entry = await self._retry(self.kv.get, key)
            except nats.js.errors.KeyNotFoundError:
                continue
            try:
                if key.startswith("lease."):
                    leases.append(msgspec.json.decode(entry.value, type=Lease))
                elif key.startswith("queue."):
                    queued.append(msgspec.json.decode(entry.value, type=QueuedClaim))
                elif key == "meta":
                    next_generation = int(json.loads(entry.value)["next_generation"])
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError) as exc:
                self.log.error("state_record_unreadable", key=key, error=str(exc))
        return leases, queued, next_generation

    async def write(self, effects: list[Effect]) -> None:
        writes: dict[str, bytes | None] = {}  # key -> value, None: delete
        for e in effects:
            if isinstance(e, PutLease):
                writes[f"lease.{e.lease.lease_id}"] = msgspec.json.encode(e.lease)
            elif isinstance(e, DeleteLease):
                writes[f"lease.{e.lease_id}"] = None
            elif isinstance(e, PutQueued):
                writes[f"queue.{e.entry.claim.request_id}"] = msgspec.json.encode(e.entry)
            elif isinstance(e, DeleteQueued):
                writes[f"queue.{e.request_id}"] = None
            elif isinstance(e, PutMeta):
                writes["meta"] = json.dumps({"next_generation": e.next_generation}).encode()
        await asyncio.gather(*(
            self._retry(self.kv.put, key, value) if value is not None
            else self._retry(self.kv.delete, key) for key, value in writes.items()))

    async def compact(self, older_than_s: int) -> None:
        await self.kv.purge_deletes(olderthan=max(1, older_than_s))

    async def _retry(self, fn, *args):
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return await fn(*args)
            except (nats.js.errors.NoKeysError, nats.js.errors.KeyNotFoundError):
                raise
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
                if time.monotonic() > deadline:
                    self.log.error("state_write_failed", error=str(exc))
                    raise
                await asyncio.sleep(0.2)
