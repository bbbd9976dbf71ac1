"""The replay of a run that loaded prefixes from the disk tier: the recorded run (after a
restart, its prompts' prefixes on disk) is replayed with the same disk hits, loads that take the
recorded time per block, and the same admission decisions; the replay without the tier (``--no-kv-disk``) computes
those prefixes instead, as a real run without it does."""

from __future__ import annotations

import random

import pytest
import trio

from minirt.client import open_client
from minirt.replay import sim, stepmodel, workload
from tests.support.runtime import start_runtime

BS = 16


async def _serve(rt, prompts) -> None:
    async with open_client(rt.endpoint) as client:
        with trio.fail_after(120):
            for p in prompts:
                await client.generate(prompt_ids=p, max_tokens=4, temperature=0)


def test_a_run_that_loaded_from_disk_replays_with_its_loads(tiny_model, tmp_path):
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(600)] for _ in range(3)]
    flags = ("--num-blocks", "256", "--kv-disk-dir", str(tmp_path / "disk"))
    with start_runtime(tiny_model, tmp_path / "run1", *flags) as rt:
        trio.run(_serve, rt, prompts)
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:
        second = [*prompts, [rng.randrange(3, 500) for _ in range(600)]]
        trio.run(_serve, rt, second)
    with start_runtime(tiny_model, tmp_path / "run3", *flags[:2]) as rt:  # no disk tier
        trio.run(_serve, rt, second)
    rec = workload.load(tmp_path / "run2")
    assert rec.config.disk is not None and rec.config.disk.load_s > 0
    assert [s.disk_blocks for s in rec.requests] == [(0, 37)] * 3 + [(0, 0)]
    model = stepmodel.fit(rec.steps)
    res = sim.replay(rec, model)
    assert res.decisions() == rec.decisions

    def disk_tokens(events) -> list[int]:
        return [e.get("disk_tokens", 0) for e in events if e.get("event") == "prefix.matched"]

    recorded = workload.read_events(tmp_path / "run2")
    assert disk_tokens(res.events) == disk_tokens(recorded) == [37 * BS] * 3
    loads = [e for e in res.events if e.get("event") == "executor.disk_loaded"]
    assert len(loads) == 3
    assert all(e["seconds"] == pytest.approx(37 * rec.config.disk.load_s, abs=1e-6) for e in loads)
    # without the tier, the replay computes those prompts: their first tokens come later
    computed = sim.replay(rec, model, {"no-kv-disk": True})
    assert not [e for e in computed.events if e.get("event") == "executor.disk_loaded"]

    def prefill(r) -> int:
        return sum(e["prefill_tokens"] for e in r.events if e.get("event") == "executor.step")

    assert prefill(computed) - prefill(res) == 3 * 37 * BS
    # ... as a real run without the tier did (the same prompts on a fresh runtime)
    assert prefill(computed) == sum(
        e["prefill_tokens"] for e in workload.load(tmp_path / "run3").steps
    )
    # a loaded request's first token waits for its load (which is faster than computing
    # depends on the machine and the model: the tiny model computes about as fast as it reads)
    assert all(r["ttft_s"] >= 37 * rec.config.disk.load_s for r in res.records[:3])
