"""Replay without a runtime: block hashes, the step-time fit, a synthetic log replayed end to end
(deterministic, every request served, knobs moving outcomes the expected way), the CLI's sweep
and its errors on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actors.shared import blockhash, stepfit
from gpu.step.budget import Costs
from minirt.bench.driver import Record
from minirt.replay import runlog, sim, stepmodel, synth, workload
from minirt.replay.cli import main
from minirt.replay.loop import write_events
from minirt.replay.runlog import OLD_NAMES


@pytest.fixture(scope="module")
def synthetic() -> workload.Recorded:
    return workload.from_events(synth.synthetic_log(n=600, rate=12.0, seed=3), "synthetic")


@pytest.fixture(scope="module")
def model(synthetic: workload.Recorded) -> stepmodel.StepModel:
    return stepmodel.fit(synthetic.steps)


def test_chain_hashes_identify_shared_prefixes_only() -> None:
    a = list(range(100, 164)) + [1, 2, 3]
    b = list(range(100, 148)) + [9] * 16 + [4]
    ha, hb = blockhash.chain_hashes(a, 16), blockhash.chain_hashes(b, 16)
    assert len(ha) == 4 and len(hb) == 4  # full blocks only
    assert ha[:3] == hb[:3] and ha[3] != hb[3]
    assert blockhash.chain_hashes(a, 16, start_block=2, prev=ha[1]) == ha[2:]
    assert blockhash.block_tokens(ha[0], 16) == blockhash.block_tokens(hb[0], 16)
    assert blockhash.block_tokens(ha[3], 16) != blockhash.block_tokens(hb[3], 16)
    assert min(blockhash.block_tokens(ha[0], 16)) >= 0 > max(blockhash.filler(0, 3))
    with pytest.raises(ValueError, match="previous hash"):
        blockhash.chain_hashes(a, 16, start_block=1)


def test_nnls_matches_a_known_nonnegative_solution() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (200, 4))
    truth = np.array([0.5, 0.0, 2.0, 0.25])
    x = stepfit.nnls(a, a @ truth - 0.3 * a[:, 1])  # unconstrained optimum has x1 < 0
    assert (x >= 0).all() and x[1] == 0.0
    assert np.allclose(stepfit.nnls(a, a @ truth), truth, atol=1e-9)


def test_fit_recovers_the_step_law_and_round_trips(model: stepmodel.StepModel, tmp_path) -> None:
    law = synth.TRUE_STEP
    assert model.r2 > 0.98 and model.rel_err_p50 < 0.05
    for name in ("prefill_tokens", "decode_tokens", "decode_ctx", "prefill_ctx"):  # the big terms
        assert model.coef[name] == pytest.approx(law[name], rel=0.1), name
    assert abs(model.total_bias) < 0.01
    loaded = stepmodel.StepModel.load(model.save(tmp_path))
    assert loaded == model
    shape = (512, 16, 2, 3000, 400_000, 0)  # (no speculative decoding's draft rows)
    expected = law["intercept"] + sum(
        law.get(k, 0.0) * v for k, v in zip(stepmodel.FEATURES, shape, strict=True)
    )
    assert loaded.predict(*shape) == pytest.approx(expected, rel=0.05)
    with pytest.raises(ValueError, match="at least 3 step events"):
        stepmodel.fit([])


def _steps(law: dict, shapes: list[tuple[int, int, int, int]]) -> list[dict]:
    """Step events whose time follows ``law`` exactly: (prefill tokens, decodes, chunks, ctx)."""
    out = []
    for pre, dec, chunks, ctx in shapes:
        shape = {"prefill_tokens": pre, "decode_tokens": dec, "decode_ctx": ctx, "prefill_ctx": 0}
        t = law["intercept"] + law["prefill_chunks"] * chunks
        t += sum(law[k] * v for k, v in shape.items())
        out.append({"event": "step", "requests": dec + chunks, "step_s": t, **shape})
    return out


def test_a_fit_that_cannot_see_the_decode_cost_says_so_and_pooling_recovers_it(tmp_path) -> None:
    law = synth.TRUE_STEP
    # every step decodes 64 requests, at one context: per-decode and per-step costs are one term
    full = _steps(law, [(p, 64, 1 if p else 0, 64 * 200) for p in (0, 256, 512, 1024) * 5])
    alone = stepmodel.fit(full)
    assert alone.coef["decode_tokens"] == 0.0
    assert any("no per-decode cost" in n and "--fit-also" in n for n in alone.notes)
    truth = law["intercept"] + 4 * law["decode_tokens"] + 800 * law["decode_ctx"]
    assert abs(alone.predict(0, 4, 0, 800, 0) / truth - 1) > 0.3  # a batch of 4 decodes: wrong
    varied = _steps(law, [(0, d, 0, d * c) for d in range(1, 9) for c in (50, 300)])
    pooled = stepmodel.fit_runs([full, varied])
    assert pooled.n == len(full) + len(varied) and not any(
        "no per-decode" in n for n in pooled.notes
    )
    assert pooled.coef["decode_tokens"] == pytest.approx(law["decode_tokens"], rel=0.05)
    assert pooled.predict(0, 4, 0, 800, 0) == pytest.approx(truth, rel=0.05)


def test_a_fit_whose_decode_steps_look_alike_takes_the_per_row_cost_from_the_start() -> None:
    law = synth.TRUE_STEP
    # every decode step decodes 64 requests (contexts growing): one batch size, as in a burst
    shapes = [
        (p, 64, 1 if p else 0, 64 * c) for p in (0, 0, 256, 512, 1024) for c in range(100, 400, 40)
    ]
    full = _steps(law, shapes)
    truth = law["intercept"] + 4 * law["decode_tokens"] + 800 * law["decode_ctx"]
    assert abs(stepmodel.fit(full).predict(0, 4, 0, 800, 0) / truth - 1) > 0.3
    # the executor's start timed raw forwards: faster than served steps, in the same ratio
    seed = Costs(law["intercept"] / 2, law["prefill_tokens"] / 2, law["decode_tokens"] / 2)
    tied = stepmodel.fit(full, seed=seed)
    assert any("tied in the ratio the executor timed at start" in n for n in tied.notes)
    assert tied.predict(0, 4, 0, 800, 0) == pytest.approx(truth, rel=0.1)  # a batch of 4
    assert tied.predict(0, 64, 0, 64 * 200, 0) == pytest.approx(
        law["intercept"] + 64 * law["decode_tokens"] + 64 * 200 * law["decode_ctx"], rel=0.05
    )
    # decode steps of varied sizes tell the costs apart: the seed is not used
    varied = _steps(law, [(0, d, 0, d * c) for d in range(1, 9) for c in (50, 300)])
    assert not any("tied" in n for n in stepmodel.fit(full + varied, seed=seed).notes)


def test_cli_fit_also_pools_another_run(tmp_path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_events(synth.synthetic_log(n=20, seed=1), a)
    write_events(synth.synthetic_log(n=30, seed=2), b)
    dest = tmp_path / "pooled.json"
    assert main([str(a), "--fit", "--fit-also", str(b), "--out", str(dest)]) == 0
    pooled = stepmodel.StepModel.load(dest)
    own = stepmodel.fit(workload.load(a).steps)
    assert pooled.n == own.n + stepmodel.fit(workload.load(b).steps).n
    assert str(b) in pooled.source
    assert main([str(a), "--fit-also", str(b)]) == 2
    assert "use it with --fit" in capsys.readouterr().err


def test_synthetic_log_replays_every_request_deterministically(synthetic, model) -> None:
    first = sim.replay(synthetic, model)
    again = sim.replay(synthetic, model)
    s = first.summary()
    assert s["requests"] == 600 and s["errors"] == 0
    assert s["output_tokens"] == sum(r.outputs for r in synthetic.requests)
    assert 0.15 < s["prefix_hit_rate"] < 0.5  # 30% of prompts start with a shared system prompt
    assert first.decisions() == again.decisions()
    assert [r["ttft_s"] for r in first.records] == [r["ttft_s"] for r in again.records]
    admitted = {d[1] for d in first.decisions() if d[0] == "admit"}
    assert admitted == {r.rid for r in synthetic.requests}


def test_knobs_move_the_outcome_the_expected_way(synthetic, model) -> None:
    base = sim.replay(synthetic, model).summary()
    narrow = sim.replay(synthetic, model, {"max-batch-size": 2}).summary()
    assert narrow["queue_p50_ms"] > base["queue_p50_ms"] + 100
    assert narrow["ttft_p99_ms"] > base["ttft_p99_ms"]
    starved = sim.replay(synthetic, model, {"num-blocks": 64})
    assert any(d[0] == "refuse" for d in starved.decisions())
    assert starved.summary()["errors"] == 0  # refused admissions wait, nothing fails
    for policy in ("sjf", "lpm", "priority"):  # lpm asks the KV manager for match lengths
        other = sim.replay(synthetic, model, {"policy": policy, "max-batch-size": 2}).summary()
        assert other["errors"] == 0 and other["output_tokens"] == narrow["output_tokens"]
    sjf = sim.replay(synthetic, model, {"policy": "sjf", "max-batch-size": 2}).records
    fcfs = sim.replay(synthetic, model, {"max-batch-size": 2}).records
    short = [i for i, s in enumerate(synthetic.requests) if s.prompt_tokens < 100]
    assert sum(sjf[i]["queue_s"] for i in short) < sum(fcfs[i]["queue_s"] for i in short)


def test_cancels_and_stop_strings_replay_as_recorded(model) -> None:
    rec = workload.from_events(synth.synthetic_log(n=40, rate=12.0, seed=2, aborts=10))
    cancelled = [s for s in rec.requests if s.cancel_after_s is not None]
    stopped = [s for s in rec.requests if s.stop_after is not None]
    assert len(cancelled) == len(stopped) == 4
    res = sim.replay(rec, model)
    by = {r["request_id"]: r for r in res.records}
    for s in cancelled:
        r = by[s.rid]
        assert r["finish_reason"] == "abort" and r["e2e_s"] == pytest.approx(0.05)
    for s in stopped:
        assert by[s.rid]["finish_reason"] == "stop" and by[s.rid]["completion_tokens"] == 3
    released = {e["request_id"]: e["reason"] for e in res.events if e["event"] == "kv.released"}
    assert {released[s.rid] for s in cancelled + stopped} == {"aborted"}  # stopped, then freed
    allocated = {e["request_id"] for e in res.events if e["event"] == "kv.allocated"}
    assert allocated == set(released)  # every block given back


def test_old_event_names_read_the_same(synthetic) -> None:
    events = synth.synthetic_log(n=50, seed=3)
    back = {new: old for (actor, old), new in OLD_NAMES.items() if actor != "kv_manager"}
    old = [{**e, "event": back.get(e["event"], e["event"])} for e in events]
    a, b = workload.from_events(events), workload.from_events(old)
    assert [vars(s) for s in a.requests] == [vars(s) for s in b.requests]
    assert len(a.steps) == len(b.steps) > 0


def test_run_window_keeps_one_runs_requests_and_the_configuration() -> None:
    events = synth.synthetic_log(n=30, rate=10.0, seed=4)
    t0 = min(e["ts"] for e in events if e["event"] == "client.received")
    cut = sorted(e["ts"] for e in events if e["event"] == "client.received")[10]
    kept = runlog.run_window(events, cut - 1e-6, t0 + 100)
    rec = workload.from_events(kept)
    assert len(rec.requests) == 20 and rec.config.num_blocks == 4096


def test_cli_sweep_plots_p99_ttft_and_throughput(tmp_path) -> None:
    run = tmp_path / "run"
    write_events(synth.synthetic_log(n=300, rate=12.0, seed=5), run)
    out = tmp_path / "out"
    argv = [str(run), "--out", str(out), "--sweep", "max-batch-size=1,4,64"]
    assert main(argv) == 0
    data = json.loads((out / "results" / "report.json").read_text())
    points = data["sweep"]["points"]
    assert [p["value"] for p in points] == [1, 4, 64]
    assert points[0]["ttft_p99_ms"] > points[1]["ttft_p99_ms"] > points[2]["ttft_p99_ms"]
    assert (out / "sweep.png").stat().st_size > 1000
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "results" / "events" / "scheduler.jsonl").exists()
    assert "## Sweep of max-batch-size" in (out / "README.md").read_text()


def test_a_bench_report_replays_with_its_client_records_and_tags(tmp_path, capsys) -> None:
    events = synth.synthetic_log(n=40, rate=12.0, seed=6)
    raw = tmp_path / "results"  # a bench serve report's raw data
    write_events(events, raw / "runs" / "fcfs_batch_8")
    t0 = min(e["ts"] for e in events if e["event"] == "client.received")
    records = []
    for e in events:
        if e["event"] == "client.received":
            tag = "long" if int(e["request_id"][1:]) % 4 == 0 else "short"
            r = Record(e["request_id"], 100, (tag,), sent=e["ts"] - t0 + 0.5, end=e["ts"] - t0 + 1)
            r.token_times = [r.sent + 0.1, r.sent + 0.2]
            records.append(r.summary())
    runs = {"fcfs batch 8": {"records": records, "wall_s": 9.0}}
    (raw / "report.json").write_text(json.dumps({"runs": runs}))
    rec = workload.load(tmp_path)
    assert rec.wall_s == 9.0 and rec.requests[0].received == pytest.approx(0.5)
    assert workload.load(raw).wall_s == 9.0  # results/ named, or a report of before that layout
    assert {t for s in rec.requests for t in s.tags} == {"long", "short"}
    out = tmp_path / "out"
    assert main([str(tmp_path), "--run", "fcfs batch 8", "--out", str(out)]) == 0
    assert "| replay (short) |" in (out / "README.md").read_text()
    assert main([str(tmp_path), "--run", "nope", "--out", str(out)]) == 2
    assert "the report has ['fcfs batch 8']" in capsys.readouterr().err


def test_cli_fit_stores_the_model_next_to_the_run(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    write_events(synth.synthetic_log(n=20, seed=1), run)
    assert main([str(run), "--fit"]) == 0
    assert "R^2" in capsys.readouterr().out
    stored = stepmodel.StepModel.load(run / stepmodel.FILENAME)
    assert stored.n > 0 and stored.r2 > 0.9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fifo"], "--policy (scheduler.policy): 'fifo' is not one of"),
        (["--max-batch-size", "many"], "--max-batch-size (scheduler.max_batch_size): 'many'"),
        (["--sweep", "batch=1,2"], "unknown knob 'batch'"),
        (["--sweep", "max-batch-size"], "expected KNOB=V1,V2"),
        (["--kv-mode", "sometimes"], "--kv-mode"),
    ],
)
def test_cli_bad_input_names_the_field(tmp_path, capsys, argv, message) -> None:
    run = tmp_path / "run"
    write_events(synth.synthetic_log(n=10, seed=1), run)
    assert main([str(run), "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_directory_without_events(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "neither a run directory" in capsys.readouterr().err


def test_a_replayed_run_says_more_when_the_next_submit_lands_with_its_grant() -> None:
    """The replay's scheduler drains what is due at one instant before it sends, as the actor
    drains its inbox: a submit that lands together with the first request's grant is queued
    before that run leaves, so the run tells the executor that more follow (the real actor's
    x_run.more), and the replayed first step is not stepped alone."""
    from actors.runtime.config import KVConfig, SchedulerConfig
    from messages import executor as xm
    from messages.common import SamplingParams
    from messages.scheduler import Submit
    from minirt.replay.cores import SimKV, SimScheduler
    from minirt.replay.loop import Loop, SimLog

    loop, events, runs = Loop(hop_s=0.25), [], []
    kv_cfg = KVConfig(block_size=4)
    kv = SimKV(loop, kv_cfg, 64, SimLog(events, "kv_manager", loop, 0.0))
    sched = SimScheduler(loop, SchedulerConfig(), kv_cfg, SimLog(events, "scheduler", loop, 0.0))
    loop.handlers = {
        "scheduler": sched.handle,
        "kv_manager": kv.handle,
        "executor": lambda m: runs.append(m) if isinstance(m, xm.Run) else None,
        "tokenizer": lambda m: None,
    }

    def submit(rid: str) -> Submit:
        return Submit(
            request_id=rid,
            prompt_ids=list(range(1, 7)),
            params=SamplingParams(max_tokens=4),
            arrival=0.0,
        )

    loop.send("scheduler", submit("a"), delay=0.0)
    # a's grant reaches the scheduler at 0.5 (two hops); b lands at the same instant, after it
    loop.at(0.375, lambda: loop.send("scheduler", submit("b"), delay=0.125))
    loop.run()
    assert [(r.request_id, r.more) for r in runs] == [("a", True), ("b", False)]
