"""CUDA graphs for the static-shaped decode functions, keyed by input shapes.

``GraphedFn(fn, enabled)`` calls ``fn(*args)`` eagerly off CUDA; on CUDA it captures one graph
per distinct input signature (tensor shapes and dtypes, plus the values of int arguments such as
the attended key count) on first use, all in one memory pool,
then replays it after copying the inputs into the graph's static buffers. Outputs are the graph's
static tensors: valid until the next replay of the same signature. Warm-up runs repeat the real
call (same cache writes), so capturing is invisible to the caller. A capture that fails falls
back to eager for that signature and says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def key_of(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class GraphedFn:
    def __init__(self, fn: Callable, enabled: bool):
        self.fn = fn
        self.enabled = enabled
        self.graphs: dict[tuple, tuple | None] = {}
        self.pool = None

    def __call__(self, *args: torch.Tensor | int):
        if not self.enabled:
            return self.fn(*args)
        key = key_of(args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        entry = self.graphs[key]
        if entry is None:
            return self.fn(*args)
        static_in, out, graph = entry
        for buf, a in zip(static_in, args):
            if isinstance(a, torch.Tensor):
                buf.copy_(a)
        graph.replay()
        return out

    def _capture(self, args: tuple[torch.Tensor | int, ...]):
        try:
            static_in = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn(*static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fn(*static_in)
            self.pool = graph.pool()
            return static_in, out, graph
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this shape eagerly
            log.warning("CUDA graph capture failed for %s, running eagerly: %s", key_of(args), e)
            return None
