"""The wire contract: every event round-trips, older readers ignore new fields, a wrong protocol
version is refused with a message that says what to do."""

from __future__ import annotations

import json
import typing

import msgspec
import pytest

from shared import events as ev
from shared.kvlayout import KvShape, layout_spec

LAYOUT = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8), "float32", 16)
SLOT = ev.SlotTarget(slot=1, base_addr=0x7F0000001000, nbytes=LAYOUT.slot_nbytes)
TARGET = ev.TransferTarget(node_id="decode-0", transport="mooncake", endpoint="127.0.0.1:17001",
                           slot=SLOT, layout=LAYOUT)
SAMPLING = ev.SamplingParams(max_tokens=31, temperature=0.7, top_p=0.9, top_k=40, seed=3,
                             stop_token_ids=[2], num_speculative_tokens=1)
LEASE = dict(lease_id="lease-1", generation=4)

# One instance of every wire message, with every optional field set away from its default
# where it has one. The test below fails if a type of shared.events.AnyEvent is missing here.
SAMPLES: list[ev.Event] = [
    ev.ClaimRequest(request_id="r1", model="tiny-llama", num_prompt_tokens=17, max_tokens=32,
                    transports=["nixl"], wait_ms=500, tenant="t", model_aliases=["/m/tiny-llama"]),
    ev.ClaimGranted(request_id="r1", node_id="decode-0", expires_at_ms=1_764_400_000_000,
                    target=TARGET, **LEASE),
    ev.ClaimRejected(request_id="r1", reason="queue_full", retry_after_ms=250),
    ev.NodeAvailable(node_id="decode-0", model="tiny-llama", protocol_version=ev.PROTOCOL_VERSION,
                     total_slots=2, free_slots=[0], transports=["mooncake", "nixl"],
                     endpoints={"mooncake": "127.0.0.1:17001", "nixl": "decode-0"}, slots=[SLOT],
                     layout=LAYOUT, heartbeat_interval_ms=500, seq=9, sent_at_ms=1,
                     nixl_metadata_b64="bWV0YQ=="),
    ev.NodeDraining(node_id="decode-0", sent_at_ms=2),
    ev.KvReady(request_id="r1", node_id="decode-0", slot=1, num_tokens=17, layout_version=1,
               nbytes=4096, extract_ms=0.4, transfer_ms=1.5, **LEASE),
    ev.KvFailed(request_id="r1", node_id="decode-0", slot=1, reason="transfer_timeout", **LEASE),
    ev.DecodeStart(request_id="r1", slot=1, first_token_id=42, num_prompt_tokens=17,
                   sampling=SAMPLING, num_tokens_already_sent=3, **LEASE),
    ev.PrefillToken(request_id="r1", token_id=42, finish_reason="stop", prompt_token_ids=[1, 2, 3]),
    ev.TokensGenerated(request_id="r1", index=1, token_ids=[7, 8, 9]),
    ev.RequestFinished(request_id="r1", finish_reason="stop",
                       usage=ev.Usage(prompt_tokens=17, completion_tokens=4),
                       spec=ev.SpecStats(num_steps=2, num_draft_tokens=2, num_accepted_tokens=1),
                       decode_ms=3.25),
    ev.RequestFailed(request_id="r1", reason="node_lost", retryable=False),
    ev.CancelRequest(request_id="r1", reason="deadline"),
    ev.DecodeStarted(request_id="r1", node_id="decode-0", slot=1, **LEASE),
    ev.SlotReleased(request_id="r1", node_id="decode-0", slot=1, outcome="cancelled",
                    reason="client_disconnected", **LEASE),
    ev.HandoffEvent(request_id="r1", state="kv_ready", at_ms=5, node_id="decode-0", slot=1,
                    reason="", **LEASE),
]

UNIONS = [ev.ClaimReply, ev.NodeMessage, ev.KvMessage, ev.TokenMessage, ev.ReportMessage]


def test_samples_cover_every_event_type():
    assert {type(s) for s in SAMPLES} == set(typing.get_args(ev.AnyEvent))


def test_tags_are_unique():
    tags = [msgspec.inspect.type_info(t).tag for t in typing.get_args(ev.AnyEvent)]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(event):
    data = ev.encode(event)
    doc = json.loads(data)  # readable JSON for `nats sub 'xl.>'`
    assert doc["type"] == msgspec.inspect.type_info(type(event)).tag
    assert ev.decode_any(data) == event
    assert ev.decoder(type(event)).decode(data) == event
    for union in UNIONS:
        if type(event) in typing.get_args(union):
            assert ev.decoder(union).decode(data) == event


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_unknown_extra_fields_still_decode(event):
    doc = json.loads(ev.encode(event))
    doc["added_in_a_later_version"] = {"nested": [1, 2]}
    for field in msgspec.structs.fields(event):  # and inside nested structs
        if isinstance(getattr(event, field.name), msgspec.Struct):
            doc[field.encode_name]["also_new"] = "x"
    assert ev.decode_any(json.dumps(doc).encode()) == event


def test_defaults_fill_missing_optional_fields():
    claim = ev.decode_any(b'{"type":"claim","request_id":"r","model":"m",'
                          b'"num_prompt_tokens":1,"max_tokens":2}')
    assert claim == ev.ClaimRequest(request_id="r", model="m", num_prompt_tokens=1, max_tokens=2)
    assert claim.protocol_version == ev.PROTOCOL_VERSION
    assert claim.transports == ["mooncake", "nixl"] and claim.wait_ms == 2000


def test_defaults_are_not_shared_between_instances():
    a = ev.ClaimRequest(request_id="a", model="m", num_prompt_tokens=1, max_tokens=1)
    b = ev.ClaimRequest(request_id="b", model="m", num_prompt_tokens=1, max_tokens=1)
    a.transports.append("tcp")
    assert b.transports == ["mooncake", "nixl"]


@pytest.mark.parametrize(
    "data, error",
    [
        (b'{"type":"no_such_event","request_id":"r"}', "Invalid value 'no_such_event'"),
        (b'{"type":"cancel"}', "missing required field `request_id`"),
        (b'{"type":"tokens","request_id":"r","index":"0","token_ids":[]}', "Expected `int`"),
        (b'{"request_id":"r"}', "missing required field `type`"),
        (b"not json", "JSON is malformed"),
    ],
)
def test_invalid_messages_are_refused(data, error):
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError), match=error):
        ev.decode_any(data)


def test_protocol_version_checked():
    ev.check_protocol(ev.PROTOCOL_VERSION, "decode node decode-0")  # ours: no error
    claim = ev.decode_any(ev.encode(ev.ClaimRequest(
        request_id="r", model="m", num_prompt_tokens=1, max_tokens=1,
        protocol_version=ev.PROTOCOL_VERSION + 1)))
    with pytest.raises(ev.ProtocolError) as info:
        ev.check_protocol(claim.protocol_version, "router")
    assert str(info.value) == (
        f"router speaks expresslane protocol {ev.PROTOCOL_VERSION + 1}, this build speaks "
        f"{ev.PROTOCOL_VERSION}: run the same expresslane version on the router, coordinator, "
        "prefill and decode nodes"
    )
    assert isinstance(info.value, ValueError)
