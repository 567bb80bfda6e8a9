"""The coordinator's configuration: one object, parsed once from flags and ``EXPRESSLANE_*`` variables.

Contract:
    parser = build_parser()
    config = from_args(shared_config.parse_args(parser, argv))   # ValueError names the setting

Every flag ``--foo-bar`` also reads ``EXPRESSLANE_FOO_BAR`` (shared.config). The service settings
(NATS, HTTP, JetStream names, loop periods, logging) live in ``CoordinatorServiceConfig``; the
timeouts and bounds of the pure core stay in ``CoordinatorConfig`` (services.coordinator.model) and
ride along as ``config.core``; the leader lease's timing is ``config.leader``
(services.coordinator.leadership).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields

from services.coordinator.leadership import LeadershipConfig
from services.coordinator.model import CoordinatorConfig
from shared import config as shared_config
from shared import subjects
from shared.bus_auth import BusAuth

INBOX_STREAM = "XL_COORD_INBOX"
_JETSTREAM_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # no spaces, dots or wildcards

_CORE_HELP = {
    "heartbeat_misses": "a decode node is dead after this many missed heartbeats",
    "max_tick_gap_ms": "deadline checks further apart than this mean the coordinator itself was "
                       "not listening (a state write waited on NATS, or it was cut off): node "
                       "deadlines move back by the time beyond it; must exceed --tick-ms",
    "default_heartbeat_interval_ms": "assumed interval of nodes known only from restored leases",
    "transfer_timeout_ms": "a lease without KV-ready fails after this (the claim's expires_at_ms)",
    "fence_grace_ms": "after the transfer timeout a writer may still be live this long: the slot "
                      "is not leased again before",
    "start_timeout_ms": "a lease with KV-ready but no decode start fails after this",
    "release_grace_ms": "after a lease ends, wait this long for the node's release",
    "max_queue": "claims that may wait for a slot; more are rejected (429)",
    "max_wait_ms": "upper bound on a claim's own wait_ms",
    "retry_after_ms": "retry advice in rejections",
    "generation_block": "lease generations reserved per state write",
}


@dataclass(frozen=True)
class CoordinatorServiceConfig:
    """Everything ``expresslane coordinator`` runs with."""

    nats_url: str = shared_config.DEFAULT_NATS_URL
    bus_auth: BusAuth = field(default_factory=BusAuth)  # NATS credential and TLS files
    http_host: str = "127.0.0.1"  # /health and /metrics
    http_port: int = 9102  # 0: any free port
    kv_bucket: str = subjects.COORD_KV_BUCKET  # JetStream KV bucket of the state
    inbox_stream: str = INBOX_STREAM  # JetStream stream of reports
    js_replicas: int = 1  # copies of the bucket and the stream: 3 on a 3-node NATS cluster
    tick_ms: int = 50  # how often deadlines are checked
    compact_interval_s: float = 60.0  # how often delete markers of ended leases are purged
    coordinator_id: str = ""  # names the leader in the leader key and logs ("": host-pid-random)
    log_level: str = "INFO"
    log_format: str = "json"  # "json" | "console"
    core: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    leader: LeadershipConfig = field(default_factory=LeadershipConfig)

    def validate(self) -> CoordinatorServiceConfig:
        """Raise ValueError naming the first bad setting; return self."""
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be a port (0-65535, 0: any free), got {self.http_port}")
        for flag, name in (("--kv-bucket", self.kv_bucket), ("--inbox-stream", self.inbox_stream)):
            if not _JETSTREAM_NAME.match(name):
                raise ValueError(f"{flag} {name!r} is not a JetStream name: use letters, digits, "
                                 "'-' and '_' only")
        if not 1 <= self.js_replicas <= 5:
            raise ValueError(f"--js-replicas must be 1-5 (JetStream's limit), got {self.js_replicas}")
        if self.tick_ms < 1:
            raise ValueError(f"--tick-ms must be >= 1, got {self.tick_ms}")
        if self.core.max_tick_gap_ms <= self.tick_ms:
            raise ValueError(f"--max-tick-gap-ms ({self.core.max_tick_gap_ms}) must exceed "
                             f"--tick-ms ({self.tick_ms}): every tick would read as a stall")
        if not self.compact_interval_s > 0:
            raise ValueError(f"--compact-interval-s must be > 0, got {self.compact_interval_s}")
        if self.log_format not in ("json", "console"):
            raise ValueError(f"--log-format must be json or console, got {self.log_format!r}")
        self.core.validate()
        self.leader.validate()
        return self


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane coordinator",
                                description="Run the transfer coordinator: decode-slot leases, "
                                "gated dispatch, handoff lifecycle events.")
    shared_config.add_common_args(p)
    d = CoordinatorServiceConfig()
    p.add_argument("--http-host", default=d.http_host, help="address of /health and /metrics")
    p.add_argument("--http-port", type=shared_config.port, default=d.http_port,
                   help="port of /health and /metrics (0: any free)")
    p.add_argument("--kv-bucket", default=d.kv_bucket, help="JetStream KV bucket for state")
    p.add_argument("--inbox-stream", default=d.inbox_stream, help="JetStream stream for reports")
    p.add_argument("--js-replicas", type=int, default=d.js_replicas,
                   help="copies of the state bucket and the report stream on a NATS cluster: 3 "
                   "survives losing one server (default 1: one server); applied when they are "
                   "created, and to the report stream at every start")
    p.add_argument("--tick-ms", type=shared_config.positive_int, default=d.tick_ms,
                   help="how often deadlines are checked")
    p.add_argument("--compact-interval-s", type=shared_config.positive_float,
                   default=d.compact_interval_s,
                   help="how often delete markers of ended leases are purged from the bucket")
    p.add_argument("--coordinator-id", default=d.coordinator_id,
                   help="this coordinator's name in the leader key and logs (default: host-pid-random)")
    p.add_argument("--leader-ttl-ms", type=int, default=d.leader.ttl_ms,
                   help="a standby takes over when the leader has not renewed for this long "
                   f"(default {d.leader.ttl_ms})")
    p.add_argument("--leader-renew-ms", type=int, default=d.leader.renew_ms,
                   help=f"how often the leader renews its lease (default {d.leader.renew_ms})")
    p.add_argument("--leader-margin-ms", type=int, default=d.leader.margin_ms,
                   help="the leader stops serving this long before a standby may take over "
                   f"(default {d.leader.margin_ms})")
    for f in fields(CoordinatorConfig):
        default = getattr(d.core, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=default,
                       help=f"{_CORE_HELP[f.name]} (default {default})")
    return p


def from_args(args: argparse.Namespace) -> CoordinatorServiceConfig:
    """Build the config from parsed flags and check it; ValueError names the bad setting."""
    core = CoordinatorConfig(**{f.name: getattr(args, f.name) for f in fields(CoordinatorConfig)})
    return CoordinatorServiceConfig(
        nats_url=args.nats_url,
        bus_auth=shared_config.bus_auth(args),
        http_host=args.http_host,
        http_port=args.http_port,
        kv_bucket=args.kv_bucket,
        inbox_stream=args.inbox_stream,
        js_replicas=args.js_replicas,
        tick_ms=args.tick_ms,
        compact_interval_s=args.compact_interval_s,
        coordinator_id=args.coordinator_id,
        log_level=args.log_level,
        log_format=args.log_format,
        core=core,
        leader=LeadershipConfig(ttl_ms=args.leader_ttl_ms, renew_ms=args.leader_renew_ms,
                                margin_ms=args.leader_margin_ms),
    ).validate()
