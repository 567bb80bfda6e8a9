"""What a decode node tells the coordinator and routers about itself: ``NodeAvailable`` on
``xl.node.<node>.avail`` (free slots, versions, transport endpoint, slot buffer addresses, layout)
every ``--heartbeat-ms``, at once when the slot core asks (a slot freed or taken; a freed slot's
beat carries its ``SlotReleased``) and when NATS comes back; ``NodeDraining`` instead once the node
drains. A tensor-parallel node lists its ranks 1..N-1's receive buffers in ``ranks``. ``seq`` grows with every message, so a
restarted node (seq from 1 again) is told apart from a late message."""

from __future__ import annotations

import asyncio
import time

from services.decode.config import DecodeConfig
from services.decode.receiver import Receiver
from services.decode.slots import SlotCore
from shared import subjects
from shared.bus import Bus
from shared.events import PROTOCOL_VERSION, NodeAvailable, NodeDraining, RankEndpoints, SlotReleased


class Availability:
    def __init__(self, bus: Bus, config: DecodeConfig, core: SlotCore, receiver: Receiver, engine, log,
                 ranks: list[RankEndpoints] | None = None) -> None:
        self.bus, self.config, self.core, self.receiver, self.engine, self.log = (
            bus, config, core, receiver, engine, log)
        self.ranks = list(ranks or [])  # a tensor-parallel node's ranks 1..N-1
        self.seq = 0
        self.is_draining = False

    async def publish(self, released: SlotReleased | None = None) -> None:
        """One beat now; ``released``: the slot release that made it (carried for the coordinator)."""
        self.seq += 1
        node_id, c = self.config.node_id, self.config
        now, subject = int(time.time() * 1000), subjects.node_avail(node_id)
        if self.is_draining:
            return await self.bus.publish(subject, NodeDraining(node_id=node_id, sent_at_ms=now))
        await self.bus.publish(subject, NodeAvailable(
            node_id=node_id, model=self.engine.model_name, protocol_version=PROTOCOL_VERSION,
            total_slots=c.num_slots, free_slots=self.core.free_slots(),
            transports=[self.receiver.name], endpoints={self.receiver.name: self.receiver.endpoint},
            slots=self.receiver.slot_targets(), layout=self.engine.layout,
            heartbeat_interval_ms=c.heartbeat_ms, seq=self.seq, sent_at_ms=now,
            nixl_metadata_b64=self.receiver.metadata_b64, max_seq_len=self.engine.max_seq_len, ranks=self.ranks,
            released=[released] if released is not None else []))

    async def loop(self) -> None:
        """Publish every ``heartbeat_ms`` until cancelled (a failed publish is logged, not fatal)."""
        while True:
            await asyncio.sleep(self.config.heartbeat_ms / 1000)
            try:
                await self.publish()
            except Exception:
                self.log.exception("heartbeat_failed")
