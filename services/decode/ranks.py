"""A tensor-parallel decode node: one process per rank, rank 0 talks to the bus.

``expresslane decode --tensor-parallel-size N`` starts rank 0, which starts ranks 1..N-1 as child
processes of the same command (``EXPRESSLANE_TP_RANK`` / ``EXPRESSLANE_TP_ADDR`` in their
environment). Every rank joins one torch.distributed group (NCCL on CUDA, gloo on CPU) for the
model's collectives, plus a gloo group for control; loads its shard of the weights
(services/decode/engine/tp.py) onto its device (``cuda:<first + rank>`` for ``--device cuda[:first]``);
registers its own receive buffers with its own transport agent; and tells rank 0 where they are
(``RankEndpoints``, which rank 0 advertises in ``NodeAvailable.ranks`` so a prefill writes each
rank its share of the KV heads).

Rank 0 runs the node (server.py) over ``MirroredEngine``: each call that changes engine state
(inject, start, step, cancel, release) is broadcast to the other ranks before rank 0 runs it, so
every rank runs the same calls in the same order (SPMD) and the step's collectives meet. The other
ranks only follow (``follow``); their results are identical and discarded.

Failure: a rank that exits takes the node down. Rank 0 watches its children; when one exits it
fails every request it holds (retryable: the router migrates them), says it is draining, and
exits 1 (the coordinator also stops hearing its heartbeats). The children die with rank 0 (a
parent-death signal), ignore SIGINT/SIGTERM (rank 0 drives the shutdown: after its drain it sends
``exit``), and exit 1 when the control group breaks.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

import msgspec

from shared.events import KvLayoutSpec, RankEndpoints, SamplingParams
from shared.log import get_logger

RANK_ENV, ADDR_ENV = "EXPRESSLANE_TP_RANK", "EXPRESSLANE_TP_ADDR"
# A follower waits for its next command as long as the node lives: an idle node sends none.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
_log = get_logger("decode.ranks")


def rank_from_env() -> int:
    return int(os.environ.get(RANK_ENV, "0"))


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: ``cuda:<first + rank>`` for ``cuda[:first]``; the CPU for every rank."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the parent (rank 0) dies; no terminal signals."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Followers:
    """Rank 0's children (ranks 1..N-1) and the address their group meets at."""

    procs: list[subprocess.Popen]
    addr: str

    @classmethod
    def launch(cls, size: int, argv: list[str]) -> Followers:
        addr = f"127.0.0.1:{_free_port()}"
        code = "import sys; from services.decode.main import main; sys.exit(main(sys.argv[1:]))"
        procs = []
        for rank in range(1, size):
            env = {**os.environ, RANK_ENV: str(rank), ADDR_ENV: addr}
            procs.append(subprocess.Popen([sys.executable, "-c", code, *argv], env=env, start_new_session=True,
                                          preexec_fn=_die_with_parent))
        os.environ[ADDR_ENV] = addr
        return cls(procs, addr)

    def exited(self) -> tuple[int, int] | None:
        """(rank, exit status) of a child that has exited, None while all run."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return rank, p.returncode
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


class Group:
    """The ranks' process groups: ``model`` for the engine's collectives, ``control`` (gloo) for
    commands and the ranks' endpoints."""

    def __init__(self, rank: int, size: int, device: str) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.size = rank, size
        on_cuda = device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://{os.environ[ADDR_ENV]}",
                                rank=rank, world_size=size, timeout=datetime.timedelta(minutes=10))
        self.model = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def tensor_parallel(self):
        from services.decode.engine.tp import TensorParallel

        return TensorParallel(rank=self.rank, size=self.size, group=self.model)

    def broadcast(self, obj=None):
        """Rank 0 sends ``obj``; every rank returns it."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` at rank 0 (rank order); None elsewhere."""
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group at exit changes nothing
            pass


def endpoints_of(rank: int, receiver, layout: KvLayoutSpec) -> RankEndpoints:
    return RankEndpoints(tp_rank=rank, endpoints={receiver.name: receiver.endpoint}, slots=receiver.slot_targets(),
                         layout=layout, nixl_metadata_b64=receiver.metadata_b64)


def exchange_endpoints(group: Group, mine: RankEndpoints) -> list[RankEndpoints]:
    """Rank 0: ranks 1..N-1's receive buffers (from every rank, after each registered its own)."""
    got = group.gather(msgspec.to_builtins(mine))
    return [msgspec.convert(g, RankEndpoints) for g in got[1:]] if got is not None else []


class MirroredEngine:
    """Rank 0's engine: state-changing calls go to every rank first, then run here; reads are local.

    An unseeded sampled request gets a seed here, so that every rank draws the same tokens."""

    MIRRORED = ("inject", "start", "step", "cancel", "release")

    def __init__(self, engine, group: Group) -> None:
        self._engine, self._group = engine, group
        self._lock = threading.Lock()  # one command at a time, in one order on every rank

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _call(self, name: str, *args):
        with self._lock:
            self._group.broadcast((name, args))
            return getattr(self._engine, name)(*args)

    def inject(self, slot: int, num_tokens: int) -> None:
        return self._call("inject", slot, num_tokens)

    def start(self, slot: int, first_token_id: int, sampling: SamplingParams) -> None:
        if sampling.seed is None and sampling.temperature:
            sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(62))
        return self._call("start", slot, first_token_id, sampling)

    def step(self):
        return self._call("step")

    def cancel(self, slot: int) -> None:
        return self._call("cancel", slot)

    def release(self, slot: int) -> None:
        return self._call("release", slot)

    def shutdown(self) -> None:
        """Tell the other ranks to exit (after the node drained)."""
        with self._lock:
            self._group.broadcast(("exit", ()))


def follow(engine, group: Group) -> int:
    """A follower's life: run rank 0's commands until ``exit`` (0) or the control group breaks (1)."""
    log = _log.bind(tp_rank=group.rank)
    while True:
        try:
            name, args = group.broadcast()
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone: so is this rank
            log.error("tp_control_lost", error=str(exc), hint="rank 0 exited; this rank exits with it")
            return 1
        if name == "exit":
            log.info("tp_rank_exit")
            return 0
        if name not in MirroredEngine.MIRRORED:
            log.error("tp_unknown_command", command=name)
            return 1
        try:
            getattr(engine, name)(*args)
        except Exception as exc:  # noqa: BLE001 - rank 0 met the same error and reports it
            log.warning("tp_command_failed", command=name, error=f"{type(exc).__name__}: {exc}")
