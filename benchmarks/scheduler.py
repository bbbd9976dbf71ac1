"""``minirt bench scheduler``: the cost of one scheduling decision, by policy and queue size.

A decision here is one full admission cycle of the scheduler core with ``--running`` requests in
the batch: a request finishes (its blocks go back), the policy picks the next waiting request, the
KV answer admits it and the executor is told to run it. The queue holds 1k, 10k and 100k waiting
requests; the cost should not grow with it (target < 100 us per decision).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.core import SchedulerCore
from messages import kv as km
from messages.common import SamplingParams
from messages.scheduler import AdmitResult, BlocksFreed, RequestDone, Submit


class _NullLog:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@dataclass(frozen=True)
class Measurement:
    seconds_per_decision: float  # mean, over the timed decisions
    admitted: int  # requests admitted while timed (one per decision when the core keeps up)
    running: int  # batch size at the end (the core should keep it full)
    waiting: int  # queue length at the end (the bench keeps it at its size)


def measure(policy: str, waiting: int, running: int, decisions: int, seed: int = 0) -> Measurement:
    """Time ``decisions`` admission cycles; returns their mean cost and what they did."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(policy=policy, max_batch_size=running, max_waiting=waiting + running + 1)
    core = SchedulerCore(cfg, KVConfig(block_size=16), _NullLog(), time.monotonic)

    pool = [[rng.randrange(32000) for _ in range(512)] for _ in range(64)]
    lengths = [rng.randint(16, 512) for _ in range(running + waiting + decisions)]

    def submit(i: int) -> None:
        n = lengths[i]
        core.submit(
            Submit(
                request_id=f"r{i}",
                prompt_ids=[i // 32000, i % 32000, *pool[i % 64][:n]],  # distinct, premade
                params=SamplingParams(priority=rng.randint(0, 3)),
                arrival=0.0,
            )
        )

    def answer() -> None:
        for _, m in core.take_outbox():
            if isinstance(m, km.Admit):
                core.admit_result(
                    AdmitResult(
                        request_id=m.request_id, attempt=m.attempt, ok=True, block_table=[0]
                    )
                )
            elif isinstance(m, km.MatchQuery):
                core.match_reply(
                    km.MatchReply(cached_tokens=[rng.choice((0, 16, 64)) for _ in m.token_lists])
                )

    for i in range(running + waiting):
        submit(i)
        for _ in range(4):  # lpm: a match query, then the admission
            if i < running:
                answer()
    core.take_outbox()
    assert len(core.running) == running and len(core.queue) == waiting, (
        len(core.running),
        len(core.queue),
    )
    running_ids = list(core.running)
    admitted_before = core.counters["admitted"]
    t0 = time.perf_counter()
    for d in range(decisions):
        rid = running_ids[d]
        req = core.running[rid]
        core.request_done(
            RequestDone(
                request_id=rid,
                attempt=req.attempt,
                status="finished",
                kv_token_ids=[],
                finish_reason="length",
            )
        )
        core.blocks_freed(BlocksFreed(free=1, evictable=0))
        for _ in range(3):  # lpm: query, then admit
            out = core.outbox[:]
            answer()
            if not out:
                break
        running_ids.append(next(reversed(core.running)))
        submit(running + waiting + d)  # keep the queue at its size
        core.take_outbox()
    elapsed = time.perf_counter() - t0
    return Measurement(
        seconds_per_decision=elapsed / decisions,
        admitted=core.counters["admitted"] - admitted_before,
        running=len(core.running),
        waiting=len(core.queue),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minirt bench scheduler", description=__doc__)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--policies", nargs="+", default=["fcfs", "priority", "sjf", "lpm"])
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    rows = []
    print(
        f"one scheduling decision, {args.running} running (microseconds, mean of {args.decisions})"
    )
    print(f"{'policy':<10}" + "".join(f"{w:>12,}" for w in args.waiting) + "  waiting")
    for policy in args.policies:
        cells = []
        for w in args.waiting:
            us = measure(policy, w, args.running, args.decisions).seconds_per_decision * 1e6
            rows.append(
                {"policy": policy, "waiting": w, "running": args.running, "us_per_decision": us}
            )
            cells.append(f"{us:>12.1f}")
        print(f"{policy:<10}" + "".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
