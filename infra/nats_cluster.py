"""A nats-server cluster on this host: N members (3 by default), one JetStream cluster.

Contract:
    cluster = NatsCluster(store_dir, num_nodes=3, config_file=DEV_CONFIG)
    cluster.start(timeout_s=30.0)  # every member launched at once, returns when all are healthy
    cluster.urls                   # each member's nats://host:port
    cluster.url                    # the same, comma-separated: what --nats-url takes
    cluster.kill(i)                # SIGKILL member i (a crash)
    cluster.restart(i)             # member i again, same ports and store; returns once it has
                                   # caught up with the cluster (its /healthz)
    cluster.client_nodes("decode-d1")  # indexes of the members that client (by name) is connected to
    cluster.stop()

Each member is an infra.nats.NatsServer with its own store directory (``store_dir/node-<i>``),
server name ``<name>-<i>``, cluster name ``name`` and routes to every member (JetStream clustering
wants configured routes). The cluster, client and monitoring ports are fixed before the start
(``cluster_port``/``port``/``monitor_port`` +i each, or distinct free ones picked then: a port
another process takes in between fails the start).
``tls`` (infra.nats.ServerTls) is for the client port of every member; routes stay on loopback
without it. Clients given one member's URL learn the others from the server (nats-py's server discovery).
With three members a stream or KV bucket with three replicas survives losing any one.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from infra.nats import NatsServer, NatsServerError, ServerTls
from infra.processes import free_ports

CLUSTER_NAME = "expresslane"


class NatsCluster:
    """``num_nodes`` nats-servers on this host forming one JetStream cluster (module docstring)."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        num_nodes: int = 3,
        host: str = "127.0.0.1",
        config_file: str | os.PathLike | None = None,
        *,
        port: int = 0,
        monitor_port: int = 0,
        cluster_port: int = 0,
        name: str = CLUSTER_NAME,
        log_dir: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        stop_with_parent: bool = False,
        tls: ServerTls | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"a cluster needs at least one member, got {num_nodes}")
        self.store_dir, self.name = Path(store_dir), name
        # Every port fixed up front, all distinct: a member asked for a random client or
        # monitoring port could otherwise be given a route port picked for the cluster.
        free = iter(free_ports(3 * num_nodes))
        cluster_ports = [cluster_port + i if cluster_port else next(free) for i in range(num_nodes)]
        client_ports = [port + i if port else next(free) for i in range(num_nodes)]
        monitor_ports = [monitor_port + i if monitor_port else next(free) for i in range(num_nodes)]
        route_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        routes = ",".join(f"nats://{route_host}:{p}" for p in cluster_ports)
        self.servers = [
            NatsServer(
                self.store_dir / f"node-{i}", host=host, port=client_ports[i],
                monitor_port=monitor_ports[i], config_file=config_file,
                log_path=Path(log_dir) / f"nats-server-{i}.log" if log_dir else None, env=env,
                stop_with_parent=stop_with_parent, tls=tls,
                extra_args=["--name", f"{name}-{i}", "--cluster_name", name,
                            "--cluster", f"nats://{host}:{cluster_ports[i]}", "--routes", routes],
            )
            for i in range(num_nodes)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated (a service's --nats-url)."""
        return ",".join(self.urls)

    @property
    def monitor_urls(self) -> list[str]:
        return [s.monitor_url for s in self.servers]

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Launch every member, then wait for each to be healthy; NatsServerError otherwise."""
        try:
            for server in self.servers:
                server.launch()
            for server in self.servers:
                server.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILL member ``index``."""
        self.servers[index].kill()

    def restart(self, index: int, timeout_s: float = 30.0) -> NatsServer:
        """Start member ``index`` again (after kill or stop); returns once it is healthy."""
        return self.servers[index].start(timeout_s)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def client_nodes(self, client_name: str) -> list[int]:
        """Indexes of the running members that a client named ``client_name`` is connected to."""
        found = []
        for i, server in enumerate(self.servers):
            if server.is_running and client_name in _connection_names(server.monitor_url):
                found.append(i)
        return found

    def log_tail(self, num_lines: int = 10) -> str:
        return "\n".join(f"--- {s.log_path}\n{s.log_tail(num_lines)}" for s in self.servers)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsCluster({self.name}, {len(self.servers)} members, {self.servers!r})"


def _connection_names(monitor_url: str) -> set[str]:
    try:
        with urllib.request.urlopen(f"{monitor_url}/connz?limit=1024", timeout=2.0) as resp:
            return {c.get("name", "") for c in json.load(resp).get("connections", [])}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise NatsServerError(f"cannot read {monitor_url}/connz: {exc}") from exc


def run_cluster(args, log) -> int:
    """``expresslane nats --cluster N``: the cluster in the foreground until Ctrl-C or SIGTERM."""
    import sys

    from infra.nats import resolve_config, serve_until_stopped

    if args.cluster < 1:
        print(f"expresslane nats: --cluster must be 1 or more, got {args.cluster}", file=sys.stderr)
        return 2
    cluster = NatsCluster(
        args.nats_store_dir, args.cluster, host=args.nats_host,
        config_file=resolve_config(args.nats_config), port=args.nats_port,
        monitor_port=args.nats_monitor_port, cluster_port=args.nats_cluster_port,
    )

    def announce() -> None:
        log.info("nats_cluster_ready", urls=cluster.urls, monitor_urls=cluster.monitor_urls,
                 store_dir=str(cluster.store_dir))
        print(f"nats cluster of {args.cluster} ready: --nats-url {cluster.url} (monitoring "
              f"{', '.join(cluster.monitor_urls)}); Ctrl-C stops it", flush=True)

    return serve_until_stopped(cluster.servers, cluster.start, cluster.stop, announce, log)
