"""Reading the event log: merge RUN_DIR/events/*.jsonl in time order, follow, filter, trace.

A line that is not JSON (a partial write being appended) is skipped, never fatal.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from messages.tokenizer import client_request_id

_BASE = ("ts", "actor", "event", "level", "request_id", "replica")
WAIT_EVENTS = (
    "admission.refused",
    "kv.refused",
    "request.preempted",
    "request.requeued",
    "kv.shortage",
)


def event_files(run_dir: str | Path) -> list[tuple[Path, str | None]]:
    """RUN_DIR/events/*.jsonl, then each replica's RUN_DIR/NAME/events/*.jsonl (``minirt up
    --replicas``, or logs copied from several hosts into one directory), with NAME."""
    run = Path(run_dir)
    files: list[tuple[Path, str | None]] = [(p, None) for p in sorted(run.glob("events/*.jsonl"))]
    return files + [(p, p.parent.parent.name) for p in sorted(run.glob("*/events/*.jsonl"))]


def _parse(line: str, replica: str | None) -> dict[str, Any] | None:
    try:
        e = json.loads(line)
    except json.JSONDecodeError:
        return None
    if replica is not None and isinstance(e, dict):
        e.setdefault("replica", replica)  # lines written before the replica had a name
    return e if isinstance(e, dict) else None


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of every actor (of every replica), sorted by timestamp."""
    events: list[dict[str, Any]] = []
    for path, replica in event_files(run_dir):
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                e = _parse(line, replica)
                if e is not None:
                    events.append(e)
    events.sort(key=lambda e: e.get("ts", 0.0))
    return events


def is_request(value: Any, request: str) -> bool:
    """Whether an event's request id ``value`` is ``request``: the runtime-wide id itself, or the
    client's own id inside it (ids are scoped to the client's connection, so a client's id may
    name requests of several connections)."""
    return isinstance(value, str) and (value == request or client_request_id(value) == request)


def matches(e: dict[str, Any], request: str | None, event: str | None) -> bool:
    if request is not None and not (
        is_request(e.get("request_id"), request) or is_request(e.get("for_request"), request)
    ):
        return False
    return event is None or str(e.get("event", "")).startswith(event)


def format_event(e: dict[str, Any]) -> str:
    ts = (
        time.strftime("%H:%M:%S", time.localtime(e.get("ts", 0)))
        + f".{int(e.get('ts', 0) * 1000) % 1000:03d}"
    )
    rid = e.get("request_id")
    rest = " ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in e.items()
        if k not in _BASE
    )
    return f"{ts} {who(e):<10} {e.get('event', '?'):<22} {('[' + rid[:12] + ']') if rid else ''} {rest}".rstrip()


def who(e: dict[str, Any]) -> str:
    """The event's actor, as ``REPLICA/ACTOR`` when it belongs to a replica."""
    actor = str(e.get("actor", "?"))
    return f"{e['replica']}/{actor}" if e.get("replica") else actor


def _follow(run_dir: Path) -> Iterator[dict[str, Any]]:
    offsets: dict[Path, int] = {}
    while True:
        batch: list[dict[str, Any]] = []
        for path, replica in event_files(run_dir):
            with path.open(encoding="utf-8", errors="replace") as f:
                f.seek(offsets.get(path, 0))
                while True:
                    pos = f.tell()
                    line = f.readline()
                    if not line.endswith("\n"):
                        f.seek(pos)
                        break
                    e = _parse(line, replica)
                    if e is not None:
                        batch.append(e)
                offsets[path] = f.tell()
        batch.sort(key=lambda e: e.get("ts", 0.0))
        yield from batch
        time.sleep(0.2)


def show_events(
    run_dir: str | Path,
    *,
    follow: bool = False,
    request: str | None = None,
    event: str | None = None,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    run = Path(run_dir)
    if not (run / "events").is_dir() and not any(run.glob("*/events")):
        print(
            f"no events under {run}/events (is minirt up running with --run-dir {run}?)",
            file=sys.stderr,
        )
        return 1
    source = _follow(run) if follow else iter(read_events(run))
    try:
        for e in source:
            if matches(e, request, event):
                out.write((json.dumps(e) if as_json else format_event(e)) + "\n")
                out.flush()
    except KeyboardInterrupt:
        pass
    return 0


def trace_lines(events: list[dict[str, Any]], request_id: str) -> list[str]:
    """One line per event of ``request_id`` across actors, with offsets from its first event and
    the reason behind every wait (refusals, shortages, preemptions). Given a client's own id
    that several connections used, each of those requests is traced in turn, under a header."""
    mine = [e for e in events if matches(e, request_id, None)]
    ids = {e["request_id"] for e in mine if is_request(e.get("request_id"), request_id)}
    lines = _served_by(mine)
    if len(ids) <= 1:
        return lines + _trace_block(mine)
    for rid in sorted(
        ids, key=lambda r: next(e.get("ts", 0.0) for e in mine if e["request_id"] == r)
    ):
        lines.append(f"request {rid}:")
        lines += _trace_block(
            [e for e in mine if rid in (e.get("request_id"), e.get("for_request"))]
        )
    return lines


def _served_by(mine: list[dict[str, Any]]) -> list[str]:
    """With replicas: which one completed the request (and which others saw it, e.g. a retry)."""
    seen = list(dict.fromkeys(str(e["replica"]) for e in mine if e.get("replica")))
    if not seen:
        return []
    done = [str(e["replica"]) for e in mine if e.get("event") == "client.completed"]
    head = f"served by {done[-1]}" if done else "not completed"
    others = [r for r in seen if r not in done[-1:]]
    return [head + (f" (also seen by {', '.join(others)})" if others else "")]


def _trace_block(mine: list[dict[str, Any]]) -> list[str]:
    if not mine:
        return []
    t0 = mine[0].get("ts", 0.0)
    lines = []
    for e in mine:
        offset = (e.get("ts", 0.0) - t0) * 1000
        detail = " ".join(f"{k}={v}" for k, v in e.items() if k not in _BASE)
        why = "  <- waited: " if e.get("event") in WAIT_EVENTS else "  "
        lines.append(f"+{offset:9.3f} ms  {who(e):<10} {e.get('event', '?'):<22}{why}{detail}")
    return lines


def trace(run_dir: str | Path, request_id: str) -> int:
    lines = trace_lines(read_events(run_dir), request_id)
    if not lines:
        print(f"no events for request {request_id} under {run_dir}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0
