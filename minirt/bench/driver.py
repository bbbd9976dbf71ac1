"""Send a workload to a running runtime and time every request from the client's side."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from messages import client as cm
from minirt.bench.workloads import Job
from minirt.client import RequestError, open_client


@dataclass
class Record:
    rid: str
    prompt_tokens: int
    tags: tuple[str, ...]
    sent: float = 0.0  # seconds since the run started
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    finish_reason: str = ""
    cached_tokens: int = 0
    queue_s: float = 0.0
    preemptions: int = 0
    output: list[int] = field(default_factory=list)
    error: str = ""

    def summary(self) -> dict[str, Any]:
        t = self.token_times
        itl = [b - a for a, b in itertools.pairwise(t)]
        return {
            "request_id": self.rid,
            "tags": list(self.tags),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "sent_s": self.sent,
            "queue_s": self.queue_s,
            "ttft_s": (t[0] - self.sent) if t else None,
            "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "e2e_s": self.end - self.sent,
            "itl_s": itl,
            "preemptions": self.preemptions,
            "token_times_s": t,
        }


async def drive(
    endpoint: str,
    jobs: list[Job],
    concurrency: int = 256,
    progress: Any = None,
    curve_dir: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> tuple[list[Record], float]:
    """Run every job (honouring arrival offsets and turn order); returns records and wall time.
    ``sampling``: SamplingParams fields every request carries (the wire's default is greedy)."""
    records = {j.rid: Record(j.rid, len(j.prompt), j.tags) for j in jobs}
    done = {j.rid: trio.Event() for j in jobs}
    by_id = {j.rid: j for j in jobs}
    limit = trio.CapacityLimiter(concurrency)
    t0 = time.perf_counter()

    async def one(client: Any, job: Job) -> None:
        await trio.sleep_until(trio.current_time() + max(0.0, job.at - (time.perf_counter() - t0)))
        prompt = job.prompt
        if job.after is not None:
            await done[job.after].wait()
            prev = by_id[job.after]
            prompt = prev.prompt + records[job.after].output + job.extra
            job.prompt = prompt
            records[job.rid].prompt_tokens = len(prompt)
        rec = records[job.rid]
        async with limit:
            rec.sent = time.perf_counter() - t0
            try:
                async for msg in client.stream(
                    prompt_ids=prompt,
                    max_tokens=job.max_tokens,
                    ignore_eos=True,
                    request_id=job.rid,
                    **(sampling or {}),
                ):
                    now = time.perf_counter() - t0
                    if isinstance(msg, cm.Delta):
                        rec.token_times.extend([now] * len(msg.token_ids))
                        rec.output.extend(msg.token_ids)
                    elif isinstance(msg, cm.Final):
                        rec.finish_reason = msg.finish_reason
                        rec.cached_tokens = msg.usage.cached_tokens
                        rec.queue_s = msg.timings.queue_s
                        rec.preemptions = msg.preemptions
            except RequestError as e:
                rec.error = f"{e.code}: {e}"
            rec.end = time.perf_counter() - t0
        done[job.rid].set()
        if progress is not None:
            progress(rec)

    async with open_client(endpoint, curve_dir=curve_dir) as client, trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(one, client, job)
    return list(records.values()), time.perf_counter() - t0
