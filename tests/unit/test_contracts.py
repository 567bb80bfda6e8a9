"""Every cross-service contract is defined once, in shared/, and each side reads what the other
builds: the router's hand-off through the prefill connector's parser, the connector's status
through the router's parser, a router's claim through the coordinator's model matcher."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from services.coordinator.model import CoordinatorConfig
from services.coordinator.registry import NodeRegistry
from services.prefill.scheduler import ExpressScheduler
from services.router.backend import ModelInfo
from services.router.express import claim_request, handoff_params
from services.router.nodes import NodeTable
from shared import events as ev
from shared.handoff import KEY, Handoff, HandoffStatus, not_handed_off_reason, parse_status, status_params
from shared.kvlayout import KvShape, layout_spec

REPO = Path(__file__).resolve().parents[2]
LAYOUT = layout_spec(KvShape(kind="gqa", num_layers=2, num_kv_heads=2, head_dim=8), "float32", 64)
TARGET = ev.TransferTarget(node_id="n0", transport="mooncake", endpoint="127.0.0.1:17001",
                           slot=ev.SlotTarget(slot=1, base_addr=0x7F0000001000, nbytes=LAYOUT.slot_nbytes),
                           layout=LAYOUT)
GRANT = ev.ClaimGranted(request_id="r1", lease_id="lease-1", generation=4, node_id="n0",
                        expires_at_ms=1_764_400_000_000, target=TARGET)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Slots:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self.counts: dict[str, int] = {}

    def reserve(self) -> int | None:
        return self.free.pop(0) if self.free else None

    def count(self, counter: str, n: int = 1) -> None:
        self.counts[counter] = self.counts.get(counter, 0) + n


def over_http(params: dict) -> dict:
    """What the other side sees: the dict as JSON, through vLLM's request or response."""
    return msgspec.json.decode(msgspec.json.encode(params))


# ---------------------------------------------------------------- kv_transfer_params: request


def test_router_handoff_is_what_the_prefill_stages():
    sched = ExpressScheduler(Slots(1), max_tokens=64)
    sched.on_alloc("vllm-r1", over_http(handoff_params(GRANT, TRACEPARENT)), 5)
    (save,) = sched.on_step([("vllm-r1", ([3],), 0)], [], {"vllm-r1": 5})
    assert save.fail_reason == "" and save.staging_slot == 0
    assert save.handoff == Handoff(request_id="r1", lease_id="lease-1", generation=4, target=TARGET,
                                   traceparent=TRACEPARENT, expires_at_ms=GRANT.expires_at_ms)
    assert save.handoff == Handoff.from_grant(GRANT, TRACEPARENT)
    assert parse_status(sched.on_finished("vllm-r1")).handed_off is True
    assert sched.num_claims == 0 and not sched.has_work  # nothing left behind


def test_other_connectors_params_are_not_claimed():
    sched = ExpressScheduler(Slots(1), max_tokens=64)
    sched.on_alloc("x", over_http({"do_remote_decode": True}), 5)
    assert sched.on_finished("x") is None and sched.num_claims == 0
    assert not_handed_off_reason({"remote_block_ids": [1], "remote_engine_id": "e"}) == ""


# ---------------------------------------------------------------- kv_transfer_params: response

# (staging slots, staging max tokens, prompt tokens, params, finishes before its prompt is
# computed, what the router hears: "" when handed off, else a piece of the reason)
STATUS_CASES = [
    (1, 64, 5, True, False, ""),
    (0, 64, 5, True, False, "no free staging slot"),
    (1, 4, 5, True, False, "exceeds the staging slot size"),
    (1, 64, 5, True, True, "before its prompt was computed"),
    (1, 64, 5, False, False, "invalid expresslane kv_transfer_params"),
]


