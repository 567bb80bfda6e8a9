"""The coordinator's persisted state in a JetStream KV bucket.

Contract:
- Keys: ``lease.<lease_id>`` (a Lease as JSON), ``queue.<request_id>`` (a QueuedClaim),
  ``meta`` (``{"next_generation": N}``: no coordinator ever handed out a generation >= N).
- ``await store.load() -> (leases, queued, next_generation)``: everything readable; a record that
  cannot be decoded is logged and skipped (it must not keep the coordinator down).
- ``await store.write(effects)``: the persistence part of one batch of core effects: the last
  write per key wins, and all keys are written at once; returns when every write is acknowledged.
  While leading, the writes go as JetStream atomic batches (``allow_atomic`` on the bucket's
  stream, nats-server >= 2.12; :meth:`enable_atomic`): one round trip for a whole batch, all of it
  stored or none, each write fenced; without atomic batches they go one at a time.
- Every call retries while NATS is away, for up to ``retry_s``, then raises. A write waits
  ``attempt_s`` for its acknowledgement, then is sent again (not nats-py's 5 s: a write in flight
  when the member under it died is never answered, and the next attempt goes to the new one).
  Sending a write again is harmless: it sets the same keys to the same values, and the
  replicated stream keeps its writes in order (one that was stored after all comes before the
  next attempt). While the bucket's stream has no leader (its member died and JetStream elects
  another, which takes seconds) every attempt is refused at once; the first refusal and the
  recovery are logged (``state_store_waiting``, ``state_store_answered``).
- ``await store.compact(older_than_s)``: drop the delete markers ended leases leave behind.
- Leader key (services.coordinator.leadership): ``read_leader() -> (revision, is_held)``,
  ``take_leader(holder, revision, is_held)``, ``renew_leader(holder)`` and ``release_leader()``
  are compare-and-set writes on its revision (``LeaderKeyTaken`` when another writer came first).
  Once taken, every ``write`` is conditional on the key still being at the revision this store
  last wrote (``Nats-Expected-Last-Subject-Sequence`` for the key's subject): a coordinator that
  lost the key gets ``LeaderKeyTaken`` and writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from services.coordinator.leadership import LEADER_KEY, NotLeading
from services.coordinator.model import (
    DeleteLease, DeleteQueued, Effect, Lease, PutLease, PutMeta, PutQueued, QueuedClaim,
)
from shared.log import get_logger

KV_OPERATION = "KV-Operation"  # the KV protocol's delete marker header
EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"  # nats-server >= 2.11
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream error codes of a failed expected sequence
BATCH_ID, BATCH_SEQ, BATCH_COMMIT = "Nats-Batch-Id", "Nats-Batch-Sequence", "Nats-Batch-Commit"
MAX_ATOMIC_BATCH = 500  # the server takes up to 1000 messages in one atomic batch
WRITE_ATTEMPT_S = 2.0  # how long one write waits for its acknowledgement before it is sent again


class LeaderKeyTaken(NotLeading):
    """The leader key is not at the revision this coordinator expected: another one leads."""


class StateStore:
    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str, retry_s: float = 30.0,
                 nc: nats.NATS | None = None, attempt_s: float = WRITE_ATTEMPT_S) -> None:
        self.kv, self.js, self.retry_s, self.nc = kv, js, retry_s, nc
        self.attempt_s = attempt_s
        self.prefix, self.stream = f"$KV.{bucket}.", f"KV_{bucket}"
        self.leader_revision = 0  # 0: writes are not fenced (not leading through this store)
        self.is_atomic = False  # the bucket's stream takes atomic batches (enable_atomic)
        self.log = get_logger("coordinator.store")

    async def enable_atomic(self) -> bool:
        """Let the bucket's stream take atomic batches (an idempotent stream update); False on a
        server that cannot (older than 2.12): writes then go one at a time. Needs the store's
        ``nc`` (the batch's uncommitted messages are plain publishes)."""
        if self.nc is None:
            return False
        try:
            info = await self._retry(self.js.stream_info, self.stream)
            if not info.config.allow_atomic:
                info.config.allow_atomic = True
                info = await self._retry(self.js.update_stream, info.config)
            self.is_atomic = bool(info.config.allow_atomic)
        except nats.js.errors.APIError as exc:
            self.log.warning("atomic_batches_unavailable", error=str(exc),
                             hint="run nats-server >= 2.12 for one round trip per state write")
            self.is_atomic = False
        return self.is_atomic

    async def load(self) -> tuple[list[Lease], list[QueuedClaim], int]:
        leases, queued, next_generation = [], [], 1
        for key in await self._retry(self._keys):
            _, value = await self._retry(self._read, key)
            if value is None:
                continue
            try:
                if key.startswith("lease."):
                    leases.append(msgspec.json.decode(value, type=Lease))
                elif key.startswith("queue."):
                    queued.append(msgspec.json.decode(value, type=QueuedClaim))
                elif key == "meta":
                    next_generation = int(json.loads(value)["next_generation"])
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError) as exc:
                self.log.error("state_record_unreadable", key=key, error=str(exc))
        return leases, queued, next_generation

    async def _keys(self) -> list[str]:
        """Every key with a record in the bucket (deleted ones too, until purged), from the
        stream's own per-subject counts. Not ``kv.keys()``: its watcher can report an empty bucket
        when the server has sent every entry but none has reached the watcher yet, and a new
        leader that restored nothing would hand out slots and generations already in use."""
        info = await self.js.stream_info(self.stream, subjects_filter=self.prefix + ">")
        return sorted(s[len(self.prefix):] for s in (info.state.subjects or {}))

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
        if not self.leader_revision:
            await asyncio.gather(*(self._retry(self._put, key, value) for key, value in writes.items()))
            return
        # Fenced writes never overlap: a replicated bucket (NATS cluster) refuses a write that
        # expects the leader key's sequence while another write is in flight ("wrong last
        # sequence", 10164), which would read as a lost leadership. An atomic batch is one write.
        items = list(writes.items())
        if self.is_atomic and len(items) > 1:
            for i in range(0, len(items), MAX_ATOMIC_BATCH):
                await self._retry(self._put_batch, items[i:i + MAX_ATOMIC_BATCH])
            return
        for key, value in items:
            await self._retry(self._put, key, value)

    def _headers(self, value: bytes | None) -> dict[str, str]:
        headers = {KV_OPERATION: "DEL"} if value is None else {}
        if self.leader_revision:
            headers[EXPECTED_SEQ] = str(self.leader_revision)
            headers[EXPECTED_SEQ_SUBJECT] = self.prefix + LEADER_KEY
        return headers

    async def _put_batch(self, items: list[tuple[str, bytes | None]]) -> None:
        """Writes as one atomic batch: every message but the last is a plain publish, the last
        commits and is acknowledged; a failed check anywhere stores nothing and fails the commit."""
        batch_id = uuid.uuid4().hex
        for seq, (key, value) in enumerate(items[:-1], start=1):
            headers = {**self._headers(value), BATCH_ID: batch_id, BATCH_SEQ: str(seq)}
            await self.nc.publish(self.prefix + key, value or b"", headers=headers)
        key, value = items[-1]
        await self._put(key, value, {BATCH_ID: batch_id, BATCH_SEQ: str(len(items)), BATCH_COMMIT: "1"})

    async def _put(self, key: str, value: bytes | None, extra_headers: dict[str, str] | None = None) -> None:
        """One acknowledged write (``None``: delete), fenced by the leader key's revision when
        leading; ``extra_headers``: an atomic batch's commit."""
        headers = {**self._headers(value), **(extra_headers or {})}
        try:
            await self.js.publish(self.prefix + key, value or b"", headers=headers or None,
                                  timeout=self.attempt_s)
        except nats.js.errors.APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                raise LeaderKeyTaken(f"leader key moved past revision {self.leader_revision}") from exc
            raise

    # ------------------------------------------------------------ leader key

    async def read_leader(self) -> tuple[int, bool]:
        """(revision, is_held): revision 0 when the key never existed (or was purged); not held
        when deleted (a leader let go)."""
        revision, value = await self._retry(self._read, LEADER_KEY)
        return revision, value is not None

    async def _read(self, key: str) -> tuple[int, bytes | None]:
        """(revision, value; None: absent or deleted), from the stream's leader: a direct get may
        be answered by a replica that has not caught up, and a new leader must read what the old
        one wrote last."""
        try:
            msg = await self.js.get_msg(self.stream, subject=self.prefix + key, direct=False)
        except nats.js.errors.NotFoundError:
            return 0, None
        if msg.headers and msg.headers.get(KV_OPERATION) in ("DEL", "PURGE"):
            return msg.seq, None
        return msg.seq, msg.data or b""

    async def take_leader(self, holder: str, revision: int) -> int:
        """Compare-and-set the key from ``revision`` to ``holder``; fence writes by the result."""
        self.leader_revision = await self._cas(holder, revision)
        return self.leader_revision

    async def renew_leader(self, holder: str) -> int:
        """Rewrite the key (compare-and-set on our last revision): the leader is alive."""
        self.leader_revision = await self._cas(holder, self.leader_revision)
        return self.leader_revision

    async def release_leader(self) -> None:
        """Delete the key if it is still ours (a standby takes over at once); stop fencing."""
        revision, self.leader_revision = self.leader_revision, 0
        if revision:
            try:
                await self.kv.delete(LEADER_KEY, last=revision)
            except nats.js.errors.APIError as exc:
                if exc.err_code not in WRONG_LAST_SEQUENCE:
                    raise

    def forget_leader(self) -> None:
        """Leadership ended without a release: stop fencing (writes are not ours to make)."""
        self.leader_revision = 0

    async def _cas(self, holder: str, revision: int) -> int:
        value = json.dumps({"holder": holder, "at_ms": int(time.time() * 1000)}).encode()
        try:
            return await self.kv.update(LEADER_KEY, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise LeaderKeyTaken(f"leader key is past revision {revision}") from exc

    async def compact(self, older_than_s: int) -> None:
        await self.kv.purge_deletes(olderthan=max(1, older_than_s))

    async def _retry(self, fn, *args):
        started = time.monotonic()
        deadline, attempts = started + self.retry_s, 0
        op = getattr(fn, "__name__", "call").lstrip("_")
        while True:
            try:
                result = await fn(*args)
            except (nats.js.errors.NoKeysError, nats.js.errors.KeyNotFoundError):
                raise
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
                attempts += 1
                error = str(exc) or type(exc).__name__
                if attempts == 1:
                    self.log.warning("state_store_waiting", op=op, error=error)
                if time.monotonic() > deadline:
                    self.log.error("state_write_failed", op=op, error=error, attempts=attempts)
                    raise
                await asyncio.sleep(0.2)
                continue
            if attempts:
                self.log.info("state_store_answered", op=op, attempts=attempts + 1,
                              waited_ms=int((time.monotonic() - started) * 1000))
            return result
