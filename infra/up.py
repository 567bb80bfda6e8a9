"""``expresslane up``: the whole stack on this machine, supervised, on a generated tiny model by default.

Contract:
- Starts, in order, each as its own process group with its log under ``WORKDIR/logs``: an embedded
  nats-server (JetStream), ``--coordinators`` coordinators (the first leads, the others stand by
  to take over: services.coordinator.leadership), ``--decode-nodes`` decode nodes, the vLLM prefill
  with the express connector, and the router; waits for each one's health before the next, except that the
  router starts beside vLLM (its import of vLLM's serving code, seconds of one core, overlaps vLLM's start).
- Without ``--model`` it writes a tiny checkpoint (``infra.tinymodel``, ``--arch``) under WORKDIR.
- A piece whose module is not in this build is reported as missing and skipped (vLLM then runs
  without the connector and the router serves the standard lane only).
- Prints the endpoint, an example curl and how to watch events; then supervises: a process that
  exits is reported with its log tail and started again (at most ``MAX_RESTARTS`` times in
  ``RESTART_WINDOW_S``; beyond that the stack stops with status 1). Ctrl-C or SIGTERM stops every
  process (SIGTERM, then SIGKILL after a grace period) and exits 0 with nothing left running.
- ``expresslane up [options] -- VLLM ARGS``: the arguments after ``--`` go to the prefill vLLM
  unchanged (as with ``expresslane prefill``); its ``--tool-call-parser``, ``--reasoning-parser``
  and ``--enable-auto-tool-choice`` also configure the router (infra.vllm_flags), and an unknown
  parser name stops ``up`` before anything starts.
- One ``up`` per WORKDIR: a second one on the same WORKDIR exits 1 at once, naming the first's pid
  (``WORKDIR/up.lock``), before it touches the NATS store there.
- ``--secure``: nats-server with TLS (a CA and certificate generated under ``WORKDIR/secrets``) and
  one user per service (infra/nats/nats.conf) whose random password is a file there; each service
  gets only file paths (--nats-user, --nats-password-file, --nats-tls-ca), never a secret.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.nats import stopping_with_parent
from infra.processes import free_port, group_alive, shared_host_omp_env, signal_group, stop_process_groups
from infra.vllm_flags import check_vllm_args, parser_flags, split_args
from shared.cpu_priority import MAX_NICE

REPO_ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 15.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


@dataclass
class Proc:
    name: str
    argv: list[str]
    health_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        log = open(self.log_path, "ab")
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        # Each child gets SIGTERM from the kernel if `up` itself dies without stopping it.
        self.popen = subprocess.Popen(stopping_with_parent(self.argv), stdout=log,
                                      stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                      env={**os.environ, "PYTHONPATH": pythonpath, **self.env},
                                      start_new_session=True)
        log.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before it was ready; "
                                   f"log {self.log_path}:\n{_tail(self.log_path)}")
            if not self.health_url or _healthy(self.health_url):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not healthy at {self.health_url} within {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{_tail(self.log_path)}")

    def signal(self, sig: int) -> None:
        if self.popen is not None:
            signal_group(self.popen, sig)

    def group_alive(self) -> bool:
        """Whether any process of the group still runs (zombies awaiting their reaper do not)."""
        if self.popen is None:
            return False
        self.popen.poll()
        return group_alive(self.popen.pid)


def stop_all(procs: list[Proc], grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop in reverse start order; returns the names of groups that needed SIGKILL."""
    started = [p for p in procs if p.popen is not None]
    killed = stop_process_groups([p.popen for p in started], grace_s)
    return [p.name for p in started if p.popen in killed]


def have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _attention_args(model: Path) -> list[str]:
    """vLLM on CPU runs an MLA model in float32 only with the CPU_MLA backend."""
    try:
        is_mla = "kv_lora_rank" in json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        is_mla = False
    return ["--attention-config", json.dumps({"backend": "CPU_MLA"})] if is_mla else []


def staging_stats_path(args: argparse.Namespace) -> Path:
    """Where the prefill's connector keeps its staging slot states (``expresslane prefill --stats``)."""
    return Path(args.workdir) / "prefill-staging.slots"


