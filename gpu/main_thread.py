"""Run the executor's steps on the process's main thread, with trio in a thread of its own.

The executor actor's event loop must keep answering heartbeats while a step runs (a prefill
step can take seconds), so the step runs outside trio's thread. It used to run in one of
trio's worker threads; from the main thread, where OpenMP's thread team is the process's first
and its workers spin briefly at barriers (the default wait policy) instead of sleeping, the same
forward is faster (docs/benchmarks/cpu-levers/README.md: ~1.2x on W1 through the executor alone).

``MainThreadSteps.run(fn)`` (in trio) hands ``fn`` to the main thread and waits for its outcome;
``serve(stopped)`` is the main thread's loop until ``stopped`` is set.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio


class MainThreadSteps:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the main thread; return its result (or raise its exception)."""
        send, recv = trio.open_memory_channel[outcome.Outcome](1)

        def deliver(result: outcome.Outcome) -> None:
            try:
                send.send_nowait(result)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass  # the waiting task was cancelled (shutdown)

        self._jobs.put((fn, trio.lowlevel.current_trio_token(), deliver))
        result = await recv.receive()
        return result.unwrap()

    def serve(self, stopped: threading.Event) -> None:
        """The main thread's loop: run each job handed over, until ``stopped`` is set."""
        while not stopped.is_set():
            try:
                fn, token, deliver = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            result = outcome.capture(fn)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                return
