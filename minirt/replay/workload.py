"""A recorded run, read back from its events: the configuration it ran with, the workload
(arrivals, prompt lengths and prefix hashes, output lengths as they happened, stop strings,
cancels), its steps (for the step-time model), its admission decisions and its per-request
outcome in the shape ``minirt bench serve`` records (so the same report code summarizes both).

``RUN_DIR`` is a run directory (``RUN_DIR/events/*.jsonl``) or a ``minirt bench serve`` report
directory (``results/report.json`` plus ``results/runs/RUN/events/``; a report written before the
``results/`` layout has them at its top): then the client-side records are the recorded outcome
and the request tags (``long``/``short``) come along.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.runtime.config import KVConfig, SchedulerConfig
from gpu.step.budget import Costs
from gpu.step.plan import StepBudget
from messages.tokenizer import client_request_id
from minirt.eventlog import read_events
from minirt.eventlog import summary as run_summary
from minirt.eventlog.summary import RESULTS
from minirt.replay.runlog import (
    admission_hop,
    admit_to_run,
    decisions,
    hop,
    median,
    normalized,
    out_hop,
    slug,
)

UNBOUNDED = 1 << 30  # output length of a request that only a cancel ends


@dataclass
class RequestSpec:
    rid: str
    index: int  # arrival order
    received: float  # seconds after the run's start, at the front door
    submit_delay: float  # front door -> scheduler (tokenizing, one hop), as recorded
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    prompt_hashes: list[str] = field(default_factory=list)  # one per full prompt block
    tail_hashes: list[str] = field(default_factory=list)  # cached blocks past the prompt's
    outputs: int = 1  # tokens the executor generates before it finishes the request
    finish_reason: str = "length"
    stop_after: int | None = None  # a stop string ended it after this many tokens
    cancel_after_s: float | None = None  # a cancel / disconnect, seconds after arrival
    cancel_reason: str = "cancel"
    tags: tuple[str, ...] = ()
    # the disk tier: (first prompt block, blocks) its first admission loaded from disk
    disk_blocks: tuple[int, int] = (0, 0)
    # speculative decoding: (drafts verified, drafts accepted, whether it explored) of each step
    # that verified some (gpu/spec/explore.py)
    spec: list[tuple[int, int, bool]] = field(default_factory=list)


@dataclass
class DiskModel:
    """The recorded run's disk tier (``kv.disk_tier``) and its speed, per block, as the
    executor's ``disk_loaded`` / ``disk_written`` events measured it (medians)."""

    capacity: int
    block_bytes: int
    load_s: float  # reading and checking one block file
    write_s: float  # writing one


def _disk(events: list[dict[str, Any]]) -> DiskModel | None:
    tier = [e for e in events if e.get("event") == "kv.disk_tier"]
    if not tier:
        return None

    def per_block(name: str, default: float) -> float:
        rates = [
            float(e["seconds"]) / int(e["blocks"])
            for e in events
            if e.get("event") == name and int(e.get("blocks", 0)) > 0
        ]
        return median(rates, default)

    t = tier[0]
    return DiskModel(
        int(t["capacity"]),
        int(t["block_bytes"]),
        per_block("executor.disk_loaded", 0.001),
        per_block("executor.disk_written", 0.001),
    )


@dataclass
class Config:
    scheduler: SchedulerConfig
    kv: KVConfig
    budget: StepBudget
    num_blocks: int
    burst_wait_ms: float = 0.0  # the executor's wait for a burst at idle (0 in older logs)
    disk: DiskModel | None = None  # the prefix cache's disk tier, when the run had one
    step_target_s: float = 0.0  # the adaptive budget's step time, as the run resolved it
    step_costs: Costs | None = None  # the start's step-time model, timed by the executor

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.scheduler.policy,
            "max_batch_size": self.scheduler.max_batch_size,
            "num_blocks": self.num_blocks,
            "kv_mode": self.kv.mode,
            "chunk_cap": self.budget.chunk_cap,
            "step_budget": self.budget.step_budget,
            "long_prefill_threshold": self.budget.long_prefill_threshold,
            "max_long_prefills": self.budget.max_long_prefills,
            "decode_first": self.budget.decode_first,
            "budget_policy": self.budget.budget_policy,
            "step_target_ms": self.budget.step_target_ms,
            "burst_wait_ms": self.burst_wait_ms,
        }