def write_stack_file(args: argparse.Namespace, model: Path, nats_url: str, procs: list[Proc]) -> Path:
    """``<workdir>/stack.json``: every endpoint of the running stack, for tools and benchmarks."""
    path = Path(args.workdir) / "stack.json"
    path.write_text(json.dumps({
        "router_url": f"http://{args.host}:{args.port}", "nats_url": nats_url, "model": str(model),
        "staging_stats_path": str(staging_stats_path(args)),
        "processes": {p.name: {"pid": p.popen.pid if p.popen else None, "health_url": p.health_url,
                               "log": str(p.log_path)} for p in procs},
    }, indent=2))
    return path


def _no_bus_args(user: str) -> list[str]:
    return []


def plan(args: argparse.Namespace, model: Path, nats_url: str, py: str,
         bus_args: Callable[[str], list[str]] = _no_bus_args) -> tuple[list[Proc], list[str]]:
    """The processes to start after nats-server, and the pieces this build lacks; ``bus_args(user)``
    are a service's NATS credential flags (file paths)."""
    cli = [py, "-m", "infra.cli"]

    def common(user: str) -> list[str]:
        return ["--nats-url", nats_url, *bus_args(user), "--log-format", args.log_format]

    procs: list[Proc] = []
    missing: list[str] = []
    vllm_args = list(getattr(args, "vllm_args", []))
    if have("services.coordinator.service"):
        for i in range(args.coordinators):
            port = free_port()
            procs.append(Proc("coordinator" + (f"-{i}" if i else ""), cli + [
                "coordinator", *common("coordinator"), *_js_replicas(args), "--http-port", str(port)],
                f"http://127.0.0.1:{port}/health"))
    else:
        missing.append("coordinator (services/coordinator/service.py)")
    if have("services.decode.main"):
        for i in range(args.decode_nodes):
            port = free_port()
            procs.append(Proc(f"decode-{i}", cli + [
                "decode", *common("decode"), "--model", str(model), "--node-id", f"decode-{i}",
                "--slots", str(args.slots), "--max-seq-len", str(args.max_model_len),
                "--tensor-parallel-size", str(args.decode_tp), "--cpu-nice", str(args.decode_nice),
                "--http-port", str(port)], f"http://127.0.0.1:{port}/health"))
    else:
        missing.append("decode node (services/decode/main.py)")
    prefill_port = args.prefill_port or free_port()
    # vLLM shares this host's cores with the decode nodes (one busy core each), the router, NATS
    # and the coordinator (one more): its OpenMP threads take the rest, unbound (what the operator
    # set in the environment wins)
    omp = shared_host_omp_env(args.decode_nodes * args.decode_tp + 1)
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                **{k: os.environ.get(k, v) for k, v in omp.items()},
                "EXPRESSLANE_NATS_URL": nats_url}
    if have("services.prefill.launch"):
        argv = cli + ["prefill", "--nats-url", nats_url, *bus_args("prefill"), "--model", str(model),
                      "--port", str(prefill_port), "--dtype", "float32",
                      *(["--stats-path", str(staging_stats_path(args))] if args.workdir else []),
                      "--", "--max-model-len", str(args.max_model_len), "--enforce-eager",
                      *_attention_args(model), *vllm_args]
    else:
        missing.append("prefill connector launcher (services/prefill/launch.py): vLLM runs "
                       "without the connector, the express lane stays closed")
        argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
                "127.0.0.1", "--port", str(prefill_port), "--max-model-len", str(args.max_model_len),
                "--enforce-eager", "--dtype", "float32", *_attention_args(model), *vllm_args]
    procs.append(Proc("prefill", argv, f"http://127.0.0.1:{prefill_port}/health", env=vllm_env))
    procs.append(Proc("router", cli + [
        "router", *common("router"), "--port", str(args.port), "--host", args.host,
        "--prefill-url", f"http://127.0.0.1:{prefill_port}", *parser_flags(vllm_args)],
        f"http://127.0.0.1:{args.port}/health"))
    return procs, missing


