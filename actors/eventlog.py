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

_BASE = ("ts", "actor", "event", "level", "request_id")
WAIT_EVENTS = (
    "admission.refused",
    "kv.refused",
    "request.preempted",
    "request.requeued",
    "kv.shortage",
)


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of every actor, sorted by timestamp."""
    events: list[dict[str, Any]] = []
    for path in sorted((Path(run_dir) / "events").glob("*.jsonl")):
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
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
    return f"{ts} {e.get('actor', '?'):<10} {e.get('event', '?'):<22} {('[' + rid[:12] + ']') if rid else ''} {rest}".rstrip()


def _follow(run_dir: Path) -> Iterator[dict[str, Any]]:
    offsets: dict[Path, int] = {}
    while True:
        batch: list[dict[str, Any]] = []
        for path in sorted((run_dir / "events").glob("*.jsonl")):
            with path.open(encoding="utf-8", errors="replace") as f:
                f.seek(offsets.get(path, 0))
                while True:
                    pos = f.tell()
                    line = f.readline()
                    if not line.endswith("\n"):
                        f.seek(pos)
                        break
                    try:
                        batch.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
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
    if not (run / "events").is_dir():
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
    if len(ids) <= 1:
        return _trace_block(mine)
    lines = []
    for rid in sorted(
        ids, key=lambda r: next(e.get("ts", 0.0) for e in mine if e["request_id"] == r)
    ):
        lines.append(f"request {rid}:")
        lines += _trace_block(
            [e for e in mine if rid in (e.get("request_id"), e.get("for_request"))]
        )
    return lines


def _trace_block(mine: list[dict[str, Any]]) -> list[str]:
    if not mine:
        return []
    t0 = mine[0].get("ts", 0.0)
    lines = []
    for e in mine:
        offset = (e.get("ts", 0.0) - t0) * 1000
        detail = " ".join(f"{k}={v}" for k, v in e.items() if k not in _BASE)
        why = "  <- waited: " if e.get("event") in WAIT_EVENTS else "  "
        lines.append(
            f"+{offset:9.3f} ms  {e.get('actor', '?'):<10} {e.get('event', '?'):<22}{why}{detail}"
        )
    return lines


def trace(run_dir: str | Path, request_id: str) -> int:
    lines = trace_lines(read_events(run_dir), request_id)
    if not lines:
        print(f"no events for request {request_id} under {run_dir}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0
