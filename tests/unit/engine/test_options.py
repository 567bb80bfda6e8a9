"""The engine's settings object: validation names the setting, drafts default to the checkpoint's."""

from __future__ import annotations

import pytest

from services.decode.engine import EngineConfig


@pytest.mark.parametrize("settings, message", [
    ({"num_slots": 0}, "num_slots must be 1 or more, got 0"),
    ({"max_seq_len": 0}, "max_seq_len must be 1 or more"),
    ({"fast_path": "maybe"}, "fast_path must be one of auto, on, off"),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens must be 0..3, got 4"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens must be 0..3"),
    ({"fast_path_tokens_per_step": 0}, "fast_path_tokens_per_step must be 1 or more"),
])
def test_validate_names_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings).validate()


@pytest.mark.parametrize("num_spec, raw, want", [
    (None, {"num_nextn_predict_layers": 1}, 1),  # one draft per MTP layer
    (None, {"num_nextn_predict_layers": 5}, 3),  # at most 3
    (None, {"num_nextn_predict_layers": None}, 0),
    (None, {}, 0),  # no MTP layers
    (2, {"num_nextn_predict_layers": 1}, 2),  # as set
    (0, {"num_nextn_predict_layers": 1}, 0),
])
def test_drafts_default_to_one_per_mtp_layer(num_spec, raw, want):
    config = EngineConfig(num_speculative_tokens=num_spec).validate()
    assert config.resolved_num_speculative_tokens(raw) == want
