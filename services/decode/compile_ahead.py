"""Grammars compile off the decode loop, ahead of need: the engine's grammar compiler (the
tokenizer's vocabulary) once at start (the node process builds it before it freezes its heap and
serves), and a request's grammar in a worker thread as soon as its ``DecodeStart`` arrives, while its
KV travels, so the start finds it in the compiler's cache. An engine without grammars
(``engine.grammars`` absent) makes both no-ops."""

from __future__ import annotations

import asyncio

from shared.events import DecodeStart


class CompileAhead:
    def __init__(self, engine, log) -> None:
        self.engine, self.log = engine, log
        self._tasks: set[asyncio.Task] = set()

    def warm(self) -> None:
        if getattr(self.engine, "grammars", None) is not None:
            self._spawn(self._warm)

    async def warm_now(self) -> None:
        """The compiler built before the node serves (the process's entry point, so that what it loads
        is in the heap it freezes); :meth:`warm` then finds it built."""
        if getattr(self.engine, "grammars", None) is not None:
            await asyncio.to_thread(self._warm)

    def prepare(self, msg: DecodeStart) -> None:
        prepare = getattr(self.engine, "prepare_grammar", None)
        if msg.sampling.structured is not None and prepare is not None:
            self._spawn(prepare, msg.sampling)

    def _spawn(self, fn, *args) -> None:
        task = asyncio.create_task(asyncio.to_thread(fn, *args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _warm(self) -> None:
        try:
            self.engine.grammars.compiler()
        except Exception as exc:  # noqa: BLE001 - no tokenizer: structured requests fail with the reason
            self.log.warning("grammar_compiler_unavailable", reason=str(exc),
                             hint="structured output needs the model's tokenizer files next to its weights")
