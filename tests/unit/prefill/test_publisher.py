"""The prefill's publisher on a real nats-server: events leave on the calling thread's own
connection once it is up, through the loop thread's client otherwise (direct=False, or before
the connection is made); either way they arrive, in order."""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.publisher import Publisher
from shared import subjects
from shared.bus import Bus
from shared.bus_direct import wait_connected
from shared.events import CancelRequest, decode_any

WAIT_S = 10.0


@pytest.mark.parametrize("direct,want", [(True, "direct"), (False, "loop")])
async def test_publish_many_arrives_in_order_either_way(nats_url, direct, want):
    rid = f"r-pub-{want}"
    bus = await Bus.connect(nats_url, name="reader")
    got: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg):
        await got.put(decode_any(msg.data).reason)

    await bus.nc.subscribe(subjects.req_tokens(rid), cb=on_msg)
    await bus.flush()
    publisher = Publisher(nats_url, name="test-prefill", direct=direct)
    try:
        if direct:
            assert await asyncio.to_thread(wait_connected, publisher._direct, WAIT_S)
        else:
            assert await asyncio.to_thread(publisher._connected.wait, WAIT_S)
        messages = [(subjects.req_tokens(rid), CancelRequest(request_id=rid, reason=f"m{i}"), "") for i in range(3)]
        assert await asyncio.to_thread(publisher.publish_many, messages) == want
        assert await asyncio.to_thread(publisher.publish, subjects.req_tokens(rid),
                                       CancelRequest(request_id=rid, reason="m3"))
        assert [await asyncio.wait_for(got.get(), WAIT_S) for _ in range(4)] == ["m0", "m1", "m2", "m3"]
    finally:
        await asyncio.to_thread(publisher.close)
        await bus.close()
