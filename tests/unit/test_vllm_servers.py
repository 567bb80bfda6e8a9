"""The test suite's vLLM server cache makes room as the plan wants: servers no test still wants go
first, then the least recently used (real processes stand in for the servers' process groups)."""

from __future__ import annotations

import subprocess

import pytest

from infra.processes import group_alive
from tests.fixtures.vllm import VllmServers


@pytest.mark.parametrize("needed,alive_after", [
    (set(), ["b", "c"]),          # nothing wanted: the least recently used goes
    ({"a"}, ["a", "c"]),          # "a" is wanted later: "b", the oldest of the rest, goes
    ({"a", "b"}, ["a", "b"]),     # "c" is the only one not wanted
    ({"a", "b", "c"}, ["b", "c"]),  # all wanted: the least recently used goes
])
def test_make_room_stops_what_no_test_wants_first(tmp_path, needed, alive_after):
    servers = VllmServers(tmp_path, max_alive=3)
    servers.still_needed = lambda: set(needed)
    procs = {}
    try:
        for key in ("a", "b", "c"):  # least recently used first
            procs[key] = subprocess.Popen(["sleep", "600"], start_new_session=True)
            servers._alive[key] = (key, procs[key])
        servers.make_room(1)
        assert list(servers._alive) == alive_after
        stopped = set(procs) - set(alive_after)
        assert all(not group_alive(procs[k].pid) for k in stopped)
        assert all(procs[k].poll() is None for k in alive_after)
    finally:
        servers.stop_all()
    assert all(p.poll() is not None for p in procs.values())


@pytest.mark.parametrize("failures,taken,starts,started", [
    (["Address already in use"], True, 2, True),                        # port taken once: a second start
    (["Address already in use"] * 3, True, 3, False),                   # taken every time: gives up
    (["ValueError: unknown model"], False, 1, False),                   # any other failure: no retry
])
def test_a_start_whose_port_was_taken_retries_on_another(tmp_path, failures, taken, starts, started):
    from tests.fixtures.vllm import VllmStartError, retry_taken_port

    calls = []

    def start():
        calls.append(1)
        if len(calls) <= len(failures):
            log = tmp_path / f"vllm-{len(calls)}.log"
            log.write_text(f"... sock.bind(addr)\nOSError: [Errno 98] {failures[len(calls) - 1]}\n"
                           if taken else failures[len(calls) - 1])
            raise VllmStartError("vLLM exited with 1 before it was ready", log, 0)
        return "server"

    if started:
        assert retry_taken_port(start) == "server"
    else:
        with pytest.raises(VllmStartError):
            retry_taken_port(start)
    assert len(calls) == starts
