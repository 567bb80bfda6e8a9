"""``./dev test``: the test suite in two pytest runs, the unit tests spread over the machine's cores.

The unit tests (pure cores, the fast path's kernels under Triton's interpreter) are single-threaded
Python and need no servers of their own, so ``pytest-xdist`` runs them on up to 8 workers at once (on a
2-core machine: 9 minutes -> 5). The integration and end-to-end tests then run in one process, as
before: they share session-wide vLLM servers that ``tests/fixtures/vllm_plan.py`` starts ahead of the
modules that use them, which one process per core would each start again.

Arguments go to both runs (``./dev test -q -k fp8``). Where an argument names a test path
(``./dev test tests/unit/test_events.py::test_x``), that is one ordinary pytest run of what was named.
Exit status: the first failing run's, or 0 (a run that selected nothing is not a failure when the other
ran tests).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = "tests/unit"
REST = ["tests/integration", "tests/e2e"]
MAX_WORKERS = 8  # each interpreted-kernel worker holds ~1-2 GB
NO_TESTS = 5  # pytest's exit status when nothing was selected


# pytest options whose value is the next argument (a value is not a test path, even one that exists)
VALUE_OPTIONS = {"-k", "-m", "-p", "-o", "-c", "-n", "-W", "-r", "--ignore", "--ignore-glob", "--deselect",
                 "--rootdir", "--basetemp", "--durations", "--maxfail", "--tb", "--junitxml", "--log-level",
                 "--confcutdir", "--dist"}


def names_paths(args: list[str]) -> bool:
    """Whether an argument names a test file, directory or node id (relative to the repository)."""
    return any(not a.startswith("-") and (i == 0 or args[i - 1] not in VALUE_OPTIONS)
               and (ROOT / a.split("::", 1)[0]).exists() for i, a in enumerate(args))


def unit_workers() -> int:
    """Worker processes for the unit run: one per core, 1 (no xdist) on one core or without xdist."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


def combine(codes: list[int]) -> int:
    """One exit status for the runs: the first failure's; "no tests" only when no run had tests."""
    ran = [c for c in codes if c != NO_TESTS]
    if not ran:
        return NO_TESTS
    return next((c for c in ran if c != 0), 0)


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if names_paths(argv):
        return subprocess.call([*pytest, *argv], cwd=ROOT)
    workers = unit_workers()
    # worksteal: an idle worker takes queued tests from a busy one (the interpreted kernel tests vary 100x)
    unit = [*pytest, UNIT, *argv] + (["-n", str(workers), "--dist", "worksteal"] if workers > 1 else [])
    codes = [subprocess.call(unit, cwd=ROOT)]
    codes.append(subprocess.call([*pytest, *REST, *argv], cwd=ROOT))
    return combine(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
