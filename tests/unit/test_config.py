"""Flags and EXPRESSLANE_* variables: precedence, conversion, and errors that name what to fix."""

from __future__ import annotations

import argparse

import pytest

from shared import config
from shared.tracing import otlp_traces_endpoint


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expresslane test")
    config.add_common_args(parser)
    parser.add_argument("--num-slots", type=config.positive_int, default=1)
    parser.add_argument("--heartbeat-s", type=config.positive_float, default=0.5)
    parser.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--enable-mtp", action="store_true")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    return parser


BASE = ["--model-dir", "/m"]


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (BASE, {}, dict(nats_url="nats://127.0.0.1:4222", log_level="INFO", log_format="json",
                        num_slots=1, heartbeat_s=0.5, transport="mooncake", enable_mtp=False,
                        warmup=True, stop_token_ids=[])),
        (BASE, {"EXPRESSLANE_NUM_SLOTS": "4", "EXPRESSLANE_LOG_LEVEL": "debug"},
         dict(num_slots=4, log_level="DEBUG")),
        (BASE + ["--num-slots", "2"], {"EXPRESSLANE_NUM_SLOTS": "4"}, dict(num_slots=2)),
        ([], {"EXPRESSLANE_MODEL_DIR": "/env/model"}, dict(model_dir="/env/model")),
        (BASE, {"EXPRESSLANE_ENABLE_MTP": "yes", "EXPRESSLANE_NO_WARMUP": "1"},
         dict(enable_mtp=True, warmup=False)),
        (BASE, {"EXPRESSLANE_ENABLE_MTP": "off"}, dict(enable_mtp=False)),
        (BASE, {"EXPRESSLANE_STOP_TOKEN_IDS": "2, 7"}, dict(stop_token_ids=[2, 7])),
        (BASE, {"EXPRESSLANE_NATS_URL": "nats://router:pw@nats:4222,nats://nats-2:4222"},
         dict(nats_url="nats://router:pw@nats:4222,nats://nats-2:4222")),
        (BASE, {"EXPRESSLANE_TRANSPORT": "nixl", "EXPRESSLANE_HEARTBEAT_S": "0.25"},
         dict(transport="nixl", heartbeat_s=0.25)),
        (BASE, {"UNRELATED": "x", "EXPRESSLANE_UNKNOWN_FLAG": "y"}, dict(num_slots=1)),
    ],
)
def test_flags_and_env(argv, env, expected):
    args = config.parse_args(make_parser(), argv, env=env)
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (BASE, {"EXPRESSLANE_NUM_SLOTS": "0"},
         "EXPRESSLANE_NUM_SLOTS='0' (the variable for --num-slots): 0 must be a whole number above 0"),
        (BASE, {"EXPRESSLANE_NUM_SLOTS": "two"},
         "EXPRESSLANE_NUM_SLOTS='two' (the variable for --num-slots): not a valid positive_int"),
        (BASE, {"EXPRESSLANE_TRANSPORT": "rdma"},
         "EXPRESSLANE_TRANSPORT='rdma' (the variable for --transport): choose from mooncake, nixl"),
        (BASE, {"EXPRESSLANE_LOG_LEVEL": "loud"},
         "EXPRESSLANE_LOG_LEVEL='loud' (the variable for --log-level): choose from DEBUG, INFO, "
         "WARNING, ERROR"),
        (BASE, {"EXPRESSLANE_ENABLE_MTP": "maybe"},
         "EXPRESSLANE_ENABLE_MTP='maybe' (the variable for --enable-mtp): use one of "
         "1/true/yes/on or 0/false/no/off"),
        (BASE, {"EXPRESSLANE_NATS_URL": "http://nats:4222"},
         "(the variable for --nats-url): 'http://nats:4222' is not a NATS URL: use nats://HOST:PORT"),
        (BASE + ["--nats-url", "127.0.0.1:4222"], {},
         "argument --nats-url: '127.0.0.1:4222' is not a NATS URL"),
        (BASE + ["--heartbeat-s", "-1"], {}, "argument --heartbeat-s: -1 must be a number above 0"),
        ([], {}, "the following arguments are required: --model-dir"),
    ],
)
def test_bad_values_exit_2_naming_flag_and_variable(argv, env, message, capsys):
    with pytest.raises(SystemExit) as info:
        config.parse_args(make_parser(), argv, env=env)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_parser_is_reusable_across_environments():
    parser = make_parser()
    first = config.parse_args(parser, [], env={"EXPRESSLANE_MODEL_DIR": "/a", "EXPRESSLANE_NUM_SLOTS": "3"})
    second = config.parse_args(parser, BASE, env={})
    assert (first.model_dir, first.num_slots) == ("/a", 3)
    assert (second.model_dir, second.num_slots) == ("/m", 1)
    with pytest.raises(SystemExit):  # --model-dir is required again without its variable
        config.parse_args(parser, [], env={})


