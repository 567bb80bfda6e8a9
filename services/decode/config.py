"""The decode node's settings: its command-line flags (each also ``EXPRESSLANE_<FLAG>``, see
shared/config.py), parsed once into a typed ``DecodeConfig`` whose ``validate()`` names the flag
that is wrong, then passed down; the engine's own settings ride in ``DecodeConfig.engine``."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.decode.engine.options import CPU_STEP_MODES, FAST_PATH_MODES, KV_CACHE_DTYPES, MAX_SPECULATIVE_TOKENS, \
    EngineConfig
from shared import config as shared_config
from shared import subjects
from shared.bus_auth import BusAuth
from shared.cpu_priority import MAX_NICE


@dataclass(frozen=True)
class DecodeConfig:
    model: str  # HF checkpoint directory
    node_id: str
    engine: EngineConfig  # slots, max_seq_len, device, dtype, drafts, fast path
    nats_url: str = shared_config.DEFAULT_NATS_URL
    bus_auth: BusAuth = field(default_factory=BusAuth)  # NATS credential and TLS files
    log_level: str = "INFO"
    log_format: str = "json"
    transport: str = "mooncake"
    transport_host: str = "127.0.0.1"
    transport_protocol: str = "tcp"
    heartbeat_ms: int = 1000
    http_host: str = "127.0.0.1"
    http_port: int = 9103
    drain_timeout_s: float = 30.0
    require_kv_checksum: bool = False  # a KvReady without checksums fails the lease
    num_checksum_threads: int = 4  # threads that verify one KvReady's segment sums
    torch_threads: int = 1  # torch's intra-op threads (CPU work of the engine's step)
    fault_stall_after_tokens: int = 0  # FAULT INJECTION: the engine hangs (tests, bench only)
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is sharded over
    cpu_nice: int = 0  # this node's CPU priority below the host's other services (shared.cpu_priority)

    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DecodeConfig:
        """The parsed flags as a config (an empty --node-id becomes decode-HOST-PID)."""
        engine = EngineConfig(
            num_slots=args.slots, max_seq_len=args.max_seq_len, device=args.device, dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            num_speculative_tokens=args.num_speculative_tokens, fast_path=args.fast_path,
            mtp_draft_vocab=args.mtp_draft_vocab, tokenizer=args.tokenizer or None,
            adaptive_speculation=args.adaptive_speculation, moe_parallel=args.moe_parallel,
            cpu_step=args.cpu_step)
        return cls(
            model=args.model, node_id=args.node_id or default_node_id(), engine=engine,
            nats_url=args.nats_url, bus_auth=shared_config.bus_auth(args),
            log_level=args.log_level, log_format=args.log_format,
            transport=args.transport, transport_host=args.transport_host,
            transport_protocol=args.transport_protocol, heartbeat_ms=args.heartbeat_ms,
            http_host=args.http_host, http_port=args.http_port, drain_timeout_s=args.drain_timeout_s,
            require_kv_checksum=args.require_kv_checksum, num_checksum_threads=args.checksum_threads,
            torch_threads=args.torch_threads,
            fault_stall_after_tokens=args.fault_stall_after_tokens,
            tensor_parallel_size=args.tensor_parallel_size, cpu_nice=args.cpu_nice)

    def validate(self) -> DecodeConfig:
        """Raise ValueError naming the flag whose value cannot work; return self."""
        for flag, value in (("--slots", self.num_slots), ("--max-seq-len", self.max_seq_len),
                            ("--heartbeat-ms", self.heartbeat_ms),
                            ("--checksum-threads", self.num_checksum_threads),
                            ("--torch-threads", self.torch_threads)):
            if value < 1:
                raise ValueError(f"{flag} must be 1 or more, got {value}")
        k = self.engine.num_speculative_tokens
        if k is not None and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be 0 to {MAX_SPECULATIVE_TOKENS}, got {k}")
        if self.engine.mtp_draft_vocab is not None and self.engine.mtp_draft_vocab < 1:
            raise ValueError(f"--mtp-draft-vocab must be 1 or more, got {self.engine.mtp_draft_vocab}")
        if self.fault_stall_after_tokens < 0:
            raise ValueError(f"--fault-stall-after-tokens must be 0 or more, got {self.fault_stall_after_tokens}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be 0 or more, got {self.drain_timeout_s}")
        if not 0 <= self.cpu_nice <= MAX_NICE:
            raise ValueError(f"--cpu-nice must be 0 to {MAX_NICE}, got {self.cpu_nice}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be 1 or more, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            if self.require_kv_checksum:
                raise ValueError("--require-kv-checksum needs --tensor-parallel-size 1: a prefill sends segment "
                                 "checksums only to a single-rank node (several writers fill a rank's rows)")
            if self.engine.fast_path == "on":
                raise ValueError("--fast-path on needs --tensor-parallel-size 1: the CUDA fast path is "
                                 "single-GPU; a tensor-parallel node decodes on the reference step (--fast-path auto)")
        try:
            subjects.node_avail(self.node_id)
        except ValueError as exc:
            raise ValueError(f"--node-id: {exc}") from None
        self.engine.validate()
        return self


def default_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"decode-{host}-{os.getpid()}"


def parse(argv: Sequence[str] | None) -> DecodeConfig:
    """Flags and EXPRESSLANE_* variables -> a validated config (exit status 2 with a message if not)."""
    parser = build_parser()
    args = shared_config.parse_args(parser, argv)
    try:
        return DecodeConfig.from_args(args).validate()
    except ValueError as exc:
        parser.error(str(exc))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane decode", description="Run a decode node: the "
                                "express-lane engine with pre-registered KV receive buffers.")
    shared_config.add_common_args(p)
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--slots", type=int, default=1, help="concurrent requests (receive buffers)")
    p.add_argument("--node-id", default="", help="name on the bus (default decode-HOST-PID)")
    p.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    p.add_argument("--transport-host", default="127.0.0.1", help="address senders reach us on")
    p.add_argument("--transport-protocol", default="tcp", choices=["tcp", "rdma"], help="mooncake")
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens per slot (prompt + output)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="slot K/V as vLLM's --kv-cache-dtype: auto keeps the model dtype; fp8 (= fp8_e4m3) or "
                        "fp8_e5m2 keep vLLM's FP8 KV bytes with the checkpoint's k/v scales (Llama/Qwen family); "
                        "a dense MLA model (DeepSeek family) keeps its latent in fp8 (E4M3, as vLLM's CUDA MLA "
                        "backends). Must equal the prefill vLLM's, else its handoffs are refused (default auto)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per step, 0 to 3 (default: one per MTP layer of the "
                        "model, 0 for models without MTP layers)")
    p.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True,
                   help="each request drafts as many MTP tokens per step (0 up to --num-speculative-tokens) "
                        "as its accepted drafts pay for, and stops drafting (probing again now and then) "
                        "where they are not accepted, so speculation never slows a request down (a CPU "
                        "node's steps verify drafts at about a step a token: no draft can pay there, and "
                        "its requests do not draft); "
                        "--no-adaptive-speculation drafts every step (default: adaptive)")
    p.add_argument("--mtp-draft-vocab", type=int, default=None, metavar="N",
                   help="on the fast path, MTP drafts propose only token ids < N: a draft head of N rows "
                        "instead of the whole vocabulary (BPE ids run from frequent to rare); output is "
                        "unchanged, acceptance may drop (default: the whole vocabulary)")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="the tokenizer's directory for grammars (structured output), as vLLM's --tokenizer "
                        "(default: the model directory)")
    p.add_argument("--fast-path", choices=FAST_PATH_MODES, default="auto",
                   help="the CUDA fast path: fused Triton kernels replayed as CUDA graphs for Llama/Qwen- and "
                        "DeepSeek-V3-family models (bf16, or FP8 weights with per-channel, per-tensor or "
                        "block scales), greedy and sampled requests, 1-8 slots a step (auto: wherever the "
                        "model, dtype and device allow, the node logs why not; on: refuse to start otherwise; "
                        "off: the reference step)")
    p.add_argument("--cpu-step", choices=CPU_STEP_MODES, default="auto",
                   help="on a CPU node, a float32 model's decode step (Llama/Qwen family; DeepSeek-V3 family "
                        "with dense attention, its MTP drafts and their verification included) in one native "
                        "call a token, "
                        "compiled for this host with its C compiler on first use (auto: "
                        "where it applies, the node logs why not, e.g. no compiler; off: torch's ops); "
                        "the same tokens either way")
    p.add_argument("--torch-threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads for the engine's CPU work (default 1): a decode step is "
                        "many small ops, which more threads slow down (their barriers) and which then "
                        "take cores from the prefill and other nodes on the host; raise it only for a "
                        "CPU decode node with a large model on cores of its own")
    p.add_argument("--cpu-nice", type=int, default=0, metavar="N",
                   help="on a host whose cores the node shares with a prefill server, run the node at "
                        "nice N, below the other services (0-19; default 0): its steps then wait "
                        "while vLLM prefills, which is where an express request's first token waits "
                        "(`expresslane up` sets 19). Sets the node's session group too when it leads "
                        "its session (Linux autogroup). Nothing to gain on a host of its own")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process and one GPU each (cuda:K..K+N-1 for "
                        "--device cuda:K; gloo on CPU): this process is rank 0 and starts the others; each "
                        "rank keeps its share of the KV heads and registers its own receive buffers")
    p.add_argument("--moe-parallel", choices=["tp", "ep"], default="tp",
                   help="with --tensor-parallel-size > 1, how MoE experts split: tp slices every expert "
                        "over the ranks, ep gives each rank whole experts")
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=9103, help="/health and /metrics (0: any free)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--require-kv-checksum", action="store_true",
                   help="fail a handoff whose KV-ready carries no segment checksums (start the prefill "
                        "with --kv-checksum); checksums that come are verified either way")
    p.add_argument("--checksum-threads", type=int, default=4,
                   help="threads that verify a KV-ready's segment checksums")
    p.add_argument("--fault-stall-after-tokens", type=int, default=0, metavar="N",
                   help="FAULT INJECTION, for tests and bench only: once a request on its first leg "
                        "(not one migrated here) has N completion tokens, the engine stops stepping "
                        "for good while the node keeps its heartbeats and /health: a hung engine "
                        "(0: off)")
    return p