def supervise(procs: list[Proc], log_dir: Path, start_timeout_s: float) -> None:
    """Restart processes that exit, until Ctrl-C; RuntimeError when one keeps failing."""
    restarts: dict[str, list[float]] = {}
    while True:
        for proc in procs:
            if proc.alive:
                continue
            now = time.monotonic()
            recent = [t for t in restarts.get(proc.name, []) if now - t < RESTART_WINDOW_S]
            print(f"\n{proc.name} exited ({proc.popen.returncode}); log {proc.log_path}:\n"
                  f"{_tail(proc.log_path, 10)}", file=sys.stderr, flush=True)
            if len(recent) >= MAX_RESTARTS:
                raise RuntimeError(f"{proc.name} exited {MAX_RESTARTS} times in "
                                   f"{RESTART_WINDOW_S:.0f} s; giving up")
            restarts[proc.name] = recent + [now]
            stop_all([proc], grace_s=5.0)  # whatever is left of its process group
            proc.start(log_dir)
            print(f"{proc.name:<14} restarted", flush=True)
            proc.wait_healthy(start_timeout_s)
            print(f"{proc.name:<14} ready", flush=True)
        time.sleep(0.5)


def _js_replicas(args: argparse.Namespace) -> list[str]:
    """The coordinator's JetStream replicas: 3 on a cluster of 3 or more (survives losing one)."""
    return ["--js-replicas", str(min(3, args.nats_cluster))] if args.nats_cluster > 1 else []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="expresslane up", usage="expresslane up [options] [-- VLLM ARGS]",
        description="Start nats-server, coordinator, decode nodes, vLLM prefill and the router on "
                    "this machine; Ctrl-C stops everything.",
        epilog="Arguments after '--' go to the prefill vLLM unchanged, e.g. "
               "'-- --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3'. "
               "The router reads the same --tool-call-parser, --reasoning-parser and "
               "--enable-auto-tool-choice, so express-lane tool calls and reasoning are parsed by the "
               "vLLM parsers the prefill runs; an unknown parser name stops 'up' at start. vLLM's CPU "
               "build gets the cores the decode nodes leave as unbound OpenMP threads (OMP_NUM_THREADS, "
               "VLLM_CPU_OMP_THREADS_BIND=nobind; one on 2 cores) unless the environment sets them.")
    p.add_argument("--model", type=Path, default=None,
                   help="HF checkpoint directory (default: generate a tiny model)")
    p.add_argument("--arch", default="llama", help="architecture of the generated tiny model")
    p.add_argument("--coordinators", type=int, choices=range(1, 10), default=1, metavar="N",
                   help="coordinator processes: one leads, the others take over when it dies "
                   "(default 1)")
    p.add_argument("--decode-nodes", type=int, default=2, help="decode node processes (default 2)")
    p.add_argument("--slots", type=int, default=2, help="slots per decode node (default 2)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per decode node (default 1; each rank is a process)")
    p.add_argument("--decode-nice", type=int, choices=range(MAX_NICE + 1), default=MAX_NICE, metavar="N",
                   help="the decode nodes' CPU priority below vLLM, the router and NATS, which share "
                        "this host's cores with them (0-19, default 19): a busy node then yields to "
                        "the prefill an express request's first token waits for (`expresslane decode "
                        "--cpu-nice`); 0 for equal shares")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument("--prefill-port", type=int, default=0, help="vLLM port (default: a free one)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length, vLLM and slots")
    p.add_argument("--workdir", type=Path, default=None, help="logs, NATS store, generated model")
    p.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                   help="N clustered nats-servers instead of one (3: losing one loses nothing, the "
                   "coordinator keeps 3 replicas of its state)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="per process")
    p.add_argument("--log-format", default="json", choices=["json", "console"])
    p.add_argument("--secure", action="store_true",
                   help="NATS with TLS and one user per service, passwords in files under "
                   "WORKDIR/secrets (generated once, kept)")
    return p


def _cli() -> str:
    """How to call the expresslane command from a shell."""
    script = Path(sys.executable).with_name("expresslane")
    return str(script) if script.exists() else f"{sys.executable} -m infra.cli"