@dataclass
class Recorded:
    source: str
    t0: float  # unix time of the run's start (replayed events are stamped from here)
    config: Config
    requests: list[RequestSpec]
    steps: list[dict[str, Any]]
    decisions: list[tuple[str, str, int]]  # (admit|refuse|fail, request_id, attempt)
    records: list[dict[str, Any]]  # per request, as bench serve records them
    wall_s: float
    kv_timeline: list[tuple[float, float]]
    hop_s: float  # one message between actors, estimated from the log
    out_hop_s: float  # executor -> front door, estimated from the log
    admit_to_run_s: float  # mean time from request.admitted to executor.running
    client_s: float = 0.0  # client <-> front door, both ways (bench client records only)
    notes: list[str] = field(default_factory=list)


def _config(events: list[dict[str, Any]], notes: list[str]) -> Config:
    def first(name: str) -> dict[str, Any]:
        found = [e for e in events if e.get("event") == name]
        if not found:
            raise ValueError(f"the log has no {name!r} event: is it a minirt run's event log?")
        if len(found) > 1:
            notes.append(f"{len(found)} {name} events (a restart?): the first one is replayed")
        return found[0]

    sc, kc, xc = first("scheduler.config"), first("kv.config"), first("executor.config")
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    sched = SchedulerConfig(**{k: v for k, v in sc.items() if k in names})
    sched.metrics_port = None
    kv = KVConfig(
        num_blocks=int(kc["num_blocks"]),
        block_size=int(kc["block_size"]),
        mode=kc.get("mode", "on_demand"),
        lookahead_blocks=int(kc.get("lookahead_blocks", 1)),
        victim_policy=sc.get("victim_policy", "newest"),
    )
    bnames = {f.name for f in dataclasses.fields(StepBudget)}
    budget = StepBudget(**{k: v for k, v in xc.items() if k in bnames})
    disk = _disk(events)
    if disk is not None:
        kv.disk_dir, kv.disk_bytes = "(replay)", disk.capacity
    burst = float(xc.get("burst_wait_ms", 0.0))
    target = float(xc.get("step_target_s") or 0.0)
    c = xc.get("step_costs")
    seed = Costs(c["c0_s"], c["prefill_s"], c["decode_s"], c.get("ctx_s", 0.0)) if c else None
    return Config(sched, kv, budget, int(kc["num_blocks"]), burst, disk, target, seed)


