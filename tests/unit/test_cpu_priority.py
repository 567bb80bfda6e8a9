"""shared.cpu_priority: a decode node's CPU priority below the services it shares a host with. Each
case runs in a child process (a raised nice value cannot be taken back without privilege), as a
session leader or not, against a stand-in autogroup file or the kernel's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared import cpu_priority

ROOT = Path(__file__).resolve().parents[2]


def run_child(nice: int, autogroup: str, *, session_leader: bool, start_nice: int = 0) -> dict:
    code = ("import json, os, sys; from pathlib import Path; from shared import cpu_priority\n"
            f"os.setpriority(os.PRIO_PROCESS, 0, {start_nice})\n"
            f"got = cpu_priority.lower({nice}, Path({autogroup!r}))\n"
            "print(json.dumps({'got': got, 'nice': os.getpriority(os.PRIO_PROCESS, 0)}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=session_leader)
    return json.loads(out.stdout)


@pytest.mark.parametrize("nice, start_nice, session_leader, want_nice, want_group", [
    (10, 0, True, 10, "10"),    # the thread and its session's group
    (19, 0, True, 19, "19"),
    (10, 0, False, 10, None),   # not a session leader: the shell's group is left alone
    (5, 12, True, 12, "5"),     # never raises its own priority back
    (0, 0, True, 0, None),      # 0 changes nothing
])
def test_lower_sets_the_thread_and_a_leaders_group(tmp_path, nice, start_nice, session_leader, want_nice,
                                                   want_group):
    group = tmp_path / "autogroup"
    group.write_text("untouched")
    got = run_child(nice, str(group), session_leader=session_leader, start_nice=start_nice)
    assert got["nice"] == want_nice
    assert group.read_text() == (want_group if want_group is not None else "untouched")
    if want_group is None and nice:
        assert got["got"]["autogroup"].startswith("not a session leader")


def test_without_autogroup_only_the_thread(tmp_path):
    got = run_child(7, str(tmp_path / "absent"), session_leader=True)
    assert got["nice"] == 7
    assert got["got"]["autogroup"].startswith("none")


@pytest.mark.skipif(not cpu_priority.AUTOGROUP.exists(), reason="this kernel does not group sessions")
def test_the_kernels_session_group_takes_the_value():
    got = run_child(9, str(cpu_priority.AUTOGROUP), session_leader=True)
    assert got["nice"] == 9
    assert got["got"]["autogroup"].endswith("nice 9")  # what /proc reads back, e.g. "/autogroup-12 nice 9"


def test_a_refused_call_leaves_the_priority_and_says_why(monkeypatch, tmp_path):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(cpu_priority.os, "setpriority", refuse)
    group = tmp_path / "autogroup"
    group.write_text("untouched")
    got = cpu_priority.lower(10, group)
    assert got["nice"] == os.getpriority(os.PRIO_PROCESS, 0) and "not permitted" in got["not_set"]
    assert group.read_text() == "untouched"


@pytest.mark.parametrize("nice", [-1, 20])
def test_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match="nice must be 0 to 19"):
        cpu_priority.lower(nice)
