"""A CUDA graph capture runs with Python's cyclic GC paused (and after a collection): a graph freed by the
GC inside another capture invalidates that capture. torch.cuda's capture pieces are stood in for (no GPU)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from services.decode.engine.cuda import graph as graph_mod
from services.decode.engine.cuda.graph import GraphedFn


class FakeGraph:
    def pool(self):
        return "pool"


@pytest.fixture
def fake_cuda(monkeypatch):
    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    captures = []

    @contextlib.contextmanager
    def capture(g, pool=None):
        captures.append(g)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    return captures


@pytest.mark.parametrize("fails", [False, True])
def test_the_capture_runs_with_the_gc_paused_and_restores_it(fake_cuda, monkeypatch, fails):
    collected, during = [], []
    monkeypatch.setattr(graph_mod.gc, "collect", lambda *a: collected.append(1) or 0)

    def fn():
        if fake_cuda:  # inside the capture (the warm-up calls come before it)
            during.append(gc.isenabled())
            if fails:
                raise RuntimeError("capture invalidated")
        return 7

    runner = GraphedFn(fn, True, steps_per_replay=2)
    assert gc.isenabled()
    if fails:
        with pytest.raises(RuntimeError):
            runner.capture()
    else:
        runner.capture()
        assert len(runner.graphs) == 1
    assert collected and during and not any(during)  # collected first, paused throughout the capture
    assert gc.isenabled()  # back on, also when the capture raised
