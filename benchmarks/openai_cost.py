"""What the HTTP layer costs: one workload through the ZeroMQ client and through the HTTP API,
on the same running runtime, one after the other, timed the same way by the same kind of driver.

The HTTP driver streams ``/v1/completions`` with the prompt as token ids (so both paths send the
same tokens) and ``continuous_usage_stats`` (so every chunk says how many tokens there are by
then). Each run also records the CPU seconds the runtime's processes named in ``pids`` used and
those of the driver itself (this process: the ZeroMQ client, or httpx reading every chunk).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from minirt.bench.driver import Record, drive
from minirt.bench.workloads import Job
from minirt.eventlog import summary as report


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive_http(
    url: str, model: str, jobs: list[Job], concurrency: int = 256
) -> tuple[list[Record], float]:
    """Every job at once (W1 has no arrival offsets) as a streamed completion; records as
    ``drive`` makes them."""
    records = {j.rid: Record(j.rid, len(j.prompt), j.tags) for j in jobs}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()

    async def one(c: httpx.AsyncClient, job: Job) -> None:
        rec = records[job.rid]
        rec.sent = time.perf_counter() - t0
        body = {
            "model": model,
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        headers = {"X-Request-Id": job.rid}
        async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.error = f"http {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    count = int(usage.get("completion_tokens", 0))
                    rec.token_times.extend([now] * (count - len(rec.token_times)))
                    for ch in chunk.get("choices", []):
                        if ch.get("finish_reason"):
                            rec.finish_reason = ch["finish_reason"]
                    if not chunk.get("choices"):
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens", 0))
                rec.output = [0] * len(rec.token_times)
        rec.end = time.perf_counter() - t0

    async with (
        httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as c,
        trio.open_nursery() as nursery,
    ):
        for job in jobs:
            nursery.start_soon(one, c, job)
    return list(records.values()), time.perf_counter() - t0


def fresh(jobs: list[Job], vocab: int, seed: int, prefix: str) -> list[Job]:
    """The same shapes (prompt lengths, output lengths) with new random tokens, so no run reuses
    another's prompts through the prefix cache."""
    rng = random.Random(seed)
    return [
        Job(f"{prefix}-{j.rid}", [rng.randrange(16, vocab) for _ in j.prompt], j.max_tokens)
        for j in jobs
    ]


def measure(
    endpoint: str, url: str, model: str, jobs: list[Job], pids: dict[str, int], vocab: int
) -> list[dict[str, Any]]:
    """Rows for the report: the same shapes through ZMQ, then HTTP, then ZMQ again (the
    machine's drift shows as the gap between the two ZMQ rows)."""
    rows: list[dict[str, Any]] = []
    for k, name in enumerate(("zmq", "http", "zmq (again)")):
        run_jobs = fresh(jobs, vocab, 1000 + k, f"cost{k}")
        before = {n: cpu_seconds(p) for n, p in pids.items()}
        driver = time.process_time()
        if name == "http":
            records, wall = trio.run(drive_http, url, model, run_jobs)
        else:
            records, wall = trio.run(drive, endpoint, run_jobs)
        cpu = {n: cpu_seconds(p) - before[n] for n, p in pids.items()}
        cpu["client"] = time.process_time() - driver
        s = report.summarize([r.summary() for r in records], wall)
        tokens = max(1, s["output_tokens"])
        row = {"run": name, **s}
        for n, v in cpu.items():
            row[f"{n}_cpu_s"] = v
            row[f"{n}_cpu_us_per_token"] = 1e6 * v / tokens
        rows.append(row)
    return rows
