"""A regex whose compile runs past the timeout (grammar.py): the request gets a GrammarError, the same pattern
is refused at once afterwards, and later regexes still compile (on a fresh worker, not queued behind the one
still running). xgrammar's compile is replaced by a neighbour that blocks on an event for the slow pattern, so
nothing here depends on how fast the machine is: the slow one never finishes while the test looks."""

from __future__ import annotations

import threading

import pytest

from services.decode.engine import grammar
from services.decode.engine.grammar import GrammarError, Grammars
from shared.events import StructuredOutput

SLOW, FAST, OTHER_SLOW, THIRD_SLOW = "(a+)+b", "[ab]{3}x", "(b+)+a", "(c+)+d"


@pytest.fixture
def grammars(monkeypatch):
    release = threading.Event()
    calls: list[str] = []

    def compile_now(self, spec):
        calls.append(spec.regex)
        if spec.regex != FAST:
            release.wait()
        return f"compiled {spec.regex}"

    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(Grammars, "compiler", lambda self: None)
    monkeypatch.setattr(Grammars, "_compile_now", compile_now)
    g = Grammars(None, 16)
    yield g, calls, lambda: monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 60.0)  # ample for a quick compile
    release.set()


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput(kind="regex", regex=pattern)


def test_a_regex_past_its_timeout_does_not_hold_the_next_ones(grammars):
    g, calls, patient = grammars
    with pytest.raises(GrammarError, match="did not compile within 0.05 s: simplify it"):
        g.compile(regex(SLOW))
    patient()
    assert g.compile(regex(FAST)) == f"compiled {FAST}"  # a fresh worker: not queued behind SLOW
    with pytest.raises(GrammarError, match="did not compile within 60 s before"):
        g.compile(regex(SLOW))
    assert calls == [SLOW, FAST]  # refused without compiling it again


def test_regexes_are_refused_while_too_many_compiles_run_past_their_timeout(grammars):
    g, calls, patient = grammars
    for pattern in (SLOW, OTHER_SLOW):
        with pytest.raises(GrammarError, match="simplify it"):
            g.compile(regex(pattern))
    with pytest.raises(GrammarError, match="2 earlier regexes are still compiling past their timeout"):
        g.compile(regex(THIRD_SLOW))
    patient()
    with pytest.raises(GrammarError, match="still compiling"):
        g.compile(regex(FAST))
    assert calls == [SLOW, OTHER_SLOW]
