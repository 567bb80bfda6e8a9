"""``expresslane prefill``: the kv-transfer config and vLLM command it builds."""

from __future__ import annotations

import json

import pytest

from services.prefill import launch
from services.prefill.config import ExpressConfig
from services.prefill.staging import SlotStates


def test_express_config_round_trips_through_vllm_extra_config():
    config = ExpressConfig(nats_url="nats://h:1", transports=("mooncake", "nixl"), staging_slots=3,
                           stats_path="/tmp/s")
    ktc = launch.kv_transfer_config(config, engine_id="e1")
    assert ktc["kv_connector"] == "ExpressConnector" and ktc["kv_role"] == "kv_producer"
    assert ktc["kv_connector_module_path"] == "services.prefill.connector" and ktc["engine_id"] == "e1"
    assert ExpressConfig.from_extra_config(ktc["kv_connector_extra_config"]) == config


def test_native_pool_is_a_multiconnector_of_nixl_and_ours():
    ktc = launch.kv_transfer_config(ExpressConfig(), native_pool=True)
    first, second = ktc["kv_connector_extra_config"]["connectors"]
    assert ktc["kv_connector"] == "MultiConnector"
    assert first == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert second["kv_connector"] == "ExpressConnector"


@pytest.mark.parametrize("cpu,head", [(True, ["-m", "vllm.entrypoints.openai.api_server", "--model", "M"]),
                                      (False, ["serve", "M"])])
def test_vllm_command_cpu_and_gpu(cpu, head):
    cmd = launch.vllm_command("M", {"kv_connector": "X"}, port=9, cpu=cpu, extra_args=["--enforce-eager"])
    assert cmd[1:1 + len(head)] == head
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == {"kv_connector": "X"}
    assert cmd[cmd.index("--port") + 1] == "9" and cmd[-1] == "--enforce-eager"


def test_print_command_passes_vllm_args_through(capsys):
    assert launch.main(["--model", "M", "--transport", "nixl", "--print-command", "--", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert '"transports": ["nixl"]' in out and out.strip().endswith("--max-model-len 64")


def test_kv_checksum_flag_reaches_the_connector(capsys):
    assert launch.main(["--model", "M", "--kv-checksum", "--print-command"]) == 0
    assert '"kv_checksum": true' in capsys.readouterr().out
    config = ExpressConfig(kv_checksum=True, fault_flip_kv_byte_every=2)
    extra = launch.kv_transfer_config(config)["kv_connector_extra_config"]
    assert ExpressConfig.from_extra_config(extra) == config
    assert launch.main(["--model", "M", "--kv-checksum", "--fault-flip-kv-byte-every", "2",
                        "--print-command"]) == 0
    assert '"fault_flip_kv_byte_every": 2' in capsys.readouterr().out
    assert launch.main(["--model", "M", "--fault-flip-kv-byte-every", "2", "--print-command"]) == 2
    assert "set kv_checksum too" in capsys.readouterr().err
    default = launch.kv_transfer_config(ExpressConfig())["kv_connector_extra_config"]
    assert "kv_checksum" not in default and "fault_flip_kv_byte_every" not in default


def test_bad_flag_value_exits_2(capsys):
    assert launch.main(["--model", "M", "--staging-slots", "0", "--print-command"]) == 2
    assert "staging_slots" in capsys.readouterr().err


def test_stats_prints_slot_states(tmp_path, capsys):
    path = str(tmp_path / "slots")
    SlotStates(path, 2, create=True).reserve()
    assert launch.main(["--stats", path]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["total"], stats["free"], stats["reserved"]) == (2, 1, 1)


def test_cli_dispatches_prefill(capsys):
    from infra.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["prefill", "--help"])
    assert exc.value.code == 0 and "--native-pool" in capsys.readouterr().out


@pytest.mark.parametrize("env,timeout_s,want", [
    ({}, 7.5, "7"), ({}, 0.5, "1"), ({"MC_TRANSFER_TIMEOUT": "3"}, 7.5, "3"),  # the operator's wins
])
def test_mooncake_timeout_follows_the_config(env, timeout_s, want):
    config = ExpressConfig(transfer_timeout_s=timeout_s)
    assert launch.vllm_env(env, config)["MC_TRANSFER_TIMEOUT"] == want
    assert "MC_TRANSFER_TIMEOUT" not in launch.vllm_env({})  # no config: Mooncake's own default


def test_launch_starts_vllm_with_the_mooncake_timeout(monkeypatch):
    started = {}
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    monkeypatch.setattr(launch.os, "execvpe", lambda file, args, env: started.update(env=env, args=args))
    launch.main(["--model", "M", "--transfer-timeout-s", "12"])
    assert started["env"]["MC_TRANSFER_TIMEOUT"] == "12" and "M" in started["args"]
    assert "MC_TRANSFER_TIMEOUT" not in launch.os.environ  # set for vLLM, not in this process


def test_nats_credential_files_reach_the_connector_but_no_secret_does(tmp_path, capsys):
    from infra.nats_secrets import make_secrets

    secrets = make_secrets(tmp_path)
    password, ca = secrets.password_file("prefill"), secrets.ca
    password.write_text("s3cret\n")
    assert launch.main(["--model", "M", "--nats-user", "prefill", "--nats-password-file", str(password),
                        "--nats-tls-ca", str(ca), "--print-command"]) == 0
    cmd = capsys.readouterr().out
    extra = json.loads(cmd.split("--kv-transfer-config ", 1)[1].split(" --", 1)[0].strip("'"))
    extra = extra["kv_connector_extra_config"]
    assert (extra["nats_user"], extra["nats_password_file"], extra["nats_tls_ca"]) == (
        "prefill", str(password), str(ca))
    assert "s3cret" not in cmd and "nats_creds_file" not in extra
    auth = ExpressConfig.from_extra_config(extra).bus_auth()
    assert auth.connect_kwargs()["password"] == "s3cret" and auth.is_tls


def test_missing_credential_file_and_url_password_are_flagged(tmp_path, capsys):
    assert launch.main(["--model", "M", "--nats-user", "prefill", "--nats-password-file",
                        str(tmp_path / "nope"), "--print-command"]) == 2
    assert "--nats-password-file" in capsys.readouterr().err
    assert launch.main(["--model", "M", "--nats-url", "nats://prefill:pw@h:4222", "--print-command"]) == 0
    assert "warning: the password in the NATS URL" in capsys.readouterr().err


def _checkpoint(tmp_path, mtp_layers: int, dtype: str = "bfloat16") -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "torch_dtype": dtype,
                                                      "num_nextn_predict_layers": mtp_layers}))
    return str(tmp_path)


