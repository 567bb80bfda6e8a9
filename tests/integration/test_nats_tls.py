"""The secure bus on a real nats-server: TLS with a generated CA, one user per service whose
password comes from a file (infra/nats_secrets.py, infra/nats/nats.conf). The right files connect
and speak their subjects; a wrong password, a client that does not trust the CA, a plaintext
client and (with client verification) a client without a certificate are all refused."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from infra.nats import SECURE_CONFIG, ServerTls
from infra.nats_secrets import USERS, make_client_cert, make_secrets, new_password
from shared import events as ev
from shared import subjects
from shared.bus import Bus, BusAuthError, BusTlsError
from shared.bus_auth import BusAuth

WAIT_S = 5.0
RID = "r1"


def auth_for(secrets, user: str, **overrides) -> BusAuth:
    fields = {"user": user, "password_file": str(secrets.password_file(user)),
              "tls_ca": str(secrets.ca), **overrides}
    return BusAuth(**fields).validate()


@pytest.fixture
def secrets(tmp_path):
    return make_secrets(tmp_path / "secrets")


@pytest.fixture
def tls_server(make_nats_server, secrets):
    tls = ServerTls(cert=str(secrets.server_cert), key=str(secrets.server_key))
    return make_nats_server(config_file=SECURE_CONFIG, env=secrets.server_env(), tls=tls)


async def test_secrets_are_files_readable_only_by_their_owner(secrets):
    for user in USERS:
        assert secrets.password_file(user).stat().st_mode & 0o077 == 0
    assert secrets.server_key.stat().st_mode & 0o077 == 0
    before = {user: secrets.password_file(user).read_text() for user in USERS}
    make_secrets(secrets.out_dir)  # a second run keeps what is there
    assert {user: secrets.password_file(user).read_text() for user in USERS} == before
    assert len(set(before.values())) == len(USERS)
    # nats-server parses the variables as config values: a letter first, then letters and digits
    assert all(re.fullmatch(r"xl[0-9a-f]{48}\n", pw) for pw in before.values())


async def test_every_generated_password_is_one_nats_server_accepts(make_nats_server, tmp_path):
    env = {f"XL_NATS_{user.upper()}_PASSWORD": new_password() for user in USERS}
    make_nats_server(config_file=SECURE_CONFIG, env=env)  # raises when one cannot be parsed


async def test_each_service_connects_over_tls_and_speaks_its_subjects(tls_server, secrets):
    buses = {user: await Bus.connect(tls_server.url, name=user, auth=auth_for(secrets, user))
             for user in USERS}
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    buses["router"].add_error_callback(on_error)
    try:
        seen: asyncio.Queue = asyncio.Queue()

        async def watch(msg):
            await seen.put(msg.subject)

        await buses["tools"].nc.subscribe(subjects.ALL, cb=watch)
        await buses["tools"].flush()

        async def coordinator(event: ev.ClaimRequest, msg):
            await buses["coordinator"].respond(
                msg, ev.ClaimRejected(request_id=event.request_id, reason="no_free_slot"))

        await buses["coordinator"].subscribe(subjects.CLAIM, coordinator, ev.ClaimRequest)
        claim = ev.ClaimRequest(request_id=RID, model="m", num_prompt_tokens=1, max_tokens=1)
        reply = await buses["router"].request(subjects.CLAIM, claim, ev.ClaimReply, timeout_s=WAIT_S)
        assert reply == ev.ClaimRejected(request_id=RID, reason="no_free_slot")
        assert await asyncio.wait_for(seen.get(), WAIT_S) == subjects.CLAIM

        await buses["decode"].publish(subjects.req_tokens(RID), ev.CancelRequest(request_id=RID))
        assert await asyncio.wait_for(seen.get(), WAIT_S) == subjects.req_tokens(RID)

        # per-service permissions hold over TLS too
        await buses["router"].publish(subjects.req_tokens(RID), ev.CancelRequest(request_id=RID))
        await buses["router"].flush()
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.02)
        assert [e.lower() for e in errors] == [
            f'nats: permissions violation for publish to "{subjects.req_tokens(RID)}"']
        assert all(bus.is_connected for bus in buses.values())
    finally:
        for bus in buses.values():
            await bus.close()
    assert all(bus.nc.is_closed for bus in buses.values())


async def test_wrong_password_file_is_refused_with_a_clear_error(tls_server, secrets, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    with pytest.raises(BusAuthError) as info:
        await Bus.connect(tls_server.url, auth=auth_for(secrets, "router", password_file=str(wrong)),
                          connect_timeout_s=10.0)
    assert str(info.value) == (f"nats-server at {tls_server.url} refused the credentials of router: "
                               "check --nats-user and --nats-password-file")
    # another service's password does not open the router's account either
    with pytest.raises(BusAuthError):
        await Bus.connect(tls_server.url, connect_timeout_s=10.0, auth=auth_for(
            secrets, "router", password_file=str(secrets.password_file("decode"))))


async def test_client_that_does_not_trust_the_ca_is_refused(tls_server, secrets, tmp_path):
    other = make_secrets(tmp_path / "other")  # a CA of its own
    for auth in (auth_for(secrets, "router", tls_ca=str(other.ca)),
                 BusAuth(user="router", password_file=str(secrets.password_file("router")))):
        with pytest.raises(BusTlsError, match="--nats-tls-ca"):
            await Bus.connect(tls_server.url, auth=auth, connect_timeout_s=10.0)


async def test_plaintext_client_is_refused(tls_server, secrets):
    """A client that speaks plain NATS, with the right password, gets no session."""
    reader, writer = await asyncio.open_connection("127.0.0.1", tls_server.port)
    try:
        info = json.loads((await asyncio.wait_for(reader.readline(), WAIT_S)).split(b" ", 1)[1])
        assert info["tls_required"] is True
        password = secrets.password_file("router").read_text().strip()
        connect = {"user": "router", "pass": password, "verbose": False, "pedantic": False}
        writer.write(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), WAIT_S)
    finally:
        writer.close()
    assert b"PONG" not in answer and b"+OK" not in answer
    assert b"-ERR" in answer or answer == b""  # refused, then the server hangs up


async def test_tls_client_never_sends_its_password_to_a_plaintext_server(make_nats_server, secrets):
    server = make_nats_server(config_file=SECURE_CONFIG, env=secrets.server_env())  # no TLS
    with pytest.raises(BusTlsError, match="does not use TLS"):
        await Bus.connect(server.url, auth=auth_for(secrets, "router"), connect_timeout_s=10.0)


async def test_server_that_verifies_clients_wants_a_certificate_from_its_ca(make_nats_server, secrets,
                                                                            tmp_path):
    tls = ServerTls(cert=str(secrets.server_cert), key=str(secrets.server_key), ca=str(secrets.ca),
                    verify=True)
    server = make_nats_server(config_file=SECURE_CONFIG, env=secrets.server_env(), tls=tls)
    with pytest.raises(BusTlsError):
        await Bus.connect(server.url, auth=auth_for(secrets, "decode"), connect_timeout_s=10.0)
    other = make_secrets(tmp_path / "other")
    stranger_cert, stranger_key = make_client_cert(other.out_dir, "decode")
    with pytest.raises(BusTlsError):
        await Bus.connect(server.url, connect_timeout_s=10.0, auth=auth_for(
            secrets, "decode", tls_cert=str(stranger_cert), tls_key=str(stranger_key)))
    cert, key = make_client_cert(secrets.out_dir, "decode")
    bus = await Bus.connect(server.url, auth=auth_for(secrets, "decode", tls_cert=str(cert),
                                                      tls_key=str(key)))
    try:
        await bus.publish(subjects.COORD_REPORT, ev.CancelRequest(request_id=RID))
        await bus.flush()
        assert bus.is_connected
    finally:
        await bus.close()


async def test_prefill_publisher_speaks_over_tls_with_its_files(tls_server, secrets):
    """The vLLM-side publisher (its own thread and loop) connects with the prefill user's files."""
    from services.prefill.config import ExpressConfig
    from services.prefill.publisher import Publisher

    tools = await Bus.connect(tls_server.url, name="tools", auth=auth_for(secrets, "tools"))
    seen: asyncio.Queue = asyncio.Queue()

    async def watch(msg):
        await seen.put(msg.subject)

    await tools.nc.subscribe(subjects.ALL, cb=watch)
    await tools.flush()
    config = ExpressConfig(nats_url=tls_server.url, nats_user="prefill",
                           nats_password_file=str(secrets.password_file("prefill")),
                           nats_tls_ca=str(secrets.ca))
    config.validate()
    publisher = Publisher(config.nats_url, auth=config.bus_auth())
    try:
        event = ev.CancelRequest(request_id=RID)  # the payload does not matter to the server
        assert await asyncio.to_thread(publisher.publish, subjects.kv_ready("decode-0"), event)
        assert await asyncio.wait_for(seen.get(), WAIT_S) == subjects.kv_ready("decode-0")
    finally:
        await asyncio.to_thread(publisher.close)
        await tools.close()


