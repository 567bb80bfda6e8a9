"""infra/suite.py (``./dev test``): which arguments name test paths, how two runs' exit statuses combine."""

import pytest

from infra.suite import NO_TESTS, combine, names_paths


@pytest.mark.parametrize("args, named", [
    ([], False),
    (["-q"], False),
    (["-q", "-k", "fp8"], False),
    (["-k", "tests"], False),  # an option's value that is not a path
    (["tests/unit"], True),
    (["-q", "tests/unit/test_events.py::test_x"], True),
    (["tests/integration/test_bus.py"], True),
    (["--ignore", "tests/e2e"], False),
    (["--ignore=tests/e2e", "-x"], False),
    (["tests/no_such_module.py"], False),  # pytest reports it in the two runs
])
def test_names_paths(args, named):
    assert names_paths(args) is named


@pytest.mark.parametrize("codes, status", [
    ([0, 0], 0),
    ([1, 0], 1),
    ([0, 1], 1),
    ([2, 1], 2),  # the first failure's
    ([NO_TESTS, 0], 0),  # -k selected only integration tests
    ([0, NO_TESTS], 0),
    ([NO_TESTS, 1], 1),
    ([NO_TESTS, NO_TESTS], NO_TESTS),
])
def test_combine(codes, status):
    assert combine(codes) == status
