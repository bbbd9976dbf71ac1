"""Structured JSON events: one line per decision, to stdout and RUN_DIR/events/ACTOR.jsonl.

Configure once per process with ``configure(actor, run_dir)``; then ``log = get_logger()`` and
``log.info("request.admitted", request_id=rid, ...)``. Each line carries ``ts`` (unix seconds),
``actor``, ``event``, ``level`` and the fields given; ``request_id`` can be bound with
``structlog.contextvars.bound_contextvars`` where a whole code path concerns one request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import structlog


def _default(o: Any) -> Any:
    if hasattr(o, "__struct_fields__"):
        return {f: getattr(o, f) for f in o.__struct_fields__}
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


class _TeeLogger:
    """structlog logger writing each rendered line to several text streams."""

    def __init__(self, streams: list[TextIO]) -> None:
        self._streams = streams

    def msg(self, message: str) -> None:
        for s in self._streams:
            try:
                s.write(message + "\n")
                s.flush()
            except (OSError, ValueError):  # a closed stdout must not kill an actor
                pass

    info = debug = warning = warn = error = critical = exception = fatal = failure = msg


def _add_ts(_: Any, __: str, event_dict: Any) -> Any:
    event_dict.setdefault("ts", round(time.time(), 6))
    return event_dict


def configure(
    actor: str,
    run_dir: str | Path | None = None,
    stdout: bool = True,
    replica: str | None = None,
) -> Path | None:
    """Route this process's events to stdout and (if ``run_dir``) RUN_DIR/events/ACTOR.jsonl.

    ``replica`` (default: ``$MINIRT_REPLICA``, which ``minirt up --replicas`` and ``--replica``
    set for every process of an instance) names the instance among replicas: each event then
    carries ``"replica"``. Returns the event file's path. Safe to call again (tests); the last
    call wins.
    """
    streams: list[TextIO] = []
    path = None
    if stdout:
        streams.append(sys.stdout)
    if run_dir is not None:
        path = Path(run_dir) / "events" / f"{actor}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        streams.append(path.open("a", encoding="utf-8"))
    logger = _TeeLogger(streams)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_ts,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(
                serializer=lambda d, **kw: json.dumps(d, default=_default)
            ),
        ],
        logger_factory=lambda *args: logger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(actor=actor)
    replica = os.environ.get("MINIRT_REPLICA", "") if replica is None else replica
    if replica:
        structlog.contextvars.bind_contextvars(replica=replica)
    return path


def get_logger() -> Any:
    return structlog.get_logger()
