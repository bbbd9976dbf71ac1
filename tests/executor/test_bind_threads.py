"""``--bind-threads``: the executor's OpenMP threads each pinned to one CPU (the thread running
the steps to the first), the executor's other threads left on every CPU, the same tokens."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from minirt.client import open_client
from tests.support.runtime import start_runtime


def _threads(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


async def _generate(rt) -> list[int]:
    async with open_client(rt.endpoint) as c:
        r = await c.generate(prompt_ids=list(range(20, 60)), max_tokens=8, ignore_eos=True)
    return r.token_ids


def test_bound_threads_serve_the_same_tokens(tiny_model, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = {}
    for bind in ("--no-bind-threads", "--bind-threads"):
        with start_runtime(tiny_model, tmp_path / bind, bind, "--threads", str(len(cpus))) as rt:
            out[bind] = trio.run(_generate, rt)
            cfg = rt.events("executor.config")[0]
            pid = rt.pid_of("executor")
            threads = _threads(pid)
        if bind == "--bind-threads":
            assert cfg["bound_cpus"] == [cpus[i % len(cpus)] for i in range(len(cpus))]
            assert threads[pid] == {cpus[0]}  # the main thread runs the steps: OpenMP's thread 0
            pinned = [t for t, a in threads.items() if len(a) == 1]
            assert len(pinned) >= min(len(cpus), 2) or len(cpus) == 1, threads
            assert any(a == set(cpus) for t, a in threads.items() if t != pid), threads  # trio's
        else:
            assert cfg["bound_cpus"] is None
            assert all(a == set(cpus) for a in threads.values()), threads
    assert out["--bind-threads"] == out["--no-bind-threads"] and len(out["--bind-threads"]) == 8
