"""A service's CPU priority on a host whose cores it shares with the prefill server.

Why: where a decode node and vLLM run on the same cores (``expresslane up`` on one machine), a
busy node takes CPU from the prefill that an express request's first token waits for, and the
faster the node decodes, the more often that happens. Measured on a 2-core host at 4 concurrent
express requests (2 nodes x 2 slots, tiny Llama): first-token p50 62 ms with the nodes at the
default priority, 29 ms at nice 10, 23 ms at nice 19, with the same requests a second.

Linux weighs CPU between *sessions* first when the kernel groups them (``autogroup``, on by default
on most distributions): each ``setsid`` process gets a group, and a process's own nice value then
only orders it against the threads of its own session. So :func:`lower` sets both: the calling
thread's nice value (threads it starts later inherit it: call it before starting any), and, when
the process leads its own session (as ``expresslane up`` and the tensor-parallel ranks start it),
its session group's (``/proc/self/autogroup``). A process that does not lead its session leaves the
group alone: that group is the shell or supervisor that started it. Raising a nice value needs no
privilege; lowering one below 0 would, and is refused here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MAX_NICE = 19
AUTOGROUP = Path("/proc/self/autogroup")


def lower(nice: int, autogroup: Path = AUTOGROUP) -> dict[str, Any]:
    """Run this process (its calling thread, and its session group where it leads one) at ``nice``
    (0-19; 0 changes nothing). Returns what was set, to log."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be 0 to {MAX_NICE}, got {nice}")
    if nice == 0:
        return {"nice": 0}
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError as exc:  # e.g. a sandbox that filters the call: run as we are, and say so
        return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "not_set": str(exc)}
    out: dict[str, Any] = {"nice": os.getpriority(os.PRIO_PROCESS, 0)}
    if os.getsid(0) != os.getpid():
        out["autogroup"] = "not a session leader: left to the session"
    elif not autogroup.exists():
        out["autogroup"] = "none (the kernel does not group sessions)"
    else:
        try:
            autogroup.write_text(str(nice))
            out["autogroup"] = autogroup.read_text().strip()
        except OSError as exc:
            out["autogroup"] = f"not set: {exc}"
    return out
