"""One replay: a recorded workload through the real scheduler core and KV manager, with the
simulated executor and front door, on the virtual clock; optionally under changed knobs."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any

from actors.runtime.config import options
from actors.runtime.options import Option
from actors.shared import blockhash
from messages.kv import DiskTier
from minirt.eventlog import summary as run_summary
from minirt.replay.cores import SimKV, SimScheduler
from minirt.replay.execsim import Script, SimExecutor
from minirt.replay.frontsim import SimTokenizer
from minirt.replay.loop import Loop, SimLog
from minirt.replay.runlog import admit_to_run, decisions
from minirt.replay.stepmodel import StepModel
from minirt.replay.workload import Config, Recorded, RequestSpec

# The settings a replay can change, as paths into RuntimeConfig. Each knob's name (its flag),
# type, allowed values and help come from the config dataclasses, as the CLI's flags do
# (actors/runtime/options.py): a setting added there is replayable by adding its path here.
REPLAYABLE = (
    ("scheduler", "policy"),
    ("scheduler", "max_batch_size"),
    ("scheduler", "max_wait_s"),
    ("scheduler", "prefix_defer_tokens"),
    ("kv", "num_blocks"),
    ("kv", "mode"),
    ("executor", "chunk_cap"),
    ("executor", "step_budget"),
    ("executor", "long_prefill_threshold"),
    ("executor", "max_long_prefills"),
    ("executor", "decode_first"),
    ("executor", "budget_policy"),
    ("executor", "step_target_ms"),
)
KNOBS: dict[str, Option] = {o.flag: o for o in options() if o.path in REPLAYABLE}
# what a recorded run had and a replay can take away (True: replay without it; the flags'
# help is in cli.py). The other way needs what the run did not record: the drafts a
# speculation would have verified, the blocks a disk tier would have held.
SWITCHES = ("no-spec", "no-kv-disk")


def parse_knob(name: str, value: str) -> Any:
    if name in SWITCHES:
        return value.lower() in ("1", "true", "yes", "on")
    if name not in KNOBS:
        raise ValueError(f"unknown knob {name!r}; known: {', '.join([*KNOBS, *SWITCHES])}")
    return KNOBS[name].parse(value, f"--{name}")


def configured(base: Config, knobs: dict[str, Any]) -> Config:
    """A copy of ``base`` with ``knobs`` (names as in ``KNOBS``) changed. The executor's
    settings are its step budget's (``max_batch_size`` bounds both the scheduler and it)."""
    cfg = copy.deepcopy(base)
    if knobs.get("no-kv-disk"):
        cfg.disk = None
        cfg.kv.disk_dir, cfg.kv.disk_bytes = "", 0
    for name, value in knobs.items():
        if name in SWITCHES:
            continue
        section, fld = KNOBS[name].path
        if section == "scheduler":
            setattr(cfg.scheduler, fld, value)
        if section == "executor" or fld == "max_batch_size":
            cfg.budget = replace(cfg.budget, **{fld: value})
        if section == "kv":
            setattr(cfg.kv, fld, value)
            if fld == "num_blocks":
                cfg.num_blocks = value
    cfg.budget.check()
    if cfg.num_blocks < 1 or cfg.scheduler.max_batch_size < 1:
        raise ValueError("--num-blocks and --max-batch-size must be >= 1")
    return cfg


@dataclass
class Result:
    config: Config
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]
    wall_s: float
    steps: int
    sim_s: float  # how long the replay itself took (seconds of this machine)
    kv_timeline: list[tuple[float, float]] = field(default_factory=list)
    hop_s: float = 0.0  # message latency between actors
    to_executor_s: float = 0.0  # ... and to the executor

    def summary(self, tag: str | None = None) -> dict[str, Any]:
        return run_summary.summarize(self.records, self.wall_s, tag)

    def decisions(self) -> list[tuple[str, str, int]]:
        return decisions(self.events)


class _Sequences:
    """Each request's stand-in token sequence (prompt, then what it generates), rebuilt from
    the logged block hashes: shared prefixes stay shared, everything else is unique."""

    def __init__(self, specs: list[RequestSpec], block_size: int) -> None:
        self.bs = block_size
        self.seq: dict[str, list[int]] = {}
        self.index: dict[str, int] = {}
        self.goal: dict[str, tuple[int, str]] = {}
        self.verified: dict[str, list[tuple[int, int, bool]]] = {}
        for s in specs:
            full = s.prompt_tokens // block_size
            hashes = s.prompt_hashes[:full]
            if len(hashes) == full:
                hashes = hashes + s.tail_hashes
            seq: list[int] = []
            for h in hashes:
                seq.extend(blockhash.block_tokens(h, block_size))
            if len(seq) < s.prompt_tokens:
                seq.extend(blockhash.filler(s.index, s.prompt_tokens - len(seq)))
            self.seq[s.rid] = seq
            self.index[s.rid] = s.index
            self.verified[s.rid] = list(s.spec)
            self.goal[s.rid] = (
                s.outputs,
                s.finish_reason if s.finish_reason != "abort" else "length",
            )
        self._prompt_len = {s.rid: s.prompt_tokens for s in specs}

    def prompt(self, spec: RequestSpec) -> list[int]:
        return self.seq[spec.rid][: spec.prompt_tokens]

    def spec(self, rid: str) -> list[tuple[int, int, bool]]:
        """The recorded speculation of ``rid``: (drafts, accepted, explored) of each verifying
        step."""
        return self.verified.get(rid, [])

    def script(self, rid: str) -> Script:
        """What the simulated executor needs to generate ``rid``'s tokens and finish it."""
        total, reason = self.goal[rid]
        return self.seq[rid], self._prompt_len[rid], total, reason, -1 - self.index[rid]


