"""The one CUDA-graph runner: capture a static-shaped function once per input signature, replay it.

``GraphedFn(fn, use_graph)`` is called like ``fn``. With ``use_graph`` False (CPU, or graphs turned
off) a call runs ``fn`` eagerly, the same code path, so the logic around it is testable without a GPU.
On CUDA the first call with a new signature (tensor shapes and dtypes, plus the values of non-tensor
arguments such as the attended key count) captures one graph, all of a runner's graphs in one memory
pool; every call then copies its tensor inputs into the graph's static buffers and replays it.
Outputs are the graph's static tensors: valid until the next replay of the same signature.

- ``steps_per_replay=n``: one call runs ``n`` consecutive calls of ``fn`` (a step that reads and
  advances its own device state), one host launch and no synchronisation.
- Warm-up calls (``warmup_calls``, on a side stream: Triton compiles, cuBLAS picks algorithms) repeat
  the real call. A step that advances device state passes ``before_capture``, which restores that
  state after the warm-up and again after capturing, so capturing is invisible to the caller.
- A capture on first call that fails runs that signature eagerly and says so once; ``capture(*args)``
  captures up front and lets the error propagate (the fast path turns itself off on it).

Needs torch only (no Triton), so the engine's reference step imports it without the kernels.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def signature(args: tuple) -> tuple:
    """The graph key of a call: (shape, dtype) per tensor argument, the value of any other."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class GraphedFn:
    """``fn`` replayed from CUDA graphs, one per input signature; eager when ``use_graph`` is False."""

    def __init__(self, fn: Callable, use_graph: bool, *, steps_per_replay: int = 1, warmup_calls: int = 2,
                 before_capture: Callable[[], None] | None = None, device: torch.device | str | None = None):
        self.fn, self.use_graph, self.steps_per_replay = fn, use_graph, steps_per_replay
        self.warmup_calls, self.before_capture = warmup_calls, before_capture
        self.device = torch.device(device) if device is not None else None
        self.graphs: dict[tuple, tuple | None] = {}  # signature -> (static inputs, outputs, graph); None: eager
        self.pool = None

    def __call__(self, *args):
        """``steps_per_replay`` calls of ``fn(*args)`` (one graph replay on CUDA); the last call's output."""
        entry = self._entry(args) if self.use_graph else None
        if entry is None:
            out = None
            for _ in range(self.steps_per_replay):
                out = self.fn(*args)
            return out
        static_in, out, graph = entry
        for buf, a in zip(static_in, args):
            if isinstance(a, torch.Tensor):
                buf.copy_(a)
        graph.replay()
        return out

    def capture(self, *args) -> None:
        """Capture the graph of this signature now (no-op off CUDA or when captured); errors propagate."""
        key = signature(args)
        if self.use_graph and key not in self.graphs:
            self.graphs[key] = self._capture(args)

    def _entry(self, args: tuple):
        key = signature(args)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(args)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run this signature eagerly
                log.warning("CUDA graph capture failed for %s, running eagerly: %s", key, e)
                self.graphs[key] = None
                if self.before_capture is not None:
                    self.before_capture()
        return self.graphs[key]

    def _capture(self, args: tuple) -> tuple:
        static_in = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.fn(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self.before_capture is not None:
            self.before_capture()  # restore the state the warm-up calls advanced
        # Python's cyclic GC must not run inside the capture: freeing an unreachable CUDA graph there (an
        # engine or decoder let go of earlier) is a call the capturing stream refuses, and it invalidates
        # the capture (seen on an H200 after another engine in the same process). Collect now, pause it.
        gc.collect()
        gc_on = gc.isenabled()
        gc.disable()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                for _ in range(self.steps_per_replay):
                    out = self.fn(*static_in)
        finally:
            if gc_on:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self.pool = graph.pool()
        if self.before_capture is not None:
            self.before_capture()
        return static_in, out, graph
