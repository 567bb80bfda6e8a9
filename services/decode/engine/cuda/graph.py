"""CUDA-graph runner: capture a step function once, replay it; eager on CPU (the same code path).

``GraphRunner(fn, steps_per_replay=n)`` captures ``n`` consecutive calls of ``fn`` (a step that reads
and advances its own device state) into one graph; ``replay()`` launches them with one host call and
no synchronisation. On a CPU device, or with ``use_graph=False``, ``replay()`` simply calls ``fn``
``n`` times, so the logic around it is testable without a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch


class GraphRunner:
    """Capture-once, replay-many wrapper around a device-state step function."""

    def __init__(self, fn: Callable[[], None], device: torch.device | str, *, steps_per_replay: int = 1,
                 use_graph: bool = True, warmup_calls: int = 2, before_capture: Callable[[], None] | None = None):
        self.fn, self.steps_per_replay = fn, steps_per_replay
        self.device = torch.device(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if use_graph and self.device.type == "cuda":
            self._capture(warmup_calls, before_capture)

    def _capture(self, warmup_calls: int, before_capture: Callable[[], None] | None) -> None:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup_calls):  # compile Triton kernels, pick cuBLAS algorithms
                self.fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if before_capture is not None:
            before_capture()  # restore the state the warm-up calls advanced
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(self.steps_per_replay):
                self.fn()
        torch.cuda.synchronize(self.device)
        if before_capture is not None:
            before_capture()

    @property
    def is_graph(self) -> bool:
        return self.graph is not None

    def replay(self) -> None:
        """Run ``steps_per_replay`` steps (graph replay on CUDA, eager calls otherwise)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.steps_per_replay):
                self.fn()
