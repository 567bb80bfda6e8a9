"""``expresslane up``: what it plans to start, and that stopping leaves no process behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from infra.processes import shared_host_omp_env
from infra.up import Proc, build_parser, hold_workdir, main, plan, stop_all
from services.prefill import launch
from services.router.config import build_parser as router_parser
from services.router.config import from_args as router_config
from shared.config import parse_args


def test_plan_starts_every_piece_in_order(tmp_path):
    args = build_parser().parse_args(["--decode-nodes", "2", "--port", "18123"])
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    procs, missing = plan(args, model, "nats://127.0.0.1:4999", sys.executable)
    assert [p.name for p in procs] == ["coordinator", "decode-0", "decode-1", "prefill", "router"]
    assert missing == []
    assert all("nats://127.0.0.1:4999" in " ".join(p.argv) + str(p.env) for p in procs)
    router = procs[-1].argv
    assert router[router.index("--port") + 1] == "18123"
    prefill_port = procs[3].health_url.rsplit(":", 1)[1].split("/")[0]
    assert router[router.index("--prefill-url") + 1] == f"http://127.0.0.1:{prefill_port}"
    assert all(p.health_url.endswith("/health") for p in procs)


@pytest.mark.parametrize("cores, reserved, threads", [
    (2, 3, "1"),   # two decode nodes + the control plane on two cores: one thread, never none
    (2, 1, "1"),
    (8, 3, "5"),
    (16, 0, "16"),
])
def test_shared_host_omp_env_leaves_reserved_cores_and_binds_nothing(cores, reserved, threads):
    assert shared_host_omp_env(reserved, cores) == {"OMP_NUM_THREADS": threads,
                                                    "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_prefill_vllm_gets_the_cores_the_decode_nodes_leave(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    args = build_parser().parse_args(["--decode-nodes", "2", "--decode-tp", "2"])
    prefill = {p.name: p for p in plan(args, tmp_path, "nats://x:1", sys.executable)[0]}["prefill"]
    assert prefill.env["OMP_NUM_THREADS"] == "3"  # 8 cores - 4 decode ranks - 1
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("OMP_NUM_THREADS", "6")  # the operator's setting wins
    prefill = {p.name: p for p in plan(args, tmp_path, "nats://x:1", sys.executable)[0]}["prefill"]
    assert prefill.env["OMP_NUM_THREADS"] == "6"


def test_decode_nodes_yield_the_shared_cores_to_the_prefill(tmp_path):
    from services.decode.config import parse as decode_config
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for flags, nice in (([], 19), (["--decode-nice", "0"], 0)):
        procs, _ = plan(build_parser().parse_args(["--decode-nodes", "2", *flags]), tmp_path, "nats://x:1",
                        sys.executable)
        nodes = [decode_config(p.argv[p.argv.index("decode") + 1:]) for p in procs if p.name.startswith("decode")]
        assert [n.cpu_nice for n in nodes] == [nice, nice]


def test_coordinators_flag_starts_a_leader_and_standbys_first(tmp_path):
    args = build_parser().parse_args(["--coordinators", "2", "--decode-nodes", "1"])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    procs, _ = plan(args, tmp_path, "nats://127.0.0.1:4999", sys.executable)
    assert [p.name for p in procs] == ["coordinator", "coordinator-1", "decode-0", "prefill", "router"]
    coordinators = procs[:2]
    assert all(p.argv[p.argv.index("infra.cli") + 1] == "coordinator" for p in coordinators)
    assert coordinators[0].health_url != coordinators[1].health_url  # each its own HTTP port
    assert [p.name for p in plan(build_parser().parse_args([]), tmp_path, "nats://x:1",
                                 sys.executable)[0]][:2] == ["coordinator", "decode-0"]


def test_mla_model_gets_the_cpu_mla_backend(tmp_path):
    args = build_parser().parse_args([])
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "kv_lora_rank": 512}')
    procs, _ = plan(args, tmp_path, "nats://x:1", sys.executable)
    assert "CPU_MLA" in " ".join(procs[-2].argv)


def test_stop_all_stops_process_groups(tmp_path: Path):
    # a parent that ignores SIGTERM with a child: the group is killed after the grace period
    ready = tmp_path / "ready"
    script = "import signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); " \
             f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    stubborn = Proc("stubborn", [sys.executable, "-c", script])
    polite = Proc("polite", [sys.executable, "-c", "import time; time.sleep(60)"])
    for p in (stubborn, polite):
        p.start(tmp_path)
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    killed = stop_all([stubborn, polite], grace_s=1.0)
    assert killed == ["stubborn"]
    assert not stubborn.group_alive() and not polite.group_alive()


def test_secure_plan_gives_each_service_its_own_credential_files_and_no_secret(tmp_path):
    from infra.nats_secrets import make_secrets
    from services.coordinator.config import build_parser as coordinator_parser
    from services.coordinator.config import from_args as coordinator_config
    from services.decode.config import parse as decode_config
    from services.prefill import launch
    from services.router.config import build_parser as router_parser
    from services.router.config import from_args as router_config
    from shared.config import parse_args

    secrets = make_secrets(tmp_path / "secrets")
    args = build_parser().parse_args(["--secure", "--decode-nodes", "1"])
    assert args.secure
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    procs, _ = plan(args, model, "nats://127.0.0.1:4999", sys.executable, secrets.client_args)
    passwords = [secrets.password_file(u).read_text().strip() for u in ("router", "coordinator",
                                                                         "decode", "prefill")]
    for proc in procs:
        shown = " ".join(proc.argv) + str(proc.env)
        assert not any(pw in shown for pw in passwords), proc.name
    argv = {p.name: p.argv[p.argv.index(p.name.split("-")[0]) + 1:] for p in procs}
    router = router_config(parse_args(router_parser(), argv["router"], env={}))
    coordinator = coordinator_config(parse_args(coordinator_parser(), argv["coordinator"], env={}))
    decode = decode_config(argv["decode-0"])
    prefill_args = launch.build_parser().parse_args(argv["prefill"][:argv["prefill"].index("--")])
    for user, auth in (("router", router.bus_auth), ("coordinator", coordinator.bus_auth),
                       ("decode", decode.bus_auth)):
        assert (auth.user, auth.password_file, auth.tls_ca) == (
            user, str(secrets.password_file(user)), str(secrets.ca)), user
        assert auth.connect_kwargs()["password"] == secrets.password_file(user).read_text().strip()
    assert (prefill_args.nats_user, prefill_args.nats_password_file) == (
        "prefill", str(secrets.password_file("prefill")))


def test_nats_cluster_gives_the_coordinator_three_replicas(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for flags, replicas in (([], None), (["--nats-cluster", "3"], "3")):
        procs, _ = plan(build_parser().parse_args(flags), tmp_path, "nats://a:1,nats://b:2",
                        sys.executable)
        argv = procs[0].argv
        assert (argv[argv.index("--js-replicas") + 1] if "--js-replicas" in argv else None) == replicas
        assert "nats://a:1,nats://b:2" in argv


def test_vllm_args_reach_the_prefill_and_their_parsers_the_router(tmp_path):
    from infra.up import parse_args as up_args

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    vllm = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser=qwen3",
            "--tool-strict-level", "function", "--max-num-seqs", "4"]
    procs, _ = plan(up_args(["--decode-nodes", "1", "--", *vllm]), tmp_path, "nats://x:1", sys.executable)
    argv = {p.name: p.argv for p in procs}
    prefill = argv["prefill"]
    assert prefill[-len(vllm):] == vllm  # after expresslane's own vLLM flags, so the operator's win
    router = router_config(parse_args(router_parser(), argv["router"][argv["router"].index("router") + 1:],
                                      env={}))
    assert (router.tool_call_parser, router.reasoning_parser, router.enable_auto_tool_choice,
            router.tool_strict_level) == ("hermes", "qwen3", True, "function")
    via_env = router_config(parse_args(router_parser(), [], env={"EXPRESSLANE_VLLM_ARGS": " ".join(vllm)}))
    assert (via_env.tool_call_parser, via_env.reasoning_parser, via_env.enable_auto_tool_choice,
            via_env.tool_strict_level) == ("hermes", "qwen3", True, "function")


@pytest.mark.parametrize("vllm,message", [
    (["--tool-call-parser", "hermes2000"], "--tool-call-parser 'hermes2000' is not one of vLLM's"),
    (["--reasoning-parser=nope"], "--reasoning-parser 'nope' is not one of vLLM's"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
])
def test_unknown_parser_stops_up_and_prefill(vllm, message, capsys):
    from infra.up import parse_args as up_args

    with pytest.raises(SystemExit) as info:
        up_args(["--", *vllm])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert launch.main(["--model", "m", "--print-command", "--", *vllm]) == 2
    assert message in capsys.readouterr().err


def test_a_second_up_on_the_same_workdir_stops_before_touching_it(tmp_path, capsys):
    first = hold_workdir(tmp_path)
    assert main(["--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "another 'expresslane up'" in err and str(tmp_path) in err and "--workdir" in err
    assert not (tmp_path / "nats").exists() and not (tmp_path / "logs").exists()
    first.close()  # the first stack ends: the workdir is free again
    again = hold_workdir(tmp_path)
    assert (tmp_path / "up.lock").read_text().strip().isdigit()
    again.close()