def _banner(args: argparse.Namespace, model: Path, nats_url: str, missing: list[str], log_dir: Path,
            bus_args: Callable[[str], list[str]] = _no_bus_args) -> str:
    url = f"http://{args.host}:{args.port}"
    body = json.dumps({"model": str(model), "stream": True, "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me about express lanes."}]})
    lines = [
        "", f"expresslane is up: OpenAI endpoint {url}/v1  (model {model})", "",
        "  try:", f"    curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\",
        f"      -d '{body}'", "",
        "  standard lane: add -H 'x-expresslane: off'",
        f"  watch the bus: {' '.join([_cli(), 'events', '--nats-url', nats_url, *bus_args('tools')])}",
        f"  health:        curl {url}/health      metrics: curl {url}/metrics",
        f"  logs:          {log_dir}/", "",
    ]
    if missing:
        lines += ["  NOT RUNNING (not in this build):"] + [f"    - {m}" for m in missing] + [""]
    return "\n".join(lines + ["  Ctrl-C stops everything."])


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``up``'s own options, and the vLLM arguments after ``--`` as ``vllm_args``."""
    own, vllm_args = split_args(list(argv))
    parser = build_parser()
    args = parser.parse_args(own)
    args.vllm_args = vllm_args
    try:
        check_vllm_args(vllm_args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def hold_workdir(workdir: Path):
    """Take ``WORKDIR/up.lock`` for this process's life (the lock goes with the process, however
    it ends); RuntimeError when another ``up`` holds it: two stacks on one workdir would share one
    JetStream store directory under two nats-servers and corrupt it."""
    import fcntl

    workdir.mkdir(parents=True, exist_ok=True)
    lock = open(workdir / "up.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RuntimeError(f"another 'expresslane up' (pid {holder}) is running on {workdir}: stop it "
                           "first (Ctrl-C or SIGTERM there), or give this one another --workdir") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from infra.nats import DEV_CONFIG, SECURE_CONFIG, NatsServer, ServerTls

    workdir = args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="expresslane-up-"))
    try:
        lock = hold_workdir(workdir)  # noqa: F841 (held until the process ends)
    except RuntimeError as exc:
        print(f"expresslane up: {exc}", file=sys.stderr)
        return 1
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # the terminal closed: stop like Ctrl-C
    bus_args, nats_options = _no_bus_args, {"config_file": DEV_CONFIG}
    if args.secure:
        from infra.nats_secrets import make_secrets

        secrets = make_secrets(workdir / "secrets")
        bus_args = secrets.client_args
        nats_options = {"config_file": SECURE_CONFIG, "env": secrets.server_env(),
                        "tls": ServerTls(cert=str(secrets.server_cert), key=str(secrets.server_key))}
    if args.nats_cluster > 1:
        from infra.nats_cluster import NatsCluster

        nats = NatsCluster(workdir / "nats", args.nats_cluster, log_dir=log_dir,
                           stop_with_parent=True, **nats_options)
    else:
        nats = NatsServer(workdir / "nats", log_path=log_dir / "nats-server.log",
                          stop_with_parent=True, **nats_options)
    procs: list[Proc] = []
    code = 0
    try:
        model = args.model
        if model is None:
            from infra.tinymodel import make_model

            model = workdir / f"tiny-{args.arch}"
            if not (model / "config.json").exists():
                print(f"generating a tiny {args.arch} model in {model} ...", flush=True)
                make_model(args.arch, model)
        model = model.resolve()
        nats.start(timeout_s=15.0)
        print(f"nats-server    {nats.url}", flush=True)
        todo, missing = plan(args, model, nats.url, sys.executable, bus_args)
        waiting: list[Proc] = []
        for i, proc in enumerate(todo):
            proc.start(log_dir)
            procs.append(proc)
            waiting.append(proc)
            print(f"{proc.name:<14} starting (log {proc.log_path})", flush=True)
            if proc.name == "prefill" and i + 1 < len(todo) and todo[i + 1].name == "router":
                continue  # the router comes up beside vLLM: it answers once vLLM does
            for p in waiting:
                p.wait_healthy(args.start_timeout_s)
                print(f"{p.name:<14} ready", flush=True)
            waiting = []
        print(_banner(args, model, nats.url, missing, log_dir, bus_args), flush=True)
        print(f"  endpoints:     {write_stack_file(args, model, nats.url, procs)}", flush=True)
        supervise(procs, log_dir, args.start_timeout_s)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"\nexpresslane up failed: {exc}", file=sys.stderr)
        code = 1
    finally:
        print("\nstopping ...", flush=True)
        killed = stop_all(procs)
        nats.stop()
        left = [p.name for p in procs if p.group_alive()]
        print("stopped" + (f" (needed SIGKILL: {', '.join(killed)})" if killed else "")
              + (f"; STILL RUNNING: {left}" if left else ""), flush=True)
    return code