def test_append_flag_replaces_the_variable():
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", action="append", choices=["mooncake", "nixl"])
    env = {"EXPRESSLANE_TRANSPORT": "mooncake,nixl"}
    assert config.parse_args(parser, [], env=env).transport == ["mooncake", "nixl"]
    assert config.parse_args(parser, ["--transport", "nixl"], env=env).transport == ["nixl"]
    assert config.parse_args(parser, [], env={}).transport is None


def test_password_in_a_bad_url_is_not_echoed(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(make_parser(), BASE + ["--nats-url", "http://u:s3cret@nats:4222"], env={})
    err = capsys.readouterr().err
    assert "'nats:4222' is not a NATS URL" in err and "s3cret" not in err
    with pytest.raises(SystemExit):
        config.parse_args(make_parser(), BASE, env={"EXPRESSLANE_NATS_URL": "http://u:s3cret@n:1"})
    err = capsys.readouterr().err
    assert "EXPRESSLANE_NATS_URL='http://u:***@n:1'" in err and "s3cret" not in err


def test_help_names_the_variables(capsys):
    with pytest.raises(SystemExit) as info:
        config.parse_args(make_parser(), ["--help"], env={})
    assert info.value.code == 0
    assert "EXPRESSLANE_FOO_BAR" in capsys.readouterr().out


@pytest.mark.parametrize("flag, name", [("--nats-url", "EXPRESSLANE_NATS_URL"),
                                        ("--num-slots", "EXPRESSLANE_NUM_SLOTS"),
                                        ("--x", "EXPRESSLANE_X")])
def test_env_var_name(flag, name):
    assert config.env_var(flag) == name


@pytest.mark.parametrize(
    "env, endpoint",
    [
        ({}, ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, "http://jaeger:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318/"}, "http://jaeger:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4318/custom"}, "http://b:4318/custom"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_TRACES_EXPORTER": "none"}, ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_SDK_DISABLED": "true"}, ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_TRACES_EXPORTER": "console,otlp"},
         "http://a:4318/v1/traces"),
    ],
)
def test_otel_endpoint_from_standard_variables(env, endpoint):
    assert otlp_traces_endpoint(env) == endpoint


def test_bus_auth_files_come_from_flags_or_variables(tmp_path):
    password = tmp_path / "router.password"
    password.write_text("s3cret\n")
    env = {"EXPRESSLANE_NATS_USER": "router", "EXPRESSLANE_NATS_PASSWORD_FILE": str(password)}
    auth = config.bus_auth(config.parse_args(make_parser(), BASE, env=env))
    assert (auth.user, auth.password_file, auth.is_tls) == ("router", str(password), False)
    assert auth.connect_kwargs() == {"user": "router", "password": "s3cret"}
    assert config.bus_auth(config.parse_args(make_parser(), BASE, env={})).connect_kwargs() == {}


@pytest.mark.parametrize("argv, message", [
    (["--nats-user", "router"], "--nats-user router needs --nats-password-file"),
    (["--nats-password-file", "PW"], "--nats-password-file needs --nats-user"),
    (["--nats-user", "router", "--nats-password-file", "/nope"], "--nats-password-file /nope: no such"),
    (["--nats-user", "r", "--nats-password-file", "PW", "--nats-creds-file", "PW"], "give one"),
    (["--nats-tls-cert", "PW"], "--nats-tls-cert and --nats-tls-key go together"),
    (["--nats-tls-ca", "/nope/ca.pem"], "--nats-tls-ca /nope/ca.pem: no such readable file"),
])
def test_bus_auth_errors_name_the_flag(tmp_path, argv, message):
    (tmp_path / "pw").write_text("x")
    argv = [str(tmp_path / "pw") if a == "PW" else a for a in argv]
    with pytest.raises(ValueError, match=message.replace("PW", str(tmp_path / "pw"))):
        config.bus_auth(config.parse_args(make_parser(), BASE + argv, env={}))


def test_password_in_a_nats_url_flag_is_warned_about(capsys):
    config.parse_args(make_parser(), BASE + ["--nats-url", "nats://router:pw@h:4222"], env={})
    err = capsys.readouterr().err
    assert "warning: --nats-url carries a password" in err and "pw@" not in err
    config.parse_args(make_parser(), BASE, env={"EXPRESSLANE_NATS_URL": "nats://router:pw@h:4222"})
    config.parse_args(make_parser(), BASE + ["--nats-url", "nats://h:4222"], env={})
    assert capsys.readouterr().err == ""  # the variable is the place for it
