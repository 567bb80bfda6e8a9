"""One real deployment shared by every end-to-end test: nothing faked.

``deployment`` (package scope, so it is gone before other packages' tests run on the same
nats-server): the session's nats-server, two prefill vLLMs with the express connector
(``express_vllm``: llama float32, deepseek_v3 float32), one coordinator, two
llama decode nodes (one slot each), and the router, each a real subprocess exporting spans to the
session's OTLP receiver. ``deepseek_node`` adds the deepseek_v3 decode node for the tests that
use it. It ends by stopping every process and
checking that none is left.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from infra.processes import free_port
from infra.up import Proc, stop_all
from tests.fixtures.prefill import Express

PY = sys.executable
CLI = [PY, "-m", "infra.cli"]
LLAMA_NODES = ("llama-0", "llama-1")
DS_NODES = ("ds-0",)
COORD_MAX_QUEUE = 1
HEARTBEAT_MS = 300
E2E_VLLM_SERVERS = [Express("llama"), Express("deepseek_v3")]  # each e2e module's VLLM_SERVERS


@dataclass
class Deployment:
    router_url: str
    nats_url: str
    llama: object  # tests.fixtures.prefill.ExpressPrefill
    deepseek: object
    log_dir: Path
    env: dict[str, str]
    procs: dict[str, Proc] = field(default_factory=dict)
    health_urls: dict[str, str] = field(default_factory=dict)

    @property
    def llama_model(self) -> str:
        return str(self.llama.model_dir)

    @property
    def deepseek_model(self) -> str:
        return str(self.deepseek.model_dir)

    def health(self, name: str) -> dict:
        return httpx.get(self.health_urls[name], timeout=5.0).json()

    def start(self, proc: Proc, timeout_s: float = 300.0) -> None:
        proc.env = {**self.env, **proc.env}
        proc.start(self.log_dir)
        self.procs[proc.name] = proc
        proc.wait_healthy(timeout_s)

    def decode_proc(self, name: str, model: Path, dtype: str) -> Proc:
        port = free_port()
        self.health_urls[name] = f"http://127.0.0.1:{port}/health"
        return Proc(name, CLI + ["decode", "--nats-url", self.nats_url, "--model", str(model),
                                 "--node-id", name, "--slots", "1", "--dtype", dtype,
                                 "--heartbeat-ms", str(HEARTBEAT_MS), "--http-port", str(port)],
                    self.health_urls[name])

    def restart_node(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start a decode node again (after a test killed it, or with extra ``env``); back once the router has
        the new process's heartbeat (its endpoints in place of the old process's: a warm lease the router still
        holds on the old ones is then refused, not used)."""
        old = self.procs.pop(name)
        before = self.router_nodes().get(name, {}).get("endpoints")
        stop_all([old], grace_s=5.0)
        model, dtype = ((self.llama.model_dir, "float32") if name in LLAMA_NODES
                        else (self.deepseek.model_dir, "float32"))
        proc = self.decode_proc(name, model, dtype)
        proc.env = {**proc.env, **(env or {})}
        self.start(proc)
        wait_until(lambda: (n := self.router_nodes().get(name)) and n["live"] and n["endpoints"] != before, 30.0,
                   f"{name}'s new process in the router")
        wait_until(lambda: self.express_capacity().get(str(model)), 30.0, f"{name} back in the router")

    def router_nodes(self) -> dict:
        return httpx.get(f"{self.router_url}/health", timeout=5.0).json()["nodes"]

    def express_capacity(self) -> dict:
        return httpx.get(f"{self.router_url}/health", timeout=5.0).json()["express_capacity"]


