"""The virtual clock: a plain discrete-event loop, and the event log the simulated actors write.

Messages between simulated actors are delivered ``hop_s`` after they are sent (a constant
estimated from the recorded log; messages to the executor take ``to_executor_s``, calibrated
from the log, since a busy executor is the slowest to pick up its inbox), in the order they were
sent. Nothing sleeps: the clock jumps
to the next pending delivery or timer.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Loop:
    def __init__(self, hop_s: float = 0.0, to_executor_s: float | None = None) -> None:
        self.now = 0.0
        self.hop_s = hop_s
        self.latency = {"executor": hop_s if to_executor_s is None else to_executor_s}
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.handlers: dict[str, Callable[[Any], None]] = {}

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``t`` (not before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, args))

    def send(self, peer: str, msg: Any, delay: float | None = None) -> None:
        """Deliver ``msg`` to ``peer``'s handler one hop (or ``delay``) from now."""
        if delay is None:
            delay = self.latency.get(peer, self.hop_s)
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, self.handlers[peer], (msg,)))

    def run(self, until: float = float("inf")) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)


class SimLog:
    """What an actor's structlog logger does, into a list: ``log.info("event", **fields)``
    appends ``{**fields, event, actor, level, ts}`` with ``ts`` on the virtual clock (offset by
    the recorded run's start, so replayed events read like the original's). The real cores log
    through ``info``/``debug``/...; the simulated executor and front door write the events their
    real actors would log through ``record`` (they are records of a simulation, not emitted by
    the replay tool itself)."""

    def __init__(self, sink: list[dict[str, Any]], actor: str, loop: Loop, t0: float) -> None:
        self.sink = sink
        self.actor = actor
        self.loop = loop
        self.t0 = t0

    def _emit(self, level: str, event: str, kw: dict[str, Any]) -> None:
        kw["event"] = event
        kw["actor"] = self.actor
        kw["level"] = level
        kw["ts"] = self.t0 + self.loop.now
        self.sink.append(kw)

    def record(self, event: str, **kw: Any) -> None:
        self._emit("info", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, kw)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit("debug", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._emit("error", event, kw)


def write_events(events: list[dict[str, Any]], run_dir: str | Path) -> Path:
    """``RUN_DIR/events/ACTOR.jsonl``, as a real run lays them out (``minirt trace`` reads it)."""
    d = Path(run_dir) / "events"
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.jsonl"):
        old.unlink()
    files: dict[str, Any] = {}
    try:
        for e in events:
            f = files.get(e["actor"])
            if f is None:
                f = files[e["actor"]] = (d / f"{e['actor']}.jsonl").open("w", encoding="utf-8")
            f.write(json.dumps({**e, "ts": round(e["ts"], 6)}, default=str) + "\n")
    finally:
        for f in files.values():
            f.close()
    return d