@pytest.mark.parametrize("num_slots,max_tokens,num_prompt,valid,early,heard", STATUS_CASES)
def test_prefill_status_is_what_the_router_reads(num_slots, max_tokens, num_prompt, valid, early, heard):
    slots = Slots(num_slots)
    sched = ExpressScheduler(slots, max_tokens=max_tokens)
    # A malformed request on purpose for the last case: the connector must answer, not raise.
    params = handoff_params(GRANT, TRACEPARENT) if valid else {KEY: {"request_id": "r1"}}
    sched.on_alloc("vllm-r1", over_http(params), num_prompt)
    if not early:
        sched.on_step([("vllm-r1", ([3],), 0)], [], {"vllm-r1": num_prompt})
    response = over_http(sched.on_finished("vllm-r1"))
    status = parse_status(response)
    assert status.request_id == ("r1" if valid else "vllm-r1")  # unreadable: vLLM's own id
    assert status.handed_off is (heard == "")
    reason = not_handed_off_reason(response)
    assert (reason == "") if heard == "" else (heard in reason)
    assert sched.num_claims == 0  # the claim is gone; the staged slot belongs to the sender now


@pytest.mark.parametrize("status,handed_off", [
    (HandoffStatus(request_id="r1", handed_off=True, num_tokens=5, staging_slot=0), True),
    (HandoffStatus(request_id="r1", handed_off=False, reason="no free staging slot"), False),
])
def test_status_round_trips(status, handed_off):
    assert parse_status(over_http(status_params(status))) == status
    assert (not_handed_off_reason(status_params(status)) == "") is handed_off


@pytest.mark.parametrize("params", [None, {}, {"other": 1}])
def test_no_status_leaves_the_router_waiting_for_the_kv(params):
    assert parse_status(params) is None and not_handed_off_reason(params) == ""


def test_an_unreadable_status_is_not_handed_off():
    assert "unreadable" in not_handed_off_reason({KEY: {"handed_off": "maybe"}})


# ---------------------------------------------------------------- model names

# (model a node advertises, name vLLM serves the model under, checkpoint path, served?)
ALIAS_CASES = [
    ("tiny-llama", "tiny-llama", "/m/tiny-llama", True),
    ("tiny-llama", "/m/tiny-llama", "/m/tiny-llama", True),  # vLLM's default name: the path
    ("tiny-llama", "chat", "/m/tiny-llama/", True),  # a --served-model-name, the directory matches
    ("/m/tiny-llama", "chat", "/m/tiny-llama", True),
    ("/other/tiny-llama/", "chat", "/m/tiny-llama", True),
    ("chat", "chat", "/m/tiny-llama", True),
    ("llama", "chat", "/m/tiny-llama", False),
    ("other", "tiny-llama", "", False),
]


def heartbeat(model: str) -> ev.NodeAvailable:
    return ev.NodeAvailable(node_id="n0", model=model, protocol_version=ev.PROTOCOL_VERSION, total_slots=1,
                            free_slots=[0], transports=["mooncake"], endpoints={"mooncake": "127.0.0.1:1"},
                            slots=[TARGET.slot], layout=LAYOUT, heartbeat_interval_ms=1000, seq=1,
                            sent_at_ms=0)


@pytest.mark.parametrize("node_model,served,root,ok", ALIAS_CASES)
def test_router_and_coordinator_agree_on_model_names(node_model, served, root, ok):
    info = ModelInfo(name=served, root=root, url="http://prefill", max_model_len=64)
    table = NodeTable()
    table.observe(heartbeat(node_model), 0.0)
    router_sees = bool(table.live(0.0, info.aliases))

    claim = claim_request(info, "r1", num_prompt_tokens=5, max_tokens=8, wait_ms=100)
    claim = ev.decode_any(ev.encode(claim))  # over NATS
    registry = NodeRegistry(CoordinatorConfig())
    registry.heartbeat(heartbeat(node_model), 0)
    coordinator_grants = registry.transport_for(registry.nodes["n0"], claim) is not None

    assert router_sees is coordinator_grants is ok


# ---------------------------------------------------------------- defined once

HAND_BUILT = re.compile(r"""\{\s*["']expresslane["']\s*:|\[\s*["']expresslane["']\s*\]|\.get\(\s*["']expresslane["']""")


def test_no_hand_built_handoff_outside_shared():
    """The hand-off dict is built and read only through shared.handoff (tests may send a malformed
    one on purpose)."""
    offenders = [str(p.relative_to(REPO)) for top in ("services", "shared", "infra", "bench")
                 for p in sorted((REPO / top).rglob("*.py"))
                 if p != REPO / "shared" / "handoff.py" and HAND_BUILT.search(p.read_text())]
    assert offenders == []
