"""Bus.kv against a JetStream that does not answer at first (a cluster still electing the leaders a
replicated bucket needs): asked again until its deadline, then the error; fake JetStream (unit test)."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest

from shared.bus import Bus


class FakeJs:
    def __init__(self, timeouts: int):
        self.timeouts, self.created, self.calls = timeouts, False, 0

    async def key_value(self, bucket):
        self.calls += 1
        if self.created:
            return f"kv:{bucket}"
        raise nats.js.errors.BucketNotFoundError()

    async def create_key_value(self, config):
        if self.timeouts:
            self.timeouts -= 1
            self.created = True  # the server went on creating it after the request timed out
            raise nats.errors.TimeoutError()
        self.created = True
        return f"kv:{config.bucket}"


def bus_with(js) -> Bus:
    bus = Bus.__new__(Bus)
    bus.name, bus._js = "test", js
    return bus


@pytest.mark.parametrize("timeouts", [0, 1, 3])
def test_a_bucket_request_that_times_out_is_asked_again(timeouts):
    js = FakeJs(timeouts)
    assert asyncio.run(bus_with(js).kv("state", replicas=3)) == "kv:state"


def test_a_jetstream_that_never_answers_fails_at_the_deadline():
    class Silent(FakeJs):
        async def key_value(self, bucket):
            raise nats.errors.TimeoutError()

    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(bus_with(Silent(0)).kv("state", timeout_s=0.0))
