"""What the bus raises when nats-py cannot send: always a BusError (callers fall back on it: the router's
claim to the standard lane, the prefill's notices to their retry), never a nats-py error of its own kind.
nats-py's client is a small neighbour here that fails as the real one does on a closed connection or a
full reconnect buffer."""

from __future__ import annotations

import nats.errors
import pytest

from shared.bus import Bus, BusError, BusNoResponders, BusTimeout
from shared.events import CancelRequest


class Client:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.is_connected = True

    def jetstream(self):
        return None

    async def publish(self, subject, data, headers=None):
        raise self.error

    async def request(self, subject, data, timeout, headers=None):
        raise self.error


EVENT = CancelRequest(request_id="r1", reason="client_disconnected")


@pytest.mark.parametrize("error", [nats.errors.ConnectionClosedError(), nats.errors.OutboundBufferLimitError()])
async def test_publish_that_cannot_send_raises_bus_error(error):
    with pytest.raises(BusError, match="could not publish on xl.req.r1.cancel") as info:
        await Bus(Client(error), "nats://x", "t").publish("xl.req.r1.cancel", EVENT, replay=True)
    assert info.value.__cause__ is error


@pytest.mark.parametrize("error,kind", [
    (nats.errors.NoRespondersError(), BusNoResponders),
    (nats.errors.TimeoutError(), BusTimeout),
    (nats.errors.ConnectionClosedError(), BusError),
    (nats.errors.OutboundBufferLimitError(), BusError),
])
async def test_request_failures_are_bus_errors(error, kind):
    with pytest.raises(kind) as info:
        await Bus(Client(error), "nats://x", "t").request("xl.coord.claim", EVENT, CancelRequest, 1.0)
    assert type(info.value) is kind and info.value.__cause__ is error
