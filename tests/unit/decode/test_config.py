"""The decode node's config: flags and EXPRESSLANE_* variables parsed once into DecodeConfig,
errors that name the flag."""

from __future__ import annotations

import pytest

from services.decode.config import DecodeConfig, build_parser, parse
from services.decode.engine import EngineConfig
from shared import config as shared_config


def config_of(argv, env=None):
    args = shared_config.parse_args(build_parser(), argv, env=env or {})
    return DecodeConfig.from_args(args).validate()


def test_flags_become_one_typed_config():
    config = config_of(["--model", "/m", "--slots", "3", "--node-id", "d1", "--max-seq-len", "512",
                        "--num-speculative-tokens", "2", "--fast-path", "off", "--heartbeat-ms", "50",
                        "--cpu-step", "off"])
    assert (config.model, config.node_id, config.heartbeat_ms) == ("/m", "d1", 50)
    assert config.engine == EngineConfig(num_slots=3, max_seq_len=512, num_speculative_tokens=2,
                                         fast_path="off", cpu_step="off")
    assert (config.num_slots, config.max_seq_len) == (3, 512)


def test_defaults_and_environment():
    config = config_of([], env={"EXPRESSLANE_MODEL": "/m", "EXPRESSLANE_SLOTS": "2"})
    assert config.num_slots == 2 and config.engine.num_speculative_tokens is None  # the checkpoint's
    assert config.node_id.startswith("decode-")
    assert config_of(["--slots", "4"], env={"EXPRESSLANE_MODEL": "/m", "EXPRESSLANE_SLOTS": "2"}).num_slots == 4


def test_kv_checksum_settings():
    assert not config_of(["--model", "/m"]).require_kv_checksum
    config = config_of(["--model", "/m", "--checksum-threads", "2"],
                       env={"EXPRESSLANE_REQUIRE_KV_CHECKSUM": "1"})
    assert config.require_kv_checksum and config.num_checksum_threads == 2
    assert config_of(["--model", "/m", "--require-kv-checksum"]).require_kv_checksum


def test_kv_cache_dtype():
    assert config_of(["--model", "/m"]).engine.kv_cache_dtype == "auto"  # the model dtype, as before
    assert config_of(["--model", "/m", "--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype == "fp8"
    assert config_of(["--model", "/m"], env={"EXPRESSLANE_KV_CACHE_DTYPE": "fp8_e5m2"}).engine.kv_cache_dtype == \
        "fp8_e5m2"


def test_cpu_nice():
    assert config_of(["--model", "/m"]).cpu_nice == 0  # a node on a host of its own: nothing to yield to
    assert config_of(["--model", "/m", "--cpu-nice", "19"]).cpu_nice == 19
    assert config_of(["--model", "/m"], env={"EXPRESSLANE_CPU_NICE": "5"}).cpu_nice == 5


def test_torch_threads():
    assert config_of(["--model", "/m"]).torch_threads == 1  # a step is many small ops: one thread
    assert config_of(["--model", "/m", "--torch-threads", "4"]).torch_threads == 4
    assert config_of(["--model", "/m"], env={"EXPRESSLANE_TORCH_THREADS": "2"}).torch_threads == 2


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "--slots must be 1 or more, got 0"),
    (["--max-seq-len", "0"], "--max-seq-len must be 1 or more"),
    (["--heartbeat-ms", "0"], "--heartbeat-ms must be 1 or more"),
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens must be 0 to 3, got 4"),
    (["--mtp-draft-vocab", "0"], "--mtp-draft-vocab must be 1 or more"),
    (["--drain-timeout-s", "-1"], "--drain-timeout-s must be 0 or more"),
    (["--checksum-threads", "0"], "--checksum-threads must be 1 or more"),
    (["--torch-threads", "0"], "--torch-threads must be 1 or more"),
    (["--cpu-nice", "20"], "--cpu-nice must be 0 to 19, got 20"),
    (["--cpu-nice", "-1"], "--cpu-nice must be 0 to 19, got -1"),
    (["--node-id", "a.b"], "--node-id: node id 'a.b' cannot be used in a NATS subject"),
])
def test_validate_names_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        config_of(["--model", "/m", *argv])


def test_parse_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--model", "/m", "--slots", "0"])
    assert info.value.code == 2
    assert "--slots must be 1 or more, got 0" in capsys.readouterr().err