MTP = ["--speculative-config", json.dumps(launch.MTP_SPECULATIVE_CONFIG)]


@pytest.mark.parametrize("mtp_layers, ckpt_dtype, dtype, cpu, vllm_args, mode, added, said", [
    (1, "bfloat16", "auto", True, [], "auto", MTP, ""),  # CPU in bfloat16: the drafter runs
    (1, "bfloat16", "auto", False, [], "auto", MTP, ""),
    (1, "float32", "auto", False, [], "auto", MTP, ""),  # GPU builds run it in any dtype
    (1, "float32", "auto", True, [], "auto", [], "bfloat16 only"),  # CPU, float32: not
    (1, "bfloat16", "float32", True, [], "auto", [], "bfloat16 only"),
    (0, "bfloat16", "auto", True, [], "auto", [], ""),  # no MTP layers
    (1, "bfloat16", "auto", True, [], "off", [], ""),
    (1, "bfloat16", "auto", True, ["--speculative-config", "{}"], "auto", [], ""),  # the operator's wins
    (1, "bfloat16", "auto", True, ["--speculative-config={}"], "auto", [], ""),
], ids=["cpu-bf16", "gpu-bf16", "gpu-fp32", "cpu-fp32", "cpu-fp32-flag", "no-mtp", "off", "given", "given="])
def test_a_checkpoint_with_mtp_layers_starts_with_vllms_mtp_drafter(tmp_path, mtp_layers, ckpt_dtype, dtype, cpu,
                                                                    vllm_args, mode, added, said):
    args, why = launch.mtp_args(_checkpoint(tmp_path, mtp_layers, ckpt_dtype), dtype, cpu, vllm_args, mode)
    assert args == added and (said in why if said else why == "")


def test_print_command_adds_the_mtp_drafter_before_the_operators_args(tmp_path, capsys):
    model = _checkpoint(tmp_path, 1)
    assert launch.main(["--model", model, "--gpu", "--print-command", "--", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert '--speculative-config {"method": "mtp", "num_speculative_tokens": 1}' in out
    assert out.strip().endswith("--max-model-len 64")
    assert launch.main(["--model", "hub/id", "--gpu", "--print-command"]) == 0  # no local config: nothing added
    assert "--speculative-config" not in capsys.readouterr().out


@pytest.mark.parametrize("vllm_args,inline", [
    ([], True),
    (["--max-model-len", "64", "--enforce-eager"], True),
    (["--tensor-parallel-size", "1"], True),
    (["-tp", "2"], False),
    (["--tensor-parallel-size=2"], False),
    (["--pipeline-parallel-size", "2"], False),
    (["-dp", "2"], False),
    (["--distributed-executor-backend", "mp"], False),
    (["--distributed-executor-backend=uni"], False),  # the operator's choice, passed unchanged
])
def test_cpu_worker_inline_unless_more_workers_or_an_executor_is_asked_for(vllm_args, inline):
    assert launch.cpu_worker_inline(vllm_args) is inline
    cmd = launch.vllm_command("M", {}, cpu=True, extra_args=vllm_args)
    assert ("uni" in cmd[:cmd.index("--host")]) is inline  # added ahead of the operator's arguments
    assert cmd[cmd.index("--kv-transfer-config") + 2:] == vllm_args
    gpu = launch.vllm_command("M", {}, cpu=False, extra_args=vllm_args)
    assert "uni" not in gpu[:gpu.index("--host")]  # vLLM picks its uni executor itself on a GPU


def test_cpu_inline_env_keeps_what_the_operator_set():
    assert launch.vllm_env({}, cpu_inline=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in launch.vllm_env({})
    mine = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert launch.vllm_env(mine, cpu_inline=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
