"""docker-compose.yml validates with the real docker-compose (no engine needed) and wires the
stack as designed: health checks, depends_on conditions, one NATS user per service,
the nats-box tool under a profile."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
LONG_RUNNING = {"nats", "prefill", "coordinator", "decode-0", "decode-1", "router"}


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
    assert set(stack) == LONG_RUNNING | {"jaeger", "model", "nats-box", "events"}
    assert stack["nats-box"]["profiles"] == ["tools"] and stack["events"]["profiles"] == ["tools"]
    for name in LONG_RUNNING | {"jaeger", "model"}:  # what `docker compose up` starts
        assert "profiles" not in stack[name], name


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
    expected = {"router": "router", "coordinator": "coordinator", "decode-0": "decode",
                "decode-1": "decode", "prefill": "prefill", "events": "tools"}
    nats_env = stack["nats"]["environment"]
    for name, user in expected.items():
        url = urllib.parse.urlsplit(stack[name]["environment"]["EXPRESSLANE_NATS_URL"])
        assert (url.hostname, url.port, url.username) == ("nats", 4222, user), name
        assert url.password == nats_env[f"XL_NATS_{user.upper()}_PASSWORD"], name
    box = urllib.parse.urlsplit(stack["nats-box"]["environment"]["NATS_URL"])
    assert (box.username, box.password) == ("tools", nats_env["XL_NATS_TOOLS_PASSWORD"])
    assert "-js" in stack["nats"]["command"] and "-m" in stack["nats"]["command"]


def test_tracing_and_ports(stack):
    for name in ("router", "coordinator", "prefill", "decode-0", "decode-1"):
        assert stack[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert "OTEL_SERVICE_NAME" not in stack[name]["environment"]
    assert container_ports(stack["jaeger"]) == {4317, 4318, 16686}
    assert container_ports(stack["router"]) == {8000}
    assert container_ports(stack["nats"]) == {4222, 8222}
    node_ids = [next(a for a in stack[n]["command"] if a.startswith("--node-id="))
                for n in ("decode-0", "decode-1")]
    assert node_ids == ["--node-id=decode-0", "--node-id=decode-1"]


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
