"""Lane policy: precedence of header, tenant, model and default; capability and capacity gates."""

from __future__ import annotations

import pytest

from services.router.errors import ApiError
from services.router.policy import LaneInputs, PolicyConfig, choose_lane, parse_lane_table

CFG = PolicyConfig(
    default_lane="express",
    tenant_lanes={"batch-co": "standard", "vip": "express"},
    model_lanes={"big": "standard"},
)
LIVE = dict(slot_capacity=2048, num_prompt_tokens=10, max_tokens=16)

CASES = [
    # (config, inputs, expected lane, reason contains)
    (CFG, LaneInputs(model="m", **LIVE), "express", "default"),
    (CFG, LaneInputs(model="m", header="off", **LIVE), "standard", "header"),
    (CFG, LaneInputs(model="m", header="ON", **LIVE), "express", "header"),
    (CFG, LaneInputs(model="m", tenant="batch-co", **LIVE), "standard", "tenant"),
    (CFG, LaneInputs(model="m", tenant="batch-co", header="on", **LIVE), "express", "header"),
    (CFG, LaneInputs(model="big", **LIVE), "standard", "model"),
    (CFG, LaneInputs(model="big", tenant="vip", **LIVE), "express", "tenant"),
    (PolicyConfig(default_lane="standard"), LaneInputs(model="m", **LIVE), "standard", "default"),
    (PolicyConfig(header_override=False), LaneInputs(model="m", header="off", **LIVE), "express", "default"),
    (CFG, LaneInputs(model="m", blockers=("n", "logprobs"), **LIVE), "standard", "unsupported: n, logprobs"),
    (CFG, LaneInputs(model="m", header="off", blockers=("n",), **LIVE), "standard", "header"),
    (CFG, LaneInputs(model="m", slot_capacity=None, num_prompt_tokens=10, max_tokens=16), "standard", "no live"),
    (CFG, LaneInputs(model="m", slot_capacity=2048, num_prompt_tokens=10, max_tokens=1), "standard", "max_tokens=1"),
    (CFG, LaneInputs(model="m", slot_capacity=64, num_prompt_tokens=50, max_tokens=14), "express", "default"),
    (CFG, LaneInputs(model="m", slot_capacity=64, num_prompt_tokens=50, max_tokens=15), "standard", "fit"),
]


@pytest.mark.parametrize("cfg,inp,lane,reason", CASES)
def test_choose_lane(cfg, inp, lane, reason):
    decision = choose_lane(cfg, inp)
    assert decision.lane == lane
    assert reason in decision.reason


def test_gate_reject_is_400_naming_params():
    cfg = PolicyConfig(capability_gate="reject")
    with pytest.raises(ApiError) as info:
        choose_lane(cfg, LaneInputs(model="m", blockers=("logit_bias",), **LIVE))
    assert info.value.status == 400 and info.value.param == "logit_bias"
    assert "logit_bias" in info.value.message
    # a standard-lane request is not gated: vLLM honours the parameter
    assert choose_lane(cfg, LaneInputs(model="m", header="off", blockers=("n",), **LIVE)).lane == "standard"


def test_bad_header_is_400():
    with pytest.raises(ApiError) as info:
        choose_lane(CFG, LaneInputs(model="m", header="maybe", **LIVE))
    assert info.value.status == 400


@pytest.mark.parametrize("text,table", [
    ("", {}), ("a=express", {"a": "express"}), (" a = standard , b=express ", {"a": "standard", "b": "express"}),
])
def test_parse_lane_table(text, table):
    assert parse_lane_table(text) == table


@pytest.mark.parametrize("text", ["a", "a=fast", "=express"])
def test_parse_lane_table_errors(text):
    with pytest.raises(ValueError):
        parse_lane_table(text)


def test_config_validate():
    with pytest.raises(ValueError):
        PolicyConfig(default_lane="fast").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PolicyConfig(capability_gate="drop").validate()  # type: ignore[arg-type]
    assert CFG.validate() is CFG
