"""Events of several replicas: each replica's lines carry its name, `minirt events --run-dir`
merges the launcher's and every replica's files in time order, and `minirt trace ID` names the
replica that served the request."""

from __future__ import annotations

import io
import json
from pathlib import Path

from actors.runtime import events
from minirt.eventlog import read_events, show_events, trace_lines


def _write(path: Path, *lines: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for e in lines:
            f.write(json.dumps(e) + "\n")


def test_configure_binds_the_replica_name_into_every_event(tmp_path, monkeypatch):
    def last(path) -> dict:
        return json.loads(Path(path).read_text().splitlines()[-1])

    path = events.configure("scheduler", tmp_path, stdout=False, replica="replica-3")
    events.get_logger().info("request.queued", request_id="r1")
    e = last(path)
    assert (e["actor"], e["replica"], e["event"]) == ("scheduler", "replica-3", "request.queued")
    # Every process of a replica inherits MINIRT_REPLICA from `minirt up --replicas`.
    monkeypatch.setenv("MINIRT_REPLICA", "replica-1")
    path = events.configure("executor", tmp_path, stdout=False)
    events.get_logger().info("executor.step")
    assert last(path)["replica"] == "replica-1"
    monkeypatch.delenv("MINIRT_REPLICA")
    path = events.configure("scheduler", tmp_path / "solo", stdout=False)
    events.get_logger().info("request.queued", request_id="r2")
    assert "replica" not in last(path)


def test_events_of_every_replica_merge_in_time_order_and_trace_names_the_replica(tmp_path):
    run = tmp_path / "cluster"
    _write(
        run / "events" / "supervisor.jsonl",
        {"ts": 1.0, "actor": "supervisor", "event": "cluster.ready"},
    )
    _write(
        run / "replica-0" / "events" / "tokenizer.jsonl",
        {
            "ts": 2.0,
            "actor": "tokenizer",
            "replica": "replica-0",
            "event": "client.received",
            "request_id": "a",
        },
        {
            "ts": 4.0,
            "actor": "tokenizer",
            "replica": "replica-0",
            "event": "client.completed",
            "request_id": "a",
        },
    )
    # Written before the replica had a name (or copied from a host): the directory names it.
    _write(
        run / "replica-1" / "events" / "scheduler.jsonl",
        {"ts": 3.0, "actor": "scheduler", "event": "request.queued", "request_id": "b"},
    )
    merged = read_events(run)
    assert [e["ts"] for e in merged] == [1.0, 2.0, 3.0, 4.0]
    assert [e.get("replica") for e in merged] == [None, "replica-0", "replica-1", "replica-0"]
    out = io.StringIO()
    assert show_events(run, request="b", out=out) == 0
    assert "replica-1" in out.getvalue() and "request.queued" in out.getvalue()
    lines = trace_lines(merged, "a")
    assert "replica-0" in lines[0] and all("replica-1" not in line for line in lines)
    assert any("client.completed" in line for line in lines)