def from_events(
    events: list[dict[str, Any]],
    source: str = "",
    client_records: dict[str, dict[str, Any]] | None = None,
    client_wall_s: float | None = None,
) -> Recorded:
    """Rebuild the workload and the outcome of one run from its merged, time-ordered events."""
    notes: list[str] = []
    events = normalized(events)
    cfg = _config(events, notes)
    by: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        rid = e.get("request_id")
        if rid is not None:
            by[rid][f"{e.get('actor')}:{e.get('event')}"].append(e)
    received = [e for e in events if e.get("event") == "client.received"]
    if not received:
        raise ValueError(f"no client.received events in {source or 'the log'}: nothing to replay")
    t0 = min(e["ts"] for e in received)
    if client_records:  # the bench client's clock: the run started before the first send
        t0 -= min(r["sent_s"] for r in client_records.values())
    specs: list[RequestSpec] = []
    records: list[dict[str, Any]] = []
    verified: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)  # per request
    for e in events:
        if e.get("event") == "executor.step":
            explored = set(e.get("spec_explore", ()))
            for who, drafts, accepted in e.get("spec", []):
                verified[who].append((int(drafts), int(accepted), who in explored))
    skipped = 0
    for e in sorted(received, key=lambda e: e["ts"]):
        rid = e["request_id"]
        ev = by[rid]
        queued = ev.get("scheduler:request.queued")
        failed = ev.get("tokenizer:client.failed", []) + ev.get("scheduler:request.failed", [])
        if not queued or any(f.get("code") == "actor_dead" for f in failed):
            skipped += 1  # refused at the door or overloaded (never queued: no prompt length
            # logged), or lost to an actor restart: nothing to replay
            continue
        q = queued[0]
        done = (ev.get("tokenizer:client.completed") or [{}])[0]
        usage = done.get("usage", {})
        fin = ev.get("scheduler:request.finished")
        abort = ev.get("scheduler:request.aborted")
        delivered = int(usage.get("completion_tokens", 0))
        max_tokens = int(q.get("max_tokens", 0))
        spec = RequestSpec(
            rid=rid,
            index=len(specs),
            received=e["ts"] - t0,
            submit_delay=max(0.0, q["ts"] - e["ts"]),
            prompt_tokens=int(q["prompt_tokens"]),
            max_tokens=max_tokens,
            priority=int(q.get("priority", 0)),
            prompt_hashes=list(q.get("block_hashes", [])),
            tags=tuple((client_records or {}).get(client_request_id(rid), {}).get("tags", ())),
        )
        spec.spec = verified.get(rid, [])
        matched = ev.get("kv_manager:prefix.matched")
        if matched and matched[0].get("disk_tokens"):
            bs, m = cfg.kv.block_size, matched[0]
            disk = int(m["disk_tokens"])
            spec.disk_blocks = ((int(m["cached_tokens"]) - disk) // bs, disk // bs)
        if fin:
            spec.outputs = max(1, int(fin[0].get("output_tokens", 1)))
            spec.finish_reason = fin[0].get("finish_reason") or "length"
            spec.tail_hashes = list(fin[0].get("kv_tail_hashes", []))
        elif abort:
            reason = abort[0].get("reason", "cancel")
            spec.outputs = max_tokens or UNBOUNDED
            if reason == "stop_string":
                spec.stop_after, spec.finish_reason = max(1, delivered), "stop"
            else:
                tok_abort = ev.get("tokenizer:client.aborted") or abort
                spec.cancel_after_s = max(0.0, tok_abort[0]["ts"] - e["ts"])
                spec.cancel_reason, spec.finish_reason = reason, "abort"
        else:  # failed in the scheduler (too long, overloaded): the replay decides again
            spec.outputs = max_tokens or max(1, delivered)
        if not spec.max_tokens:  # a log from before request.queued carried max_tokens
            cancelled = spec.cancel_after_s is not None
            spec.max_tokens = delivered + 1 if cancelled else spec.outputs
        specs.append(spec)
        records.append(_record(spec, e, done, failed, ev, client_records))
    if skipped:
        notes.append(
            f"{skipped} requests never queued (invalid, overloaded, or lost to a restart): "
            "not replayed"
        )
    if not any(s.prompt_hashes for s in specs):
        notes.append("no block_hashes in request.queued: prefix sharing is not replayed")
    t_end = max([t0 + r["sent_s"] + r["e2e_s"] for r in records if r["e2e_s"] is not None] or [t0])
    wall = client_wall_s or (t_end - t0)
    return Recorded(
        source=source,
        t0=t0,
        config=cfg,
        requests=specs,
        steps=[e for e in events if e.get("event") == "executor.step"],
        decisions=decisions(events),
        records=records,
        wall_s=wall,
        kv_timeline=run_summary.kv_timeline(events, t0, t0 + wall + 1.0),
        hop_s=admission_hop(events, hop(by)),
        out_hop_s=out_hop(by),
        client_s=_client_overhead(by, client_records),
        admit_to_run_s=admit_to_run(events),
        notes=notes,
    )


def _client_overhead(
    by: dict[str, dict[str, list[dict[str, Any]]]], client: dict[str, dict[str, Any]] | None
) -> float:
    """Median of (client's TTFT - front door's TTFT): the time a request spends between the bench
    client and the front door, both ways (each TTFT is a difference on one clock). A replay
    simulates the runtime from the front door in; this is added to compare with the client."""
    if not client:
        return 0.0
    gaps = []
    for rid, ev in by.items():
        c = client.get(client_request_id(rid))
        done = ev.get("tokenizer:client.completed")
        if c and c.get("ttft_s") is not None and done:
            tok = done[0].get("timings", {}).get("ttft_s")
            if tok:
                gaps.append(c["ttft_s"] - tok)
    return median(gaps, 0.0)


def _record(
    spec: RequestSpec,
    recv: dict[str, Any],
    done: dict[str, Any],
    failed: list[dict[str, Any]],
    ev: dict[str, list[dict[str, Any]]],
    client: dict[str, dict[str, Any]] | None,
) -> dict[str, Any]:
    if client and client_request_id(spec.rid) in client:
        return {**client[client_request_id(spec.rid)], "request_id": spec.rid}
    t = done.get("timings", {})
    u = done.get("usage", {})
    n = int(u.get("completion_tokens", 0))
    ttft, tpot = t.get("ttft_s") or None, t.get("tpot_s") or None
    first = spec.received + ttft if ttft is not None else None
    times = [first + i * (tpot or 0.0) for i in range(n)] if first is not None else []
    return {
        "request_id": spec.rid,
        "tags": list(spec.tags),
        "prompt_tokens": spec.prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": int(u.get("cached_tokens", 0)),
        "finish_reason": done.get("finish_reason", ""),
        "error": f"{failed[0].get('code')}: {failed[0].get('reason', '')}" if failed else "",
        "sent_s": spec.received,
        "queue_s": t.get("queue_s", 0.0),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": t.get("total_s", 0.0),
        "itl_s": [],
        "preemptions": len(ev.get("scheduler:request.preempted", [])),
        "token_times_s": times,
    }


def raw_dir(report_dir: str | Path) -> Path:
    """Where a bench serve report keeps report.json and runs/: its ``results/``, or the
    directory itself (a report of before that layout, or its ``results/`` given directly)."""
    p = Path(report_dir)
    return p / RESULTS if (p / RESULTS / "report.json").exists() else p


def first_run(report_dir: str | Path) -> str:
    """The first run of a bench serve report (the one replayed without ``--run``)."""
    runs = json.loads((raw_dir(report_dir) / "report.json").read_text()).get("runs", {})
    if not runs:
        raise ValueError(f"{report_dir}/report.json: no runs")
    return str(next(iter(runs)))


def load(path: str | Path, run: str | None = None) -> Recorded:
    """A run directory, or a bench serve report directory (``run``: which run; default first)."""
    p = raw_dir(path)
    rep = p / "report.json"
    if (p / "events").is_dir() and not rep.exists():
        return from_events(read_events(p), str(p))
    if not rep.exists():
        raise ValueError(f"{p}: neither a run directory (events/) nor a bench report (report.json)")
    data = json.loads(rep.read_text())
    runs = data.get("runs", {})
    if not runs:
        raise ValueError(f"{rep}: no runs")
    name = run or next(iter(runs))
    if name not in runs:
        raise ValueError(f"--run {name!r}: the report has {sorted(runs)}")
    ev_dir = p / "runs" / slug(name)
    if not (ev_dir / "events").is_dir():
        raise ValueError(
            f"{ev_dir}/events: the report has no event log for run {name!r} "
            "(re-run `minirt bench serve`; it keeps each run's events there)"
        )
    r = runs[name]
    client = {rec["request_id"]: rec for rec in r["records"]}
    return from_events(read_events(ev_dir), f"{path} ({name})", client, r.get("wall_s"))