def disk_found(specs: list[RequestSpec], seqs: _Sequences, cfg: Config) -> DiskTier:
    """The disk tier as the replay starts with it: every block a recorded admission loaded from
    disk (its stand-in tokens' keys; blocks written during the run are written in the replay
    too)."""
    assert cfg.disk is not None
    keys: dict[str, None] = {}
    for s in specs:
        start, n = s.disk_blocks
        if n:
            chain = blockhash.disk_keys(seqs.prompt(s), cfg.kv.block_size, "replay", "", start + n)
            keys.update(dict.fromkeys(chain[start:]))
    return DiskTier(fingerprint="replay", block_bytes=cfg.disk.block_bytes, keys=list(keys))


def replay(
    rec: Recorded,
    model: StepModel,
    knobs: dict[str, Any] | None = None,
    to_executor_s: float | None = None,
) -> Result:
    """Run ``rec``'s workload under its recorded configuration changed by ``knobs``; messages
    to the executor take ``to_executor_s`` (default: the log's hop estimate)."""
    started = time.perf_counter()
    cfg = configured(rec.config, knobs or {})
    loop = Loop(rec.hop_s, to_executor_s)
    events: list[dict[str, Any]] = []

    def log(actor: str) -> SimLog:
        return SimLog(events, actor, loop, rec.t0)

    specs = rec.requests
    if (knobs or {}).get("no-spec"):
        specs = [replace(s, spec=[]) for s in specs]
    seqs = _Sequences(specs, cfg.kv.block_size)
    kv = SimKV(loop, cfg.kv, cfg.num_blocks, log("kv_manager"))
    sched = SimScheduler(loop, cfg.scheduler, cfg.kv, log("scheduler"))
    ex = SimExecutor(
        loop,
        cfg.budget,
        cfg.kv.block_size,
        cfg.kv.lookahead_blocks * cfg.kv.block_size,
        model,
        log("executor"),
        seqs.script,
        rec.out_hop_s,
        cfg.num_blocks,
        cfg.burst_wait_ms / 1000.0,
        cfg.disk,
        seqs.spec,
        max((d for s in specs for d, *_ in s.spec), default=0),
        cfg.step_target_s,
        cfg.step_costs,
    )
    if cfg.disk is not None:  # what the recorded run found on disk: the blocks it loaded
        kv.handle(disk_found(rec.requests, seqs, cfg))
    front = SimTokenizer(loop, log("tokenizer"), specs, seqs.prompt, rec.client_s)
    loop.handlers = {
        "scheduler": sched.handle,
        "kv_manager": kv.handle,
        "executor": ex.handle,
        "tokenizer": front.handle,
    }
    front.start()
    loop.run()
    records = front.records()
    ends = [r["sent_s"] + r["e2e_s"] for r in records]
    wall = max(ends) if ends else 0.0
    return Result(
        config=cfg,
        records=records,
        events=events,
        wall_s=wall,
        steps=ex.steps,
        sim_s=time.perf_counter() - started,
        kv_timeline=run_summary.kv_timeline(events, rec.t0, rec.t0 + wall + 1.0),
        hop_s=loop.hop_s,
        to_executor_s=loop.latency["executor"],
    )


def calibrate(rec: Recorded, model: StepModel, first: int = 400, tol: float = 0.02) -> float:
    """The latency of messages to the executor that makes the replay's mean time from admission
    to the executor's start match the recorded one (bisection over replays of the first
    ``first`` requests). On a busy machine the executor picks up its inbox late, and the median
    of one hop between the other actors underestimates that. Falls back to the log's hop
    estimate when the log has no admission/start pairs."""
    target = rec.admit_to_run_s
    if target <= 0:
        return rec.hop_s
    sub = copy.copy(rec)
    sub.requests = rec.requests[:first]

    def gap(h: float) -> float:
        return admit_to_run(replay(sub, model, to_executor_s=h).events)

    lo, hi = 0.0, max(4 * target, 1e-3)
    if gap(lo) >= target:
        return 0.0
    if gap(hi) <= target:
        return hi
    for _ in range(12):
        mid = (lo + hi) / 2
        g = gap(mid)
        if abs(g - target) <= tol * target:
            return mid
        lo, hi = (mid, hi) if g < target else (lo, mid)
    return (lo + hi) / 2
