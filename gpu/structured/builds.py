"""The constrained runs whose matcher is being built, off the step loop.

A ``Run`` carries its constraint as the front door compiled it (``Run.grammar``, llguidance's
grammar text). Its matcher is looked up in the executor's grammar cache; when it is not there,
the run waits here while the driver builds it (``build_grammar``, in a worker thread:
llguidance releases the GIL while it builds) and hands it back as ``GrammarBuilt``. A preemption,
abort or newer attempt meanwhile drops the wait, and a late answer is then ignored.
"""

from __future__ import annotations

from actors.shared.grammar import Compiled, GrammarCache, GrammarError
from messages.executor import Run


class GrammarBuilt:
    """The driver's answer for a run of ``MatcherBuilds.take``: its matcher, or why not."""

    __slots__ = ("result", "run", "seconds")

    def __init__(self, run: Run, result: Compiled | GrammarError, seconds: float) -> None:
        self.run = run
        self.result = result
        self.seconds = seconds


def build_grammar(cache: GrammarCache, run: Run) -> Compiled | GrammarError:
    """``run``'s matcher from the front door's grammar (slow: a driver runs it in a thread)."""
    spec = run.params.structured
    assert spec is not None  # only constrained runs are built
    try:
        return cache.build(spec.kinds()[0], run.grammar)[0]
    except GrammarError as e:
        return e


class MatcherBuilds:
    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self.runs: dict[str, Run] = {}  # waiting for their matcher
        self._new: list[Run] = []  # ... not yet handed to the driver

    def start(self, run: Run) -> Compiled | GrammarError | None:
        """The run's matcher (or why it cannot have one) if known now; None: it waits."""
        spec = run.params.structured
        assert spec is not None
        if not run.grammar:  # the front door compiles every constraint: a peer's bug
            return GrammarError("grammar", "a constrained run must carry its compiled grammar")
        found = self.cache.built(spec.kinds()[0], run.grammar)
        if found is None:
            self.runs[run.request_id] = run
            self._new.append(run)
        return found

    def take(self) -> list[Run]:
        """The runs the driver is to build (``build_grammar``) and hand back."""
        out, self._new = self._new, []
        return out

    def done(self, built: GrammarBuilt) -> bool:
        """Whether ``built`` is for a run still waiting (it stops waiting)."""
        rid = built.run.request_id
        if self.runs.get(rid) is built.run:
            del self.runs[rid]
            return True
        return False

    def drop(self, request_id: str, attempt: int | None = None) -> bool:
        """Stop waiting for the request (of that attempt, if given); True if it was waiting."""
        run = self.runs.get(request_id)
        if run is None or (attempt is not None and run.attempt != attempt):
            return False
        del self.runs[request_id]
        self._new = [r for r in self._new if r is not run]
        return True

    def clear(self) -> None:
        self.runs.clear()
        self._new.clear()
