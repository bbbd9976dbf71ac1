"""``minirt bench replay``: the replay's acceptance report (docs/benchmarks/replay/).

1. Records real runs on the bench model: the mix workload (long + short) under fcfs, sjf,
   ``--max-batch-size 8`` and the long-prefill limit, and a Poisson run; each run's events and
   client-side records are kept (``OUT/results/runs/NAME/events``, ``OUT/results/report.json`` in
   the layout of ``minirt bench serve``, so ``minirt replay OUT --run NAME`` works on them too).
2. Fidelity: replays the fcfs mix run and the Poisson run under their own configuration (each
   with the step-time model fitted on its own steps) and compares TTFT p50/p99 and throughput
   (target: within 15%) and the admission decisions about the first 100 requests (identical).
3. Prediction: replays the fcfs mix run under sjf, ``--max-batch-size 8`` and the long-prefill
   limit and compares short requests' p99 TTFT with the real runs of those settings (target:
   within 20%).
4. Speed: a synthetic 10,000-request log, read and replayed (target: under 10 s).

Run it on a quiet machine; ``--quick`` (tiny workloads) only checks that it works. README.md, its
plot and each replay's own report (``OUT/replays/NAME/``) go in ``OUT``; the raw data (report.json,
the recorded runs, the pooled step model) in ``OUT/results/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
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

LONG_PREFILL: dict[str, Any] = {
    "long-prefill-threshold": 512,
    "max-long-prefills": 1,
    "chunk-cap": 512,
}
# variant -> (runtime flags of the real run, the same as replay knobs)
PREDICT: dict[str, tuple[str, dict[str, Any]]] = {
    "sjf": ("--policy sjf", {"policy": "sjf"}),
    "batch8": ("--max-batch-size 8", {"max-batch-size": 8}),
    "long-prefill-limit": (
        "--long-prefill-threshold 512 --max-long-prefills 1 --chunk-cap 512",
        LONG_PREFILL,
    ),
}
PRED_COLS = [
    "setting",
    "measured_short_ttft_p50_ms",
    "predicted_short_ttft_p50_ms",
    "measured_short_ttft_p99_ms",
    "predicted_short_ttft_p99_ms",
    "error",
    "own_fit_short_ttft_p99_ms",
    "own_fit_error",
]
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
    recs = [r.summary() for r in records]
    return {"name": name, "flags": flags, "records": recs, "wall_s": wall}


def _pass(err: float, target: float) -> str:
    return f"{err:.1%} ({'ok' if err <= target else 'over'} {target:.0%})"


def fidelity_rows(out: Path, name: str, first: int) -> tuple[list[dict[str, Any]], dict]:
    rec = workload.load(out, name)
    model = stepmodel.fit(rec.steps, source=f"fitted from {name}")
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


POOLED = "stepmodel-pooled.json"


def pooled_model(out: Path, base: str, other: str) -> stepmodel.StepModel:
    """The step model the predictions use: fitted on the base run's steps pooled with another
    run's of the same machine. The mix run alone cannot tell the per-decode cost from the
    per-step cost (every step of it decodes about as many requests), which a replay at another
    batch size needs; the Poisson run's small, varied batches can."""
    rec, oth = workload.load(out, base), workload.load(out, other)
    model = stepmodel.fit_runs([rec.steps, oth.steps], source=f"fitted from {base} + {other}")
    model.save(results_dir(out) / POOLED)
    return model


