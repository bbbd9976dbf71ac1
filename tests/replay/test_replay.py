"""What-if replay of a real recorded run: four actor processes on the tiny model serve about 20
requests (shared prefixes, refusals on a small pool), then the replay reruns the log through the
real scheduler core and KV manager with a simulated executor: same admission decisions, TTFT
close, a trace of a replayed request, and knobs that change the outcome the expected way."""

from __future__ import annotations

import json
import random

import pytest
import trio
import trio.testing

from messages.tokenizer import client_request_id
from minirt.bench.workloads import Job
from minirt.client import RequestError, open_client
from minirt.eventlog import read_events, trace_lines
from minirt.eventlog import summary as bench_report
from minirt.replay import sim, stepmodel, workload
from minirt.replay.cli import main
from tests.support.runtime import start_runtime, stopped

BS = 16


def _blocks(job: Job) -> int:
    return -(-(len(job.prompt) + job.max_tokens) // BS)


def waves() -> tuple[list[list[Job]], int]:
    """Requests whose prompt + max_tokens is 401 tokens (26 blocks; the last one also holds the
    executor's one block of lookahead, so none outgrows its full reservation), in waves (each
    sent half a second after the one before has ended: the replay's slack, as its simulated
    steps may end a wave a little later than the recording did; a wave's requests reach the
    front door together, see ``send``): a warm-up request (the fresh runtime's slow first
    steps); 8 requests of 200, 216, ... new tokens, the first with an 80-token prefix, in a pool
    that holds 7: the last one queued is refused until the first finishes (its blocks are all
    the refused one needs, however many frees arrive together); one request with the prefix
    (cached once it is prefilled); 9 more sharing it (212, 224, ... new tokens): 8 fit, the 9th
    waits.
    Returns the waves and the pool size."""
    rng = random.Random(5)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, 500) for _ in range(n)]

    shared = ids(80)
    first = []
    for i in range(8):
        m = 200 + 16 * i
        prompt = shared + ids(401 - m - 80) if i == 0 else ids(401 - m)
        first.append(Job(f"a{i}", prompt, m))
    second = [
        Job(f"s{j}", shared + ids(401 - (200 + 12 * j) - 80), 200 + 12 * j) for j in range(1, 10)
    ]
    out = [[Job("warm", ids(25), 8)], first, [Job("s0", shared + ids(25), 8)], second]
    return out, 7 * _blocks(first[0]) + 2


async def send(rt, wave: list[Job]) -> list:
    """The wave's requests, arriving at the front door together: it is stopped while a client
    (welcomed before) sends them all (until every task waits for an answer), then let go. A
    loaded machine deschedules the client between two sends of a burst for longer than a request
    of the tiny model lasts, and the recording would then hold another workload than the waves.
    Each request's result, or its RequestError."""
    out: list = []

    async def one(client, job: Job) -> None:
        try:
            out.append(
                await client.generate(
                    prompt_ids=job.prompt, max_tokens=job.max_tokens, ignore_eos=True,
                    request_id=job.rid,
                )
            )  # fmt: skip
        except RequestError as e:
            out.append(e)

    async with open_client(rt.endpoint) as client, trio.open_nursery() as nursery:
        with stopped(rt, "tokenizer"):
            for job in wave:
                nursery.start_soon(one, client, job)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    return out


@pytest.fixture(scope="module")
def recorded(tiny_model, tmp_path_factory):
    todo, pool = waves()
    run = tmp_path_factory.mktemp("replay") / "run"
    flags = ("--num-blocks", str(pool), "--kv-mode", "full", "--chunk-cap", "64")

    async def record(rt) -> None:
        for i, wave in enumerate(todo):
            if i:
                await trio.sleep(0.5)  # the gap between waves (the replay's slack)
            results = await send(rt, wave)
            assert len(results) == len(wave)
            assert not [r for r in results if isinstance(r, RequestError)], results

    with start_runtime(tiny_model, run, *flags, "--step-budget", "128") as rt:
        trio.run(record, rt)
    return run