def wait_until(cond, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.fixture(scope="package")
def deployment(express_vllm, vllm_servers, nats_url, otlp_receiver, tmp_path_factory):
    # outside pytest's rotating temp dirs, so the logs outlive later sessions
    log_dir = Path(tempfile.mkdtemp(prefix="expresslane-e2e-logs-"))
    print(f"e2e logs in {log_dir}")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200",
           "EXPRESSLANE_NATS_URL": nats_url}
    # The prefill vLLMs export their spans to the same receiver (express_vllm sets it).
    llama = express_vllm("llama")
    # float32, the correctness bar: vLLM on CPU then prefills without its MTP drafter, and the
    # decode node still speculates with its own MTP layer (exact for greedy).
    deepseek = express_vllm("deepseek_v3", dtype="float32")
    dep = Deployment(router_url="", nats_url=nats_url, llama=llama, deepseek=deepseek,
                     log_dir=log_dir, env=env)
    try:
        port = free_port()
        dep.health_urls["coordinator"] = f"http://127.0.0.1:{port}/health"
        dep.start(Proc("coordinator", CLI + [
            "coordinator", "--nats-url", nats_url, "--http-port", str(port), "--tick-ms", "20",
            "--max-queue", str(COORD_MAX_QUEUE), "--heartbeat-misses", "3",
            "--default-heartbeat-interval-ms", str(HEARTBEAT_MS)], dep.health_urls["coordinator"]))
        for name in LLAMA_NODES:
            dep.start(dep.decode_proc(name, llama.model_dir, "float32"))
        port = free_port()
        dep.router_url = f"http://127.0.0.1:{port}"
        dep.health_urls["router"] = f"{dep.router_url}/health"
        dep.start(Proc("router", CLI + [
            "router", "--nats-url", nats_url, "--port", str(port),
            "--prefill-url", f"{llama.url},{deepseek.url}", "--capability-gate", "reject",
            "--claim-wait-ms", "1000", "--first-decode-timeout-s", "20", "--token-timeout-s", "3"],
            dep.health_urls["router"]))
        wait_until(lambda: dep.express_capacity().get(dep.llama_model), 30.0, "llama nodes seen by the router")
        yield dep
    finally:
        procs = list(dep.procs.values())
        stop_all(procs, grace_s=15.0)
        vllm_servers.stop_connector_servers()  # their transfer engines outlive the decode nodes
        left = [p.name for p in procs if p.group_alive()]
        for p in procs:
            if p.popen is not None and p.popen.returncode not in (0, None, -9, -15):
                print(f"--- {p.name} exited {p.popen.returncode}; log {p.log_path}")
        assert not left, f"processes left running: {left}"


@pytest.fixture(scope="package")
def deepseek_node(deployment):
    """The deepseek_v3 decode node, started by the tests that need it (stopped with the rest)."""
    for name in DS_NODES:
        if name not in deployment.procs or not deployment.procs[name].alive:
            deployment.start(deployment.decode_proc(name, deployment.deepseek.model_dir, "float32"))
    wait_until(lambda: deployment.express_capacity().get(deployment.deepseek_model), 30.0,
               "the deepseek_v3 node seen by the router")
    return DS_NODES[0]


def chat_request(model: str, **kw) -> dict:
    """A greedy chat completion body for ``model``; ``kw`` adds or overrides fields."""
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "temperature": 0, **kw}


def assert_nothing_leaked(dep, timeout_s: float = 10.0) -> None:
    """No lease but the router's warm ones, no busy decode slot, no busy staging slot."""
    def clean():
        coord = dep.health("coordinator")
        warm = dep.health("router")["warm_leases"]
        nodes = [dep.health(n) for n in LLAMA_NODES]
        stats = [dep.llama.stats(), dep.deepseek.stats()]
        nodes += [dep.health(n) for n in DS_NODES if n in dep.procs and dep.procs[n].alive]
        return (coord["leases"] == len(warm) and coord["queued"] == 0 and all(not n["active"] for n in nodes)
                and all(s["free"] == s["total"] for s in stats))
    wait_until(clean, timeout_s, "leases, decode slots and staging slots to be free")


def sse_events(lines) -> list:
    """Decode the data lines of an SSE body (stops at [DONE])."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            if payload == "[DONE]":
                break
            out.append(json.loads(payload))
    return out
