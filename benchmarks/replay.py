"""``minirt bench replay``: the replay's acceptance report (docs/benchmarks/replay/).

1. Records real runs on the bench model, in interleaved rounds (``--rounds``): the mix workload
   (60 short prompts, 4 long, at once) at the defaults and under each what-if of ``PREDICT``, and
   one Poisson run; each run's events and client-side records are kept
   (``OUT/results/runs/NAME/events``, ``OUT/results/report.json`` in the layout of ``minirt bench
   serve``, so ``minirt replay OUT --run NAME`` works on them too).
2. Fidelity: replays the first round's mix run and the Poisson run under their own configuration
   (each with the step-time model fitted on its own steps) and compares TTFT p50/p99 and
   throughput (target: within 15%) and the admission decisions about the first 100 requests
   (identical).
3. Prediction: in each round, replays a recorded run under another setting and compares TTFT
   p50/p99, TPOT p50 and throughput with that round's real run of the setting, both ways
   (batch 256 -> 8 and 8 -> 256, adaptive -> fixed budget and back); the medians over the rounds
   are compared (target: within 20%).
4. Speed: a synthetic 10,000-request log, read and replayed (target: under 10 s).

Run it on a quiet machine; ``--quick`` (tiny workloads) only checks that it works. README.md, its
plot and each replay's own report (``OUT/replays/NAME/``) go in ``OUT``; the raw data (report.json,
the recorded runs) in ``OUT/results/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from minirt.bench.driver import drive
from minirt.bench.workloads import Job, mix, poisson
from minirt.eventlog import summary as run_summary
from minirt.eventlog.summary import results_dir
from minirt.replay import report, runlog, sim, stepmodel, synth, workload

# what-if -> (runtime flags of its real run, the same as replay knobs)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "defaults": ("", {}),
    "sjf": ("--policy sjf", {"policy": "sjf"}),
    "long-prefill-256": ("--long-prefill-threshold 256", {"long-prefill-threshold": 256}),
    "batch8": ("--max-batch-size 8", {"max-batch-size": 8}),
    "step-budget-512": ("--step-budget 512", {"step-budget": 512}),
    "fixed-budget": ("--budget-policy fixed", {"budget-policy": "fixed"}),
}
# prediction -> (the recorded run replayed, the setting whose real run it is compared with,
# the knobs it is replayed with: the setting's own, or, back to the defaults, the defaults')
PREDICT: dict[str, tuple[str, str, dict[str, Any]]] = {
    **{w: ("defaults", s, SETTINGS[s][1]) for w, s in (
        ("sjf", "sjf"),
        ("long-prefill-256", "long-prefill-256"),
        ("batch 256 -> 8", "batch8"),
        ("step-budget-512", "step-budget-512"),
        ("adaptive -> fixed budget", "fixed-budget"),
    )},
    "batch 8 -> 256": ("batch8", "defaults", {"max-batch-size": 256}),
    "fixed -> adaptive budget": ("fixed-budget", "defaults", {"budget-policy": "adaptive"}),
}  # fmt: skip
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "throughput_tok_s")
PRED_COLS = ["what-if", "recorded at", "metric", "measured", "predicted", "error", "rounds"]
SPEED_COLS = ["requests", "read_and_fit_s", "replay_s", "total_s", "steps", "ok"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench replay", description=__doc__)
    p.add_argument("--out", default="docs/benchmarks/replay")
    p.add_argument("--model", help="model dir (default: the bench model)")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--poisson-requests", type=int, default=128)
    p.add_argument("--mix-requests", type=int, default=64)
    p.add_argument("--long-len", type=int, default=2000, help="mix: long prompts' length")
    p.add_argument("--synthetic-requests", type=int, default=10_000)
    p.add_argument("--flags", default="", help="runtime flags for every recorded run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the mix runs")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test")
    return p.parse_args(argv)


def record(model: Path, flags: str, jobs: list[Job], out: Path, name: str) -> dict[str, Any]:
    """One real run: start a runtime, drive ``jobs``, keep its events and the client records."""
    import shlex

    from minirt.launch.launch import start_runtime

    print(f"recording {name} ({len(jobs)} requests, flags {flags!r})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="minirt-replay-") as d:
        run_dir = Path(d) / "rt"
        with start_runtime(model, run_dir, *shlex.split(flags), timeout=300) as rt:
            records, wall = trio.run(drive, rt.endpoint, jobs, 256)
        dest = results_dir(out) / "runs" / runlog.slug(name)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(run_dir / "events", dest / "events")
    recs = [_micro(r.summary()) for r in records]
    return {"name": name, "flags": flags, "records": recs, "wall_s": wall}


def _micro(x: Any) -> Any:
    """``x`` with its floats rounded to microseconds (the report's raw data stays small)."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, list):
        return [_micro(v) for v in x]
    if isinstance(x, dict):
        return {k: _micro(v) for k, v in x.items()}
    return x


def _pass(err: float, target: float) -> str:
    return f"{err:.1%} ({'ok' if err <= target else 'over'} {target:.0%})"


def fidelity_rows(out: Path, name: str, first: int) -> tuple[list[dict[str, Any]], dict]:
    rec = workload.load(out, name)
    model = stepmodel.fit(rec.steps, f"fitted from {name}", rec.config.step_costs)
    model.save(results_dir(out) / "runs" / runlog.slug(name))
    res = sim.replay(rec, model, to_executor_s=sim.calibrate(rec, model))
    report.write(
        out / "replays" / name, f"minirt replay {out} --run {name}", rec, model, {"replay": res}, {}
    )
    a, b = run_summary.summarize(rec.records, rec.wall_s), res.summary()
    dec = report.compare_decisions(rec, res, first)
    rows = []
    for key in ("ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s"):
        err = report.rel(b[key], a[key])
        rows.append(
            {
                "run": name,
                "metric": key,
                "measured": a[key],
                "replay": b[key],
                "error": _pass(err, 0.15),
                "rel_error": err,
            }
        )
    return rows, {"run": name, "model": model.summary(), "decisions": dec}


def run_name(setting: str, rnd: int) -> str:
    return f"mix-{setting}.r{rnd}"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def predict_rows(out: Path, runs: dict[str, dict[str, Any]], rounds: int) -> list[dict]:
    """Each what-if of ``PREDICT`` in every round: the recorded run replayed at the setting
    (with the step model fitted on its own steps) against that round's real run of it; one row
    per metric, the medians over the rounds compared."""
    rows = []
    for what, (base, setting, knobs) in PREDICT.items():
        predicted: dict[str, list[float]] = {m: [] for m in METRICS}
        measured: dict[str, list[float]] = {m: [] for m in METRICS}
        for rnd in range(1, rounds + 1):
            name = run_name(base, rnd)
            rec = workload.load(out, name)
            model = stepmodel.fit(rec.steps, f"fitted from {name}", rec.config.step_costs)
            res = sim.replay(rec, model, knobs, sim.calibrate(rec, model))
            if rnd == 1:
                cmd = f"minirt replay {out} --run {name} " + " ".join(
                    f"--{k} {v}" for k, v in knobs.items()
                )
                slug = what.replace(" -> ", "-to-").replace(" ", "-")
                report.write(
                    out / "replays" / f"predict-{slug}", cmd, rec, model, {"replay": res}, knobs
                )
            real = runs[run_name(setting, rnd)]
            got = run_summary.summarize(real["records"], real["wall_s"])
            for m, v in res.summary().items():
                if m in predicted:
                    predicted[m].append(v)
                    measured[m].append(got[m])
        for m in METRICS:
            p, q = median(predicted[m]), median(measured[m])
            err = report.rel(p, q)
            each = [report.rel(a, b) for a, b in zip(predicted[m], measured[m], strict=True)]
            rows.append(
                {
                    "what-if": what,
                    "recorded at": base,
                    "metric": m,
                    "measured": q,
                    "predicted": p,
                    "error": _pass(err, 0.20),
                    "rel_error": err,
                    "rounds": ", ".join(f"{e:.0%}" for e in each),
                    "measured_rounds": measured[m],
                    "predicted_rounds": predicted[m],
                }
            )
    return rows


def issue_rows(out: Path, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Short requests' p99 TTFT of round 1: the defaults' run replayed as recorded and at each
    setting, against the real runs (the table of issue 56)."""
    rec = workload.load(out, run_name("defaults", 1))
    model = stepmodel.fit(rec.steps, "", rec.config.step_costs)
    lat = sim.calibrate(rec, model)
    rows = []
    for setting, (flags, knobs) in SETTINGS.items():
        res = sim.replay(rec, model, knobs, lat).summary("short")
        real = runs[run_name(setting, 1)]
        got = run_summary.summarize(real["records"], real["wall_s"], "short")
        rows.append(
            {
                "replay of the defaults' run": flags or "as recorded",
                "predicted_short_ttft_p99_ms": res["ttft_p99_ms"],
                "measured_short_ttft_p99_ms": got["ttft_p99_ms"],
                "off": f"{report.rel(res['ttft_p99_ms'], got['ttft_p99_ms']):.1%}",
                "predicted_p50": res["ttft_p50_ms"],
                "measured_p50": got["ttft_p50_ms"],
            }
        )
    return rows


def speed(n: int) -> dict[str, Any]:
    events = synth.synthetic_log(n=n)
    t0 = time.perf_counter()
    rec = workload.from_events(events, "synthetic")
    model = stepmodel.fit(rec.steps)
    t1 = time.perf_counter()
    res = sim.replay(rec, model)
    t2 = time.perf_counter()
    return {
        "requests": n,
        "read_and_fit_s": t1 - t0,
        "replay_s": t2 - t1,
        "total_s": t2 - t0,
        "steps": res.steps,
        "events": len(res.events),
        "ok": "yes" if t2 - t0 < 10 else "no",
    }


def predicted_plot(out: Path, rows: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4.5))
    for ax, m in zip(axes, METRICS, strict=True):
        sel = [r for r in rows if r["metric"] == m]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r["measured"] for r in sel], 0.4, label="real run")
        ax.bar([x + 0.2 for x in xs], [r["predicted"] for r in sel], 0.4, label="replay")
        ax.set_xticks(list(xs), [r["what-if"] for r in sel], rotation=60, ha="right", fontsize=7)
        ax.set_title(m, fontsize=9)
    axes[0].legend()
    fig.suptitle("What-if replay vs real runs (mix, medians of the rounds)")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=100)
    plt.close(fig)
    return "predicted_vs_measured.png"


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model:
        model = Path(a.model)
    else:
        from minirt.bench.serve import default_bench_model

        model = default_bench_model()
    mcfg = json.loads((model / "config.json").read_text())
    vocab, context = int(mcfg["vocab_size"]), int(mcfg.get("max_position_embeddings", 4096))
    a.long_len = min(a.long_len, context - 64)  # as `minirt bench serve --workload mix` does
    if a.quick:
        a.mix_requests, a.poisson_requests, a.long_len = 16, 24, min(a.long_len, 300)
        a.synthetic_requests = min(a.synthetic_requests, 1000)
    mix_jobs = mix(vocab, 0, n=a.mix_requests, long_len=a.long_len)
    runs: dict[str, dict[str, Any]] = {}
    pjobs = poisson(vocab, a.rate, 0, n=a.poisson_requests)
    runs["poisson-fcfs"] = record(model, a.flags, pjobs, out, "poisson-fcfs")
    for rnd in range(1, a.rounds + 1):  # interleaved: the machine's drift lands on every setting
        for setting, (flags, _) in SETTINGS.items():
            jobs = [Job(**vars(j)) for j in mix_jobs]
            name = run_name(setting, rnd)
            runs[name] = record(model, f"{a.flags} {flags}", jobs, out, name)
    for r in runs.values():
        r["summary"] = {"run": r["name"], **run_summary.summarize(r["records"], r["wall_s"])}
    data: dict[str, Any] = {"args": vars(a), "runs": runs}
    (results_dir(out) / "report.json").write_text(json.dumps(data, indent=1, default=str))
    fid, checks = [], []
    for name in (run_name("defaults", 1), "poisson-fcfs"):
        rows, check = fidelity_rows(out, name, 100)
        fid += rows
        checks.append(check)
    pred = predict_rows(out, runs, a.rounds)
    issue = issue_rows(out, runs)
    spd = speed(a.synthetic_requests)
    data.update(fidelity=fid, decisions=checks, prediction=pred, issue_table=issue, speed=spd)
    sections = [
        "How the replay works and what this report checks: [METHOD.md](METHOD.md); what issue "
        "56 found and what changed, before and after: [BEFORE.md](BEFORE.md).\n",
        "## Fidelity: replays under the recorded configuration (target: within 15%)\n",
        run_summary.table(fid, ["run", "metric", "measured", "replay", "error"]),
    ]
    for c in checks:
        d = c["decisions"]
        same = "**identical**" if d["identical"] else f"differ: {d.get('first_difference')}"
        sections.append(
            f"\n{c['run']}: admission decisions about the first {d['requests']} requests "
            f"({d['recorded']} decisions, {d['refusals_recorded']} refusals): {same}. "
            f"Step model:\n\n```\n{c['model']}\n```\n"
        )
    sections += [
        "\n## Prediction: a recorded mix run replayed at another setting, vs real runs of it "
        "(target: within 20%)\n",
        f"{a.rounds} interleaved rounds; in each, every setting ran for real and each what-if "
        "replayed that round's recorded run with the step model fitted on its own steps "
        "(`minirt replay OUT --run mix-SETTING.rN --KNOB VALUE`). `measured` and `predicted` are "
        "the medians over the rounds, `error` theirs, `rounds` each round's own error. All "
        "requests; TPOT is the median request's.\n",
        run_summary.table(pred, PRED_COLS),
        "\n### Short requests' p99 TTFT, round 1 (issue 56's table)\n",
        run_summary.table(issue, list(issue[0])),
        "\n## Speed (target: a 10,000-request log in under 10 s)\n",
        run_summary.table([spd], SPEED_COLS),
        "\nEach replay's own report (recorded vs replayed tables, steps by kind, TTFT CDF, "
        "throughput and KV use over time side by side, the replayed event log) is under "
        "`replays/`; the recorded runs' events under `results/runs/` (`minirt replay "
        + str(out)
        + " --run mix-defaults.r1 --policy sjf`).\n",
    ]
    pngs = [predicted_plot(out, pred)]
    command = "minirt bench replay " + " ".join(argv)
    path = run_summary.write(out, command, "minirt replay: acceptance", sections, data, pngs)
    print("".join(sections))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
