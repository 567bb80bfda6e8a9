"""Table-driven tests of the pure slot bookkeeping: where a step's tokens are cut and why."""

from __future__ import annotations

import pytest

from services.decode.engine.slots import SlotState, emit

CASES = [
    # (tokens, num_generated, max_tokens, stop, seq_len, max_seq_len) -> (emitted, reason)
    (([5], 0, 10, set(), 4, 100), ([5], None)),
    (([5, 6, 7], 0, 10, set(), 4, 100), ([5, 6, 7], None)),
    (([5, 6, 7], 8, 10, set(), 4, 100), ([5, 6], "length")),
    (([5, 6, 7], 9, 10, set(), 4, 100), ([5], "length")),
    (([5, 6, 7], 10, 10, set(), 4, 100), ([], "length")),
    (([5, 2, 7], 0, 10, {2}, 4, 100), ([5, 2], "stop")),
    (([2, 2], 0, 10, {2}, 4, 100), ([2], "stop")),
    (([5, 6, 7], 0, 10, set(), 96, 100), ([5, 6, 7], "length")),
    (([5, 6, 7], 0, 10, set(), 97, 100), ([5, 6], "length")),
    (([5], 0, 10, set(), 99, 100), ([], "length")),
    (([5, 6], 0, 2, {6}, 4, 100), ([5, 6], "stop")),
]


@pytest.mark.parametrize("args,expected", CASES)
def test_emit(args, expected):
    tokens, num_generated, max_tokens, stop, seq_len, max_seq_len = args
    s = SlotState(state="active", seq_len=seq_len, pending=1, num_generated=num_generated, max_tokens=max_tokens,
                  stop_token_ids=frozenset(stop))
    assert emit(s, tokens, max_seq_len) == expected
    emitted = expected[0]
    assert s.num_generated == num_generated + len(emitted)
    assert s.seq_len == seq_len + len(emitted)
    assert s.pending == (emitted[-1] if emitted else 1)
