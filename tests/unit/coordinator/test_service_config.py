"""The coordinator's one config object: flags and EXPRESSLANE_* variables in, checked settings out."""

from __future__ import annotations

import pytest

from services.coordinator.config import CoordinatorServiceConfig, build_parser, from_args
from services.coordinator.leadership import LeadershipConfig
from services.coordinator.model import CoordinatorConfig
from shared import config as shared_config


def parse(argv: list[str], env: dict[str, str] | None = None) -> CoordinatorServiceConfig:
    return from_args(shared_config.parse_args(build_parser(), argv, env=env or {}))


def test_defaults_are_the_dataclass_defaults():
    assert parse([]) == CoordinatorServiceConfig()


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["--http-port", "0", "--tick-ms", "20"], {}, dict(http_port=0, tick_ms=20)),
        ([], {"EXPRESSLANE_NATS_URL": "nats://coordinator:pw@nats:4222",
              "EXPRESSLANE_LOG_FORMAT": "console", "EXPRESSLANE_LOG_LEVEL": "debug"},
         dict(nats_url="nats://coordinator:pw@nats:4222", log_format="console", log_level="DEBUG")),
        (["--kv-bucket", "b1", "--inbox-stream", "S1"], {}, dict(kv_bucket="b1", inbox_stream="S1")),
        (["--compact-interval-s", "1"], {"EXPRESSLANE_COMPACT_INTERVAL_S": "5",
                                         "EXPRESSLANE_COORDINATOR_ID": "coord-b"},
         dict(compact_interval_s=1.0, coordinator_id="coord-b")),
        (["--leader-ttl-ms", "3000"], {"EXPRESSLANE_LEADER_RENEW_MS": "500"},
         dict(leader=LeadershipConfig(ttl_ms=3000, renew_ms=500))),
    ],
)
def test_service_settings_from_flags_and_env(argv, env, expected):
    config = parse(argv, env)
    assert {k: getattr(config, k) for k in expected} == expected


def test_core_settings_ride_along():
    config = parse(["--max-queue", "1", "--retry-after-ms", "750"], {"EXPRESSLANE_FENCE_GRACE_MS": "0"})
    assert config.core == CoordinatorConfig(max_queue=1, retry_after_ms=750, fence_grace_ms=0)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--tick-ms", "0"], {}, "argument --tick-ms: 0 must be a whole number above 0"),
        ([], {"EXPRESSLANE_HTTP_PORT": "70000"}, "(the variable for --http-port): 70000 is not a port"),
        (["--compact-interval-s", "0"], {}, "argument --compact-interval-s: 0 must be a number above 0"),
        (["--leader-ttl-ms", "500"], {}, "--leader-ttl-ms (500) minus --leader-margin-ms (300) "
         "must leave room for two renewals"),
        (["--leader-margin-ms", "-1"], {}, "--leader-margin-ms must be >= 0, got -1"),
        (["--kv-bucket", "xl.coord"], {}, "--kv-bucket 'xl.coord' is not a JetStream name"),
        (["--inbox-stream", "a b"], {}, "--inbox-stream 'a b' is not a JetStream name"),
        (["--heartbeat-misses", "0"], {}, "heartbeat_misses must be >= 1, got 0"),
        (["--tick-ms", "500"], {}, "--max-tick-gap-ms (500) must exceed --tick-ms (500)"),
        ([], {"EXPRESSLANE_MAX_QUEUE": "-1"}, "max_queue must be >= 0, got -1"),
    ],
)
def test_bad_settings_exit_2_naming_the_setting(argv, env, message, monkeypatch, capsys):
    from services.coordinator import service

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        service.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    flags = ["--nats-url", "--log-level", "--log-format", "--http-host", "--http-port", "--kv-bucket",
             "--inbox-stream", "--tick-ms", "--compact-interval-s", "--coordinator-id",
             "--leader-ttl-ms", "--leader-renew-ms", "--leader-margin-ms"]
    flags += ["--" + name.replace("_", "-") for name in CoordinatorConfig.__dataclass_fields__]
    assert all(flag in text for flag in flags)
