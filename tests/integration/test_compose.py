"""docker-compose.yml validates with the real docker-compose (no engine needed) and wires the
stack as designed: health checks, depends_on conditions, one NATS user per service,
the nats-box tool under a profile."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NATS_MEMBERS = ("nats", "nats-1", "nats-2")  # one JetStream cluster
LONG_RUNNING = {*NATS_MEMBERS, "prefill", "coordinator", "coordinator-1", "decode-0", "decode-1", "router"}


def docker_compose(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    assert binary, ("docker-compose is missing: `apt-get install -y --no-install-recommends "
                    "docker-compose` (infra/install.sh does it)")
    return subprocess.run([binary, "-f", str(COMPOSE), *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def stack() -> dict:
    result = docker_compose("--profile", "tools", "config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def container_ports(service: dict) -> set[int]:
    """Container ports of ``ports`` entries ("127.0.0.1:8000:8000" or the long form)."""
    return {p["target"] if isinstance(p, dict) else int(str(p).rsplit(":", 1)[-1].split("/")[0])
            for p in service["ports"]}


def test_compose_file_validates():
    result = docker_compose("config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_services_and_profiles(stack):
    assert set(stack) == LONG_RUNNING | {"jaeger", "model", "nats-box", "events", "decode-tp"}
    assert stack["nats-box"]["profiles"] == ["tools"] and stack["events"]["profiles"] == ["tools"]
    assert stack["decode-tp"]["profiles"] == ["tp"]
    for name in LONG_RUNNING | {"jaeger", "model"}:  # what `docker compose up` starts
        assert "profiles" not in stack[name], name


def test_tensor_parallel_decode_node_is_its_own_profile():
    result = docker_compose("--profile", "tp", "config")
    assert result.returncode == 0, result.stderr
    svc = yaml.safe_load(result.stdout)["services"]["decode-tp"]
    assert svc["profiles"] == ["tp"] and "--tensor-parallel-size=2" in svc["command"]
    assert "--fast-path=on" not in svc["command"]  # a tensor-parallel node runs the reference step
    assert len(svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) == 2


def test_health_checks_and_start_order(stack):
    for name in LONG_RUNNING:
        assert stack[name]["healthcheck"]["test"][0] == "CMD", name
    deps = {name: {dep: c["condition"] for dep, c in svc.get("depends_on", {}).items()}
            for name, svc in stack.items()}
    assert deps["router"] == {dep: "service_healthy" for dep in
                              ("nats", "coordinator", "prefill", "decode-0", "decode-1")}
    for name in ("prefill", "decode-0", "decode-1"):
        assert deps[name]["model"] == "service_completed_successfully"
        assert deps[name]["nats"] == "service_healthy"
    assert deps["decode-0"]["coordinator"] == "service_healthy"
    assert "healthz?js-enabled-only=true" in stack["nats"]["healthcheck"]["test"][-1]


def test_each_service_uses_its_own_nats_user(stack):
    users = re.findall(r"^\s*user: (\w+)$", (ROOT / "infra/nats/nats.conf").read_text(), re.M)
    assert sorted(users) == ["coordinator", "decode", "prefill", "router", "tools"]
    expected = {"router": "router", "coordinator": "coordinator", "coordinator-1": "coordinator",
                "decode-0": "decode",
                "decode-1": "decode", "prefill": "prefill", "events": "tools"}
    nats_env = stack["nats"]["environment"]
    for name, user in expected.items():  # every member of the cluster, the same user
        urls = [urllib.parse.urlsplit(u) for u in
                stack[name]["environment"]["EXPRESSLANE_NATS_URL"].split(",")]
        assert [(u.hostname, u.port, u.username) for u in urls] == [
            (member, 4222, user) for member in NATS_MEMBERS], name
        assert {u.password for u in urls} == {nats_env[f"XL_NATS_{user.upper()}_PASSWORD"]}, name
    box = urllib.parse.urlsplit(stack["nats-box"]["environment"]["NATS_URL"].split(",")[0])
    assert (box.username, box.password) == ("tools", nats_env["XL_NATS_TOOLS_PASSWORD"])
    for member in NATS_MEMBERS:
        command = stack[member]["command"]
        assert "-js" in command and "-m" in command, member
        assert command[command.index("--cluster_name") + 1] == "expresslane", member
        assert command[command.index("--routes") + 1] == ",".join(
            f"nats://{m}:6222" for m in NATS_MEMBERS), member
    # the coordinator's state survives losing a member: three replicas, all members up first
    assert stack["coordinator"]["environment"]["EXPRESSLANE_JS_REPLICAS"] == "3"
    assert {m for m in NATS_MEMBERS if m in stack["coordinator"]["depends_on"]} == set(NATS_MEMBERS)


def test_tracing_and_ports(stack):
    for name in ("router", "coordinator", "coordinator-1", "prefill", "decode-0", "decode-1"):
        assert stack[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert "OTEL_SERVICE_NAME" not in stack[name]["environment"]
    assert container_ports(stack["jaeger"]) == {4317, 4318, 16686}
    assert container_ports(stack["router"]) == {8000}
    assert container_ports(stack["nats"]) == {4222, 8222}
    node_ids = [next(a for a in stack[n]["command"] if a.startswith("--node-id="))
                for n in ("decode-0", "decode-1")]
    assert node_ids == ["--node-id=decode-0", "--node-id=decode-1"]


def test_two_coordinators_one_leads_one_stands_by(stack):
    leader, standby = stack["coordinator"], stack["coordinator-1"]
    assert standby["command"] == leader["command"] and standby["image"] == leader["image"]
    assert standby["restart"] == "unless-stopped" and "ports" not in standby
    assert standby["depends_on"]["nats"]["condition"] == "service_healthy"


def test_dockerfiles_exist_and_copy_what_exists(stack):
    dockerfiles = {Path(svc["build"]["dockerfile"]) for svc in stack.values() if "build" in svc}
    assert {d.name for d in dockerfiles} == {"service.Dockerfile", "decode.Dockerfile",
                                             "prefill.Dockerfile"}
    for dockerfile in dockerfiles:
        text = (ROOT / dockerfile).read_text()
        assert (ROOT / f"{dockerfile}.dockerignore").is_file()  # keeps .venv out of the context
        for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
            for path in source.split():
                assert (ROOT / path).exists(), (dockerfile, path)
    assert "FROM ${VLLM_IMAGE}" in (ROOT / "infra/docker/prefill.Dockerfile").read_text()
    assert "vllm/vllm-openai:v0.32.0" in (ROOT / "infra/docker/prefill.Dockerfile").read_text()
    assert "torch" not in (ROOT / "infra/docker/service.Dockerfile").read_text().replace(
        "no torch", "")


# ---------------------------------------------------------------- docker-compose.secure.yml

SECURE = ROOT / "docker-compose.secure.yml"
SECURE_USERS = {"router": "router", "coordinator": "coordinator", "coordinator-1": "coordinator",
                "decode-0": "decode", "decode-tp": "decode",
                "decode-1": "decode", "prefill": "prefill", "events": "tools"}


@pytest.fixture(scope="module")
def nats_secrets(tmp_path_factory):
    from infra.nats_secrets import make_secrets

    return make_secrets(tmp_path_factory.mktemp("nats-secrets"), hosts=("nats", "127.0.0.1"))


@pytest.fixture(scope="module")
def secure_stack(nats_secrets) -> dict:
    binary = shutil.which("docker-compose")
    assert binary
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "-f", str(SECURE), "--profile", "tools", "config"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "XL_NATS_SECRETS_DIR": str(nats_secrets.out_dir)})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_secure_override_gives_each_service_only_its_own_files(secure_stack, nats_secrets):
    services = secure_stack["services"]
    assert set(services) == LONG_RUNNING | {"jaeger", "model", "nats-box", "events", "decode-tp"}
    for name, user in SECURE_USERS.items():
        env = services[name]["environment"]
        assert env["EXPRESSLANE_NATS_URL"] == "nats://nats:4222", name  # no password in a URL
        assert (env["EXPRESSLANE_NATS_USER"], env["EXPRESSLANE_NATS_PASSWORD_FILE"],
                env["EXPRESSLANE_NATS_TLS_CA"]) == (
            user, f"/run/secrets/nats_{user}_password", "/run/secrets/nats_ca"), name
        names = {s["source"] if isinstance(s, dict) else s for s in services[name]["secrets"]}
        assert names == {"nats_ca", f"nats_{user}_password"}, name
    assert not any(services["nats"]["environment"].values())  # no laptop password left
    sources = {name: Path(s["file"]) for name, s in secure_stack["secrets"].items()}
    assert sources["nats_ca"] == nats_secrets.ca
    assert sources["nats_router_password"] == nats_secrets.password_file("router")
    assert all(path.is_file() for path in sources.values())


async def test_secure_nats_command_runs_on_the_real_server(secure_stack, nats_secrets, tmp_path):
    """The override's nats command, with its paths mapped onto this machine: TLS and the file
    passwords work; a client without the CA is refused."""
    from infra.nats import SECURE_CONFIG, find_binary
    from infra.processes import free_port
    from shared.bus import Bus, BusTlsError
    from shared.bus_auth import BusAuth

    secrets_dir = tmp_path / "run-secrets"
    secrets_dir.mkdir()
    for name, secret in secure_stack["secrets"].items():
        (secrets_dir / name).write_bytes(Path(secret["file"]).read_bytes())
    command = secure_stack["services"]["nats"]["command"][0].replace("$$", "$")
    port = free_port()
    command = (command.replace("/run/secrets/", f"{secrets_dir}/")
               .replace("/etc/nats/nats.conf", str(SECURE_CONFIG))
               .replace("-sd /data", f"-sd {tmp_path / 'data'}")
               .replace("exec nats-server", f"exec {find_binary()} -a 127.0.0.1 -p {port}")
               .replace("-m 8222", "-m -1"))
    proc = subprocess.Popen(["sh", "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"PATH": "/usr/bin:/bin"})
    try:
        url = f"nats://127.0.0.1:{port}"
        auth = BusAuth(user="router", password_file=str(secrets_dir / "nats_router_password"),
                       tls_ca=str(secrets_dir / "nats_ca")).validate()
        for _ in range(100):
            try:
                bus = await Bus.connect(url, name="router", auth=auth, connect_timeout_s=1.0)
                break
            except BusTlsError:
                raise
            except Exception:
                assert proc.poll() is None, "nats-server exited"
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("nats-server never accepted the router")
        await bus.close()
        with pytest.raises(BusTlsError):
            await Bus.connect(url, connect_timeout_s=10.0, auth=BusAuth(
                user="router", password_file=str(secrets_dir / "nats_router_password")))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_gpu_node_bench_runs_the_single_gpu_decode_services_flags(tmp_path):
    """bench/gpu_node.py starts its decode node with the flags of decode-0/decode-1 (the tensor-parallel
    service under its own profile is another deployment), and refuses a file whose nodes disagree."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_node import compose_decode_flags

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    flags = compose_decode_flags(COMPOSE)
    assert flags == [f for f in services["decode-0"]["command"][1:]
                     if f.split("=", 1)[0] not in ("--model", "--node-id", "--transport-host", "--http-host",
                                                   "--http-port")]
    assert "--fast-path=on" in flags and not any(f.startswith("--tensor-parallel-size") for f in flags)

    services["decode-1"]["command"] = [*services["decode-1"]["command"], "--fast-path=off"]
    bad = tmp_path / "compose.yml"
    bad.write_text(yaml.safe_dump({"services": services}))
    with pytest.raises(SystemExit, match="disagree"):
        compose_decode_flags(bad)
