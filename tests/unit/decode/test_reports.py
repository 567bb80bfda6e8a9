"""The decode node's report queue (reports.py): every report stored, in order, however long the
coordinator's report stream goes without a leader; the bus is a small neighbour that refuses to
store for a while, as Bus.publish_stored does when its retry window ends."""

from __future__ import annotations

import asyncio

from services.decode.effects import Publish
from services.decode.reports import Reports
from shared import subjects
from shared.bus import BusTimeout
from shared.events import DecodeStarted, SlotReleased

IDS = dict(request_id="r1", lease_id="L1", generation=1, node_id="d1", slot=0)


class Bus:
    def __init__(self, refusals: int, broken: type | None = None) -> None:
        self.refusals, self.broken = refusals, broken
        self.tries: list[str] = []  # event type per publish attempt
        self.stored: list[object] = []

    async def publish_stored(self, subject, event) -> None:
        self.tries.append(type(event).__name__)
        await asyncio.sleep(0)
        if self.broken is not None and isinstance(event, self.broken):
            raise ValueError("cannot encode")
        if self.refusals:
            self.refusals -= 1
            raise BusTimeout(f"no stream stored {subject} within 10 s")
        self.stored.append(event)


async def run_reports(bus: Bus, events: list) -> Reports:
    reports = Reports(bus)
    task = asyncio.create_task(reports.run())
    for event in events:
        reports.send(Publish(subjects.COORD_REPORT, event, "L1"))
    await reports.flush(30)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return reports


async def test_a_report_the_stream_will_not_store_yet_is_retried_and_the_next_waits_behind_it():
    started, released = DecodeStarted(**IDS), SlotReleased(**IDS, outcome="completed")
    bus = Bus(refusals=3)
    await run_reports(bus, [started, released])
    assert bus.stored == [started, released]
    assert bus.tries == ["DecodeStarted"] * 4 + ["SlotReleased"]  # never overtaken


async def test_a_report_that_cannot_be_sent_at_all_does_not_hold_the_others():
    started, released = DecodeStarted(**IDS), SlotReleased(**IDS, outcome="completed")
    bus = Bus(refusals=0, broken=DecodeStarted)
    await run_reports(bus, [started, released])
    assert bus.stored == [released]
    assert bus.tries == ["DecodeStarted", "SlotReleased"]