async def test_the_prefills_direct_connection_speaks_tls_with_its_password(tls_server, secrets, tmp_path):
    """shared.bus_direct (the first token's connection inside vLLM) over TLS as the prefill user:
    its messages arrive; a wrong password is refused, and the caller keeps its other path."""
    from shared.bus_direct import DirectPublisher, wait_connected

    tools = await Bus.connect(tls_server.url, name="tools", auth=auth_for(secrets, "tools"))
    seen: asyncio.Queue = asyncio.Queue()

    async def watch(msg):
        await seen.put((msg.subject, msg.data))

    await tools.nc.subscribe(subjects.req_tokens(RID), cb=watch)
    await tools.flush()
    direct = DirectPublisher(tls_server.url, name="prefill-first", auth=auth_for(secrets, "prefill"))
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    refused = DirectPublisher(tls_server.url, name="prefill-first",
                              auth=auth_for(secrets, "prefill", password_file=str(wrong)))
    try:
        assert await asyncio.to_thread(wait_connected, direct, WAIT_S)
        token = ev.PrefillToken(request_id=RID, token_id=5, finish_reason="length", prompt_token_ids=[1])
        assert direct.publish([(subjects.req_tokens(RID), token, "")])
        subject, data = await asyncio.wait_for(seen.get(), WAIT_S)
        assert subject == subjects.req_tokens(RID) and ev.decode_any(data) == token
        for _ in range(500):
            if "authorization" in refused.last_error.lower():
                break
            await asyncio.sleep(0.02)
        assert "authorization" in refused.last_error.lower()
        assert not refused.is_connected and refused.publish([(subjects.req_tokens(RID), token, "")]) is False
    finally:
        direct.close()
        refused.close()
        await tools.close()
