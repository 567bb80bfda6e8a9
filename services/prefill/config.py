"""The connector's configuration: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

Keys (all optional):

| key                  | default                      | meaning                                        |
| -------------------- | ---------------------------- | ---------------------------------------------- |
| nats_url             | nats://127.0.0.1:4222        | where KV-ready / KV-failed events are published |
| nats_user, nats_password_file, nats_creds_file, nats_tls_ca, nats_tls_cert, nats_tls_key | "" | the bus's credential and TLS files (shared.bus_auth) |
| transports           | ["mooncake"]                 | transports the sender can write with            |
| mooncake_host        | 127.0.0.1                    | address of this host that decode nodes reach    |
| mooncake_protocol    | "tcp"                        | "rdma" in production                            |
| nixl_agent_name      | random                       | NIXL agent name of the sender                   |
| staging_slots        | 4                            | requests that can be in flight at once          |
| staging_max_tokens   | vLLM's max_model_len         | longest prompt a staging slot holds             |
| transfer_timeout_s   | 30                           | a write not done by then: KV-failed             |
| stats_path           | /dev/shm/expresslane-staging-<engine_id> | staging slot states (see staging.py; tensor-parallel rank r > 0: PATH.rank<r>) |
| kv_checksum          | false                        | a checksum per written segment in KvReady (shared.kvchecksum) |
| fault_flip_kv_byte_every | 0                        | FAULT INJECTION, tests and bench/chaos.py only: flip one byte of every Nth checksummed transfer's staging copy after summing (0: off) |

``expresslane prefill`` also starts vLLM with Mooncake's own per-transfer timeout
(``MC_TRANSFER_TIMEOUT``) at ``transfer_timeout_s`` unless the environment sets it
(``launch.mooncake_env``); a write is bounded by ``transfer_timeout_s`` either way.

Pure: no vLLM, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.bus_auth import BusAuth
from shared.transport import TRANSPORTS

NATS_AUTH_KEYS = ("nats_user", "nats_password_file", "nats_creds_file", "nats_tls_ca", "nats_tls_cert",
                  "nats_tls_key")
EXTRA_CONFIG_KEYS = ("nats_url", "transports", "mooncake_host", "mooncake_protocol",
                     "nixl_agent_name", "staging_slots", "staging_max_tokens", "transfer_timeout_s",
                     "stats_path", "kv_checksum", "fault_flip_kv_byte_every", *NATS_AUTH_KEYS)


@dataclasses.dataclass(frozen=True)
class ExpressConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    transports: tuple[str, ...] = ("mooncake",)
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    nixl_agent_name: str | None = None
    staging_slots: int = 4
    staging_max_tokens: int = 0  # 0: vLLM's max_model_len
    transfer_timeout_s: float = 30.0
    stats_path: str = ""  # "": /dev/shm/expresslane-staging-<engine_id>
    kv_checksum: bool = False
    fault_flip_kv_byte_every: int = 0  # fault injection only (needs kv_checksum); 0: off
    nats_user: str = ""  # the bus's credential and TLS files: file paths, never secrets
    nats_password_file: str = ""
    nats_creds_file: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""

    def bus_auth(self) -> BusAuth:
        return BusAuth(user=self.nats_user, password_file=self.nats_password_file,
                       creds_file=self.nats_creds_file, tls_ca=self.nats_tls_ca,
                       tls_cert=self.nats_tls_cert, tls_key=self.nats_tls_key)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ExpressConfig":
        """Parse and validate; unknown keys are refused (a typo must not silently change nothing)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown ExpressConnector config keys {unknown}: known are "
                             f"{', '.join(EXTRA_CONFIG_KEYS)}")
        if "transports" in extra:
            t = extra["transports"]
            extra["transports"] = tuple([t] if isinstance(t, str) else t)
        config = cls(**extra)
        config.validate()
        return config

    def validate(self) -> None:
        self.bus_auth().validate()
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if not self.transports or bad:
            raise ValueError(f"transports {list(self.transports)}: use one or more of {TRANSPORTS}")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol {self.mooncake_protocol!r}: use 'rdma' or 'tcp'")
        if not 1 <= int(self.staging_slots) <= 1024:
            raise ValueError(f"staging_slots must be in 1..1024, got {self.staging_slots}")
        if int(self.staging_max_tokens) < 0:
            raise ValueError(f"staging_max_tokens must be >= 0, got {self.staging_max_tokens}")
        if not float(self.transfer_timeout_s) > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if not isinstance(self.kv_checksum, bool):
            raise ValueError(f"kv_checksum must be true or false, got {self.kv_checksum!r}")
        if int(self.fault_flip_kv_byte_every) < 0:
            raise ValueError(f"fault_flip_kv_byte_every must be >= 0, got {self.fault_flip_kv_byte_every}")
        if self.fault_flip_kv_byte_every and not self.kv_checksum:
            raise ValueError("fault_flip_kv_byte_every corrupts checksummed transfers: set kv_checksum too")

    def stats_file(self, engine_id: str) -> str:
        return self.stats_path or f"/dev/shm/expresslane-staging-{engine_id}"
