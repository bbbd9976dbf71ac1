"""Reading what a run's event log says about its timing and decisions: event names across the
rename (each actor's events got its own prefix), the admission decisions in order, and the
message latencies the replay uses. Pure functions over the merged, time-ordered events."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Event names before each actor's events got their own prefix (logs recorded earlier replay too).
OLD_NAMES = {
    ("tokenizer", "request.received"): "client.received",
    ("tokenizer", "request.completed"): "client.completed",
    ("tokenizer", "request.aborted"): "client.aborted",
    ("tokenizer", "request.failed"): "client.failed",
    ("tokenizer", "request.rejected"): "client.rejected",
    ("executor", "step"): "executor.step",
    ("executor", "request.running"): "executor.running",
    ("executor", "request.prefill_done"): "executor.prefill_done",
    ("kv_manager", "admission.refused"): "kv.refused",
}


def normalized(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with pre-rename names mapped to today's (copies; the input is untouched)."""
    out = []
    for e in events:
        new = OLD_NAMES.get((e.get("actor", ""), e.get("event", "")))
        out.append({**e, "event": new} if new else e)
    return out


def slug(name: str) -> str:
    """A run name as a directory name (how ``minirt bench serve`` stores each run's events)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def median(values: list[float], default: float) -> float:
    v = sorted(x for x in values if x >= 0)
    return v[len(v) // 2] if v else default


def decisions(events: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The scheduler's admission decisions in order: admitted (with the attempt), refused by
    the KV manager, failed (can never fit, overloaded)."""
    out = []
    for e in events:
        if e.get("actor") != "scheduler":
            continue
        name = e.get("event")
        if name == "request.admitted":
            out.append(("admit", e["request_id"], int(e.get("attempt", 1))))
        elif name == "admission.refused":
            out.append(("refuse", e["request_id"], 0))
        elif name == "request.failed":
            out.append(("fail", e["request_id"], 0))
    return out


def admit_to_run(events: list[dict[str, Any]]) -> float:
    """Mean seconds from the scheduler's admission to the executor's start of each attempt (one
    message plus the wait for the step in progress): what ``sim.calibrate_hop`` matches."""
    admitted: dict[tuple[str, int], float] = {}
    gaps = []
    for e in events:
        name = e.get("event")
        key = (e.get("request_id", ""), int(e.get("attempt", 0)))
        if name == "request.admitted" and e.get("actor") == "scheduler":
            admitted[key] = e["ts"]
        elif name == "executor.running" and key in admitted:
            gaps.append(e["ts"] - admitted.pop(key))
    return sum(gaps) / len(gaps) if gaps else 0.0


def admission_hop(events: list[dict[str, Any]], default: float) -> float:
    """Half the scheduler's admission cycle (``kv_admit`` out, ``admit_result`` back, handled)
    while requests wait in line: consecutive admissions at the first attempt, the later request
    already queued when the earlier was admitted. Under a burst this is what each waiting
    request pays per request ahead of it (messages queue behind others, processes wait for a
    core), more than one idle hop. ``default`` when the log has no such pair."""
    queued: dict[str, float] = {}
    cycles = []
    prev: dict[str, Any] | None = None
    for e in events:
        if e.get("actor") != "scheduler":
            continue
        name = e.get("event")
        if name == "request.queued":
            queued.setdefault(e["request_id"], e["ts"])
        elif name in ("request.admitted", "admission.refused", "request.failed"):
            first = name == "request.admitted" and int(e.get("attempt", 1)) == 1
            if (
                first
                and prev is not None
                and prev.get("event") == "request.admitted"
                and queued.get(e["request_id"], float("inf")) < prev["ts"]
            ):
                cycles.append(e["ts"] - prev["ts"])
            prev = e
    return median(cycles, 2 * default) / 2


def hop(by: dict[str, dict[str, list[dict[str, Any]]]]) -> float:
    """KV manager -> scheduler: kv.allocated is logged just before the answer is sent."""
    gaps = []
    for ev in by.values():
        allocated, admitted = (
            ev.get("kv_manager:kv.allocated", []),
            ev.get("scheduler:request.admitted", []),
        )
        for a, b in zip(allocated, admitted, strict=False):
            gaps.append(b["ts"] - a["ts"])
    return median(gaps, 0.0003)


def out_hop(by: dict[str, dict[str, list[dict[str, Any]]]]) -> float:
    """Executor -> front door: the executor logs prefill_done when it publishes the first token;
    the front door's ttft counts from its own arrival stamp."""
    gaps = []
    for ev in by.values():
        pre = ev.get("executor:executor.prefill_done")
        recv = ev.get("tokenizer:client.received")
        done = ev.get("tokenizer:client.completed")
        if pre and recv and done and done[0].get("timings", {}).get("ttft_s"):
            gaps.append(recv[0]["ts"] + done[0]["timings"]["ttft_s"] - pre[-1]["ts"])
    return median(gaps, 0.0003)


def run_window(events: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """The events of one run of a long-lived runtime: its configuration events and everything
    between ``t0`` and ``t1`` (unix seconds). What ``minirt bench serve`` keeps per run."""
    return [
        e
        for e in events
        if str(e.get("event", "")).endswith(".config") or t0 <= e.get("ts", 0) <= t1
    ]


def keep_run(events: list[dict[str, Any]], t0: float, t1: float, dest: str | Path) -> Path:
    """Write one run's events (``run_window``) under ``dest/events/``, laid out like a run dir,
    so ``minirt replay`` (and ``minirt trace``) read them. Returns the events directory."""
    from minirt.replay.loop import write_events

    return write_events(run_window(events, t0, t1), dest)
