"""The executor actor's constrained runs that wait for their constraint to compile.

A ``Run`` carries its constraint as the front door compiled it (``Run.grammar``, llguidance's
grammar text); one whose matcher is not in the executor's grammar cache is built in a worker
thread (llguidance releases the GIL while it builds), so the step loop goes on meanwhile; the answer
comes back through the actor's mailbox as a :class:`Done`. A preemption, abort or newer attempt
in the meantime drops the wait (``drop``/``take``), and a late answer is then ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from gpu.structured.engine import StructuredEngine
from gpu.structured.grammar import Compiled, GrammarError
from messages.executor import Run


class Done:
    """A worker thread's answer: ``run``'s constraint compiled, or refused."""

    __slots__ = ("result", "run", "seconds")

    def __init__(self, run: Run, result: Compiled | GrammarError, seconds: float) -> None:
        self.run = run
        self.result = result
        self.seconds = seconds


class PendingCompiles:
    def __init__(self, engine: StructuredEngine) -> None:
        self.engine = engine
        self.runs: dict[str, Run] = {}

    def cached(self, msg: Run) -> Compiled | GrammarError | None:
        """The run's matcher (or its refusal) if known without building; None means build it
        (``wait``). A constrained run without the front door's grammar breaks the protocol."""
        s = msg.params.structured
        assert s is not None
        if not msg.grammar:
            return GrammarError("grammar", "a constrained run must carry its compiled grammar")
        return self.engine.cache.built(s.kinds()[0], msg.grammar)

    def wait(self, nursery: trio.Nursery, msg: Run, deliver: Callable[[Done], None]) -> None:
        self.runs[msg.request_id] = msg
        nursery.start_soon(self._compile, msg, deliver)

    def build(self, msg: Run) -> Compiled | GrammarError:
        """The run's matcher, built here and now (``cached`` said it is not cached)."""
        spec = msg.params.structured
        assert spec is not None  # only constrained requests are built
        try:
            return self.engine.cache.build(spec.kinds()[0], msg.grammar)[0]
        except GrammarError as e:
            return e

    async def _compile(self, msg: Run, deliver: Callable[[Done], None]) -> None:
        t0 = time.perf_counter()
        result = await trio.to_thread.run_sync(self.build, msg)
        deliver(Done(msg, result, time.perf_counter() - t0))

    def take(self, done: Done) -> bool:
        """Whether ``done`` is for a run still waiting (it stops waiting)."""
        rid = done.run.request_id
        if self.runs.get(rid) is done.run:
            del self.runs[rid]
            return True
        return False

    def drop(self, request_id: str, attempt: int | None = None) -> bool:
        """Stop waiting for the request (of that attempt, if given); True if it was waiting."""
        run = self.runs.get(request_id)
        if run is None or (attempt is not None and run.attempt != attempt):
            return False
        del self.runs[request_id]
        return True

    def clear(self) -> None:
        self.runs.clear()