def predict_rows(out: Path, base: str, other: str, runs: dict[str, dict[str, Any]]) -> list[dict]:
    rec = workload.load(out, base)
    own = stepmodel.StepModel.load(results_dir(out) / "runs" / runlog.slug(base))
    model = pooled_model(out, base, other)
    lat, own_lat = sim.calibrate(rec, model), sim.calibrate(rec, own)
    rows = []
    for variant, (_, knobs) in PREDICT.items():
        name = f"mix-{variant}"
        res = sim.replay(rec, model, knobs, lat)
        alone = sim.replay(rec, own, knobs, own_lat).summary("short")
        cmd = (
            f"minirt replay {out} --run {base} --step-model {results_dir(out) / POOLED} "
            + " ".join(f"--{k} {v}" for k, v in knobs.items())
        )
        report.write(
            out / "replays" / f"predict-{variant}", cmd, rec, model, {"replay": res}, knobs
        )
        real = runs[name]
        measured = run_summary.summarize(real["records"], real["wall_s"], "short")
        predicted = res.summary("short")
        err = report.rel(predicted["ttft_p99_ms"], measured["ttft_p99_ms"])
        rows.append(
            {
                "setting": variant,
                "measured_short_ttft_p99_ms": measured["ttft_p99_ms"],
                "predicted_short_ttft_p99_ms": predicted["ttft_p99_ms"],
                "error": _pass(err, 0.20),
                "rel_error": err,
                "measured_short_ttft_p50_ms": measured["ttft_p50_ms"],
                "predicted_short_ttft_p50_ms": predicted["ttft_p50_ms"],
                "own_fit_short_ttft_p99_ms": alone["ttft_p99_ms"],
                "own_fit_error": f"{report.rel(alone['ttft_p99_ms'], measured['ttft_p99_ms']):.1%}",
            }
        )
    base_rec = run_summary.summarize(rec.records, rec.wall_s, "short")
    rows.insert(
        0,
        {
            "setting": "fcfs (recorded)",
            "measured_short_ttft_p99_ms": base_rec["ttft_p99_ms"],
            "predicted_short_ttft_p99_ms": base_rec["ttft_p99_ms"],
            "error": "-",
            "rel_error": 0.0,
            "measured_short_ttft_p50_ms": base_rec["ttft_p50_ms"],
            "predicted_short_ttft_p50_ms": base_rec["ttft_p50_ms"],
            "own_fit_short_ttft_p99_ms": base_rec["ttft_p99_ms"],
            "own_fit_error": "-",
        },
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

    names = [r["setting"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["measured_short_ttft_p99_ms"] for r in rows],
        0.4,
        label="measured (real run)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["predicted_short_ttft_p99_ms"] for r in rows],
        0.4,
        label="predicted (replay of the fcfs run)",
    )
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="short requests' TTFT p99 (ms)", title="Replay prediction vs real runs (mix)")
    ax.legend()
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
    runs["mix-fcfs"] = record(model, a.flags, mix_jobs, out, "mix-fcfs")
    pjobs = poisson(vocab, a.rate, 0, n=a.poisson_requests)
    runs["poisson-fcfs"] = record(model, a.flags, pjobs, out, "poisson-fcfs")
    for variant, (flags, _) in PREDICT.items():
        jobs = [Job(**vars(j)) for j in mix_jobs]
        runs[f"mix-{variant}"] = record(model, f"{a.flags} {flags}", jobs, out, f"mix-{variant}")
    for r in runs.values():
        r["summary"] = {"run": r["name"], **run_summary.summarize(r["records"], r["wall_s"])}
    data: dict[str, Any] = {"args": vars(a), "runs": runs}
    (results_dir(out) / "report.json").write_text(json.dumps(data, indent=1, default=str))
    fid, checks = [], []
    for name in ("mix-fcfs", "poisson-fcfs"):
        rows, check = fidelity_rows(out, name, 100)
        fid += rows
        checks.append(check)
    pred = predict_rows(out, "mix-fcfs", "poisson-fcfs", runs)
    pooled = stepmodel.StepModel.load(results_dir(out) / POOLED)
    spd = speed(a.synthetic_requests)
    data.update(fidelity=fid, decisions=checks, prediction=pred, speed=spd)
    sections = [
        "How the replay works and what this report checks: [METHOD.md](METHOD.md).\n",
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
        "\n## Prediction: the fcfs mix run replayed under other settings, vs real runs of them "
        "(short requests, target: p99 TTFT within 20%)\n",
        "The predictions use the step model fitted on the mix run's steps pooled with the "
        "Poisson run's (`minirt replay " + str(out) + " --run mix-fcfs --fit --fit-also "
        "poisson-fcfs --out " + str(results_dir(out) / POOLED) + "`). The mix run alone cannot "
        "tell the per-decode cost from the per-step cost (every one of its steps decodes about as "
        "many requests, so its fit puts all of it in the intercept): the last two columns show "
        "what that fit predicts, far off wherever the batch size changes.\n\n"
        f"```\n{pooled.summary()}\n```\n\n",
        run_summary.table(pred, PRED_COLS),
        "\n## Speed (target: a 10,000-request log in under 10 s)\n",
        run_summary.table([spd], SPEED_COLS),
        "\nEach replay's own report (recorded vs replayed tables, TTFT CDF, throughput and KV use "
        "over time side by side, the replayed event log) is under `replays/`; the recorded runs' "
        "events under `results/runs/` (`minirt replay " + str(out) + " --run mix-fcfs --policy "
        "sjf`).\n",
    ]
    pngs = [predicted_plot(out, pred)]
    command = "minirt bench replay " + " ".join(argv)
    path = run_summary.write(out, command, "minirt replay: acceptance", sections, data, pngs)
    print("".join(sections))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
