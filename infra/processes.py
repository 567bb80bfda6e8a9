"""Child processes in their own process groups: a free port to give them, and one way to stop them.

Contract:
- ``free_port()``: a TCP port on 127.0.0.1 that was free a moment ago; ``free_ports(n)``: n distinct ones.
- ``group_alive(pgid)``: whether a live (not zombie) process is in the group.
- ``group_cpu_s(pgid)``: CPU seconds (user + system) of the group's live processes;
  ``process_cpu_s(pid)``: of one process (None once it has gone).
- ``stop_process_groups(popens, grace_s)``: SIGTERM every group (started with
  ``start_new_session=True``, so pgid == pid) in reverse order, SIGKILL the groups still alive after
  ``grace_s``, wait up to ``kill_wait_s`` for them to go; returns the processes whose group needed
  SIGKILL. A group alive even then is the caller's to report (``group_alive``).
- ``shared_host_omp_env(reserved_cores)``: OpenMP settings for vLLM's CPU build when other busy
  processes share the host's cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

POLL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing was bound to when asked."""
    return free_ports(1)[0]


def free_ports(num: int) -> list[int]:
    """``num`` distinct TCP ports on 127.0.0.1 that nothing was bound to when asked (all held at
    once while picking, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(num)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    # fields: state, ppid, pgrp, ...
    return any(int(f[2]) == pgid and f[0] != "Z" for f in _proc_stats())


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process in group ``pgid``."""
    # fields: state, ppid, pgrp, ..., utime (11), stime (12)
    ticks = sum(int(f[11]) + int(f[12]) for f in _proc_stats() if int(f[2]) == pgid)
    return ticks / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process ``pid`` (all its threads); None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_stats():
    """The fields after the command name of /proc/<pid>/stat, for every process still there."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                yield f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group led by ``popen`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)


def _any_alive(popens: Sequence[subprocess.Popen]) -> bool:
    for p in popens:
        p.poll()  # reap the leader, so it does not count as alive
    return any(group_alive(p.pid) for p in popens)


def _wait_gone(popens: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _any_alive(popens):
        time.sleep(POLL_S)


def stop_process_groups(popens: Sequence[subprocess.Popen], grace_s: float,
                        kill_wait_s: float = 10.0) -> list[subprocess.Popen]:
    """SIGTERM each group, SIGKILL what is left after ``grace_s``; returns those that needed SIGKILL."""
    for p in reversed(popens):
        signal_group(p, signal.SIGTERM)
    _wait_gone(popens, grace_s)
    killed = [p for p in popens if _any_alive([p])]
    for p in killed:
        signal_group(p, signal.SIGKILL)
    _wait_gone(killed, kill_wait_s)
    return killed


def shared_host_omp_env(reserved_cores: int, cores: int | None = None) -> dict[str, str]:
    """OpenMP settings for vLLM's CPU build on a host whose cores it shares (``expresslane up``,
    the tests): ``reserved_cores`` stay for the other busy processes (decode nodes, router, NATS).
    vLLM's defaults bind one OpenMP thread to every core it is given and let them spin between
    parallel regions; beside other busy processes each region then waits for a thread whose core
    is taken (a 5 ms prefill took 30-140 ms at 4 concurrent express requests on 2 cores) and the
    spinning takes cores from the rest. Here: ``cores - reserved_cores`` threads (at least one),
    unbound, so the kernel places them where a core is free."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return {"OMP_NUM_THREADS": str(max(1, cores - reserved_cores)), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
