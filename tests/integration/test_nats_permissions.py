"""infra/nats/nats.conf on a real nats-server: each service may publish and subscribe only on its
own subjects of shared/subjects.py; what goes outside is refused by the server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from infra.nats import SECURE_CONFIG
from shared import events as ev
from shared import subjects
from shared.bus import Bus, BusAuthError

WAIT_S = 5.0
USERS = ("router", "coordinator", "decode", "prefill", "tools")
PASSWORDS = {user: f"{user}-{uuid.uuid4().hex[:8]}" for user in USERS}
ENV = {f"XL_NATS_{user.upper()}_PASSWORD": pw for user, pw in PASSWORDS.items()}

RID = "r1"
NODE = "decode-0"
EVENT = ev.CancelRequest(request_id=RID)  # the payload does not matter to the server
PUBLISH_CASES = [
    # user, subject, allowed
    ("router", subjects.CLAIM, True),
    ("router", subjects.decode_start(NODE), True),
    ("router", subjects.req_cancel(RID), True),
    ("router", subjects.req_tokens(RID), False),  # only decode nodes (and the coordinator) stream
    ("router", subjects.kv_ready(NODE), False),
    ("router", subjects.node_avail(NODE), False),
    ("router", subjects.handoff(RID, "completed"), False),
    ("router", subjects.decode_lease_ended(NODE), False),
    ("decode", subjects.node_avail(NODE), True),
    ("decode", subjects.req_tokens(RID), True),
    ("decode", subjects.COORD_REPORT, True),
    ("decode", subjects.kv_ready(NODE), False),
    ("decode", subjects.CLAIM, False),
    ("decode", subjects.decode_lease_ended(NODE), False),  # only the coordinator ends leases
    ("prefill", subjects.kv_ready(NODE), True),
    ("prefill", subjects.decode_start(NODE), True),  # the prefill starts the decode
    ("prefill", subjects.req_tokens(RID), True),  # its first token
    ("coordinator", subjects.handoff(RID, "claimed"), True),
    ("coordinator", subjects.req_cancel(RID), True),
    ("coordinator", subjects.decode_lease_ended(NODE), True),
    ("coordinator", subjects.decode_start(NODE), False),
    ("tools", subjects.req_cancel(RID), False),
    ("tools", "other.subject", False),
]


def url_for(server, user: str, password: str | None = None) -> str:
    return server.url.replace("nats://", f"nats://{user}:{password or PASSWORDS[user]}@")


@pytest.fixture
async def secure(make_nats_server):
    """A private server with the per-service config, a connected bus per user, and the tools
    user watching xl.> (it sees exactly what the server let through)."""
    server = make_nats_server(config_file=SECURE_CONFIG, env=ENV)
    buses = {user: await Bus.connect(url_for(server, user), name=user) for user in USERS}
    errors: dict[str, list[str]] = {user: [] for user in USERS}
    for user, bus in buses.items():
        async def on_error(exc, user=user):
            errors[user].append(str(exc))
        bus.add_error_callback(on_error)
    seen: asyncio.Queue = asyncio.Queue()

    async def watch(msg):
        await seen.put(msg.subject)

    await buses["tools"].nc.subscribe(subjects.ALL, cb=watch)
    await buses["tools"].flush()
    yield server, buses, errors, seen
    for bus in buses.values():
        await bus.close()
    assert all(bus.nc.is_closed for bus in buses.values())


async def test_publish_permissions(secure):
    server, buses, errors, seen = secure
    for user, subject, allowed in PUBLISH_CASES:
        await buses[user].publish(subject, EVENT)
        await buses[user].flush()
        if allowed:
            assert await asyncio.wait_for(seen.get(), WAIT_S) == subject, (user, subject)
            assert errors[user] == [], (user, subject)
        else:
            for _ in range(100):
                if errors[user]:
                    break
                await asyncio.sleep(0.02)
            assert [e.lower() for e in errors[user]] == [
                f'nats: permissions violation for publish to "{subject}"'], (user, subject)
            errors[user].clear()
    await buses["tools"].flush()
    assert seen.empty()  # nothing refused was delivered
    assert all(bus.is_connected for bus in buses.values())  # a violation does not drop the client


SUBSCRIBE_CASES = [
    # user, subject, allowed: what each service subscribes to, and some it must not
    ("router", subjects.REQ_TOKENS_ALL, True),
    ("router", subjects.NODE_AVAIL_ALL, True),
    ("router", subjects.HANDOFF_ALL, True),
    ("router", subjects.DECODE_START_ALL, False),
    ("router", subjects.DECODE_LEASE_ENDED_ALL, False),
    ("router", subjects.KV_READY_ALL, False),
    ("coordinator", subjects.CLAIM, True),
    ("coordinator", subjects.COORD_REPORT, True),
    ("coordinator", subjects.NODE_AVAIL_ALL, True),
    ("coordinator", subjects.KV_READY_ALL, True),
    ("coordinator", subjects.REQ_CANCEL_ALL, True),
    ("coordinator", subjects.REQ_TOKENS_ALL, False),
    ("coordinator", subjects.DECODE_LEASE_ENDED_ALL, False),
    ("decode", subjects.decode_start(NODE), True),
    ("decode", subjects.kv_ready(NODE), True),
    ("decode", subjects.REQ_CANCEL_ALL, True),
    ("decode", subjects.decode_lease_ended(NODE), True),
    ("decode", subjects.HANDOFF_ALL, False),  # lease ends come on the node's own subject
    ("decode", subjects.CLAIM, False),
    ("decode", subjects.REQ_TOKENS_ALL, False),
    ("prefill", subjects.REQ_CANCEL_ALL, True),
    ("prefill", subjects.NODE_AVAIL_ALL, True),
    ("prefill", subjects.KV_READY_ALL, False),
    ("prefill", subjects.DECODE_LEASE_ENDED_ALL, False),
    ("tools", subjects.ALL, True),
    ("tools", ">", False),
]


async def test_subscribe_permissions(secure):
    _, buses, errors, _ = secure

    async def ignore(event, msg):
        return None

    for user, subject, allowed in SUBSCRIBE_CASES:
        # subscribe() returns after a round trip, and the server's -ERR precedes its PONG
        await buses[user].subscribe(subject, ignore, ev.AnyEvent)
        refused = [] if allowed else [f'nats: permissions violation for subscription to "{subject}"']
        assert [e.lower() for e in errors[user]] == refused, (user, subject)
        errors[user].clear()


async def test_claim_request_reply_and_coordinator_kv(secure):
    _, buses, errors, _ = secure

    async def coordinator(event: ev.ClaimRequest, msg):
        await buses["coordinator"].respond(msg, ev.ClaimRejected(request_id=event.request_id,
                                                                 reason="no_free_slot"))

    await buses["coordinator"].subscribe(subjects.CLAIM, coordinator, ev.ClaimRequest)
    await buses["coordinator"].flush()
    claim = ev.ClaimRequest(request_id=RID, model="m", num_prompt_tokens=1, max_tokens=1)
    reply = await buses["router"].request(subjects.CLAIM, claim, ev.ClaimReply, timeout_s=WAIT_S)
    assert reply == ev.ClaimRejected(request_id=RID, reason="no_free_slot")

    kv = await buses["coordinator"].kv(subjects.COORD_KV_BUCKET)
    revision = await kv.put("lease.a", b"1")
    assert (await kv.get("lease.a")).revision == revision
    assert errors == {user: [] for user in USERS}


async def test_wrong_password_is_refused_with_a_clear_error(secure):
    server, _, _, _ = secure
    with pytest.raises(BusAuthError) as info:
        await Bus.connect(url_for(server, "router", "wrong"), connect_timeout_s=10.0)
    shown = server.url.replace("nats://", "nats://router:***@")
    assert str(info.value) == (
        f"nats-server at {shown} refused the credentials of router: "
        "check the user and password in EXPRESSLANE_NATS_URL"
    )