def test_replay_makes_the_recorded_admission_decisions(recorded) -> None:
    rec = workload.load(recorded)
    assert len(rec.requests) == 19 and not rec.notes
    refused = [client_request_id(d[1]) for d in rec.decisions if d[0] == "refuse"]
    assert [r[0] for r in refused] == ["a", "s"], "the small pool did not refuse one per wave"
    assert sum(r["cached_tokens"] for r in rec.records) >= 9 * 80  # wave 2 hit the cache
    model = stepmodel.fit(rec.steps)
    # the executor.step events carry the contexts the model uses (whether the fit can also tell
    # a per-decode cost from the contexts' depends on the machine's kernels: a note, not a fault)
    assert not [n for n in model.notes if "have no" in n], model.notes
    res = sim.replay(rec, model, to_executor_s=sim.calibrate(rec, model))
    assert res.decisions() == rec.decisions  # the exact sequence, refusals and retries included
    a = bench_report.summarize(rec.records, rec.wall_s)
    b = res.summary()
    assert b["errors"] == 0 and b["output_tokens"] == a["output_tokens"]
    assert b["prefix_hit_rate"] == pytest.approx(a["prefix_hit_rate"])
    # When each request got its first token, as the replay tells it. The refused request of
    # each wave waited for the first of its wave to finish: the last first token of its wave,
    # in the recording and in the replay. How close the replayed times are is a figure for the
    # benchmark reports (docs/benchmarks/replay*.md), not a test: on a loaded machine a stall of
    # any actor shows in the recorded times and nowhere in the replay. Here the replay only has
    # to be of the recording's order (a unit or clock error is orders of magnitude off).
    replayed = {client_request_id(r["request_id"]): r["ttft_s"] for r in res.records}
    recorded = {client_request_id(r["request_id"]): r["ttft_s"] for r in rec.records}
    for times in (recorded, replayed):
        for late in refused:
            others = [t for k, t in times.items() if k[0] == late[0] and k not in (late, "s0")]
            assert times[late] > max(others), (times is replayed, late, times)
    mean_ratio = sum(replayed.values()) / sum(recorded.values())
    assert 0.1 <= mean_ratio <= 10, mean_ratio
    assert 0.1 <= b["throughput_tok_s"] / a["throughput_tok_s"] <= 10


def test_replayed_request_can_be_traced(recorded, tmp_path) -> None:
    out = tmp_path / "replay"
    assert main([str(recorded), "--out", str(out)]) == 0
    data = json.loads((out / "results" / "report.json").read_text())
    assert data["replays"]["replay"]["decisions"]["identical"]
    for png in ("ttft_cdf.png", "throughput_kv.png"):
        assert (out / png).stat().st_size > 1000
    refused = next(d[1] for d in workload.load(recorded).decisions if d[0] == "refuse")
    lines = trace_lines(read_events(out / "results"), refused)  # the replayed events
    text = "\n".join(lines)
    for actor in ("tokenizer", "scheduler", "kv_manager", "executor"):
        assert f" {actor} " in text, actor
    assert "admission.refused" in text and "<- waited" in text
    assert "client.completed" in lines[-1] or "request.finished" in text


def test_max_batch_size_1_raises_queue_time_and_a_big_pool_refuses_nobody(recorded) -> None:
    rec = workload.load(recorded)
    model = stepmodel.fit(rec.steps)
    base = sim.replay(rec, model)
    one = sim.replay(rec, model, {"max-batch-size": 1})
    assert one.summary()["queue_p50_ms"] > 2 * base.summary()["queue_p50_ms"]
    assert max(e["running"] for e in one.events if e["event"] == "request.admitted") == 1
    big = sim.replay(rec, model, {"num-blocks": 4096})
    assert not [d for d in big.decisions() if d[0] == "refuse"]
    assert big.summary()["queue_p99_ms"] < base.summary()["queue_p99_ms"]


def test_a_bench_serve_report_replays(tiny_model, tmp_path) -> None:
    from minirt.bench.serve import main as serve

    report = tmp_path / "report"
    argv = ["--start", "--model", str(tiny_model), "--workload", "w1", "--requests", "12"]
    assert serve([*argv, "--out", str(report), "--variant", "small=--max-batch-size 4"]) == 0
    assert (report / "results" / "runs" / "small" / "events" / "scheduler.jsonl").exists()
    out = tmp_path / "replay"
    assert main([str(report), "--run", "small", "--out", str(out), "--max-batch-size", "2"]) == 0
    data = json.loads((out / "results" / "report.json").read_text())
    assert data["config"]["max_batch_size"] == 4
    assert data["replays"]["replay"]["config"]["max_batch_size"] == 2
    rows = {r["run"]: r for r in data["rows"]}
    assert rows["replay"]["requests"] == rows["recorded"]["requests"] == 12
    rec = workload.load(report, "small")  # the client's records, and the runtime's events
    assert {client_request_id(r["request_id"]) for r in rec.records} == {
        f"w1-{i}" for i in range(12)
    }
    model = stepmodel.fit(rec.steps)
    same = sim.replay(rec, model).summary()
    narrower = sim.replay(rec, model, {"max-batch-size": 2}).summary()
    assert narrower["queue_p50_ms"] > same["queue_p50_ms"]
