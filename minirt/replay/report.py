"""A replay's report: recorded vs replayed numbers (as ``minirt bench serve`` reports them),
fidelity, admission decisions, plots side by side, a knob sweep, and the replayed event log
(``OUT/results/events/``, so ``minirt trace ID --run-dir OUT/results`` shows why a replayed request
waited). README.md and the plots go in ``OUT``, report.json and the event log in ``OUT/results``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minirt.eventlog import summary as run_summary
from minirt.eventlog.summary import RESULTS
from minirt.replay.loop import write_events
from minirt.replay.sim import Result
from minirt.replay.stepmodel import StepModel, kinds_of
from minirt.replay.workload import Recorded

COLS = [
    "run",
    "requests",
    "errors",
    "throughput_tok_s",
    *(f"{m}_p{q}_ms" for m in ("ttft", "tpot", "queue", "e2e") for q in (50, 90, 99)),
    "prefix_hit_rate",
    "preemptions",
    "kv_peak_pct",
]
SWEEP_COLS = ["value", "ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "queue_p99_ms"]


def tags_of(records: list[dict[str, Any]]) -> list[str]:
    return sorted({t for r in records for t in r.get("tags", [])})


def _peak(kv: list[tuple[float, float]]) -> float:
    return max((u for _, u in kv), default=0.0) * 100


def rows(rec: Recorded, results: dict[str, Result]) -> list[dict[str, Any]]:
    """Summary rows: the recorded run, each replay, then the same per request tag."""
    out = [
        {
            "run": "recorded",
            **run_summary.summarize(rec.records, rec.wall_s),
            "kv_peak_pct": _peak(rec.kv_timeline),
        }
    ]
    out += [
        {"run": name, **r.summary(), "kv_peak_pct": _peak(r.kv_timeline)}
        for name, r in results.items()
    ]
    for tag in tags_of(rec.records):
        out.append(
            {"run": f"recorded ({tag})", **run_summary.summarize(rec.records, rec.wall_s, tag)}
        )
        out += [{"run": f"{name} ({tag})", **r.summary(tag)} for name, r in results.items()]
    return out


def rel(predicted: float, measured: float) -> float:
    """Relative error of a prediction (0.1 = 10% off)."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return abs(predicted - measured) / abs(measured)


def fidelity(rec: Recorded, res: Result, tag: str | None = None) -> dict[str, float]:
    a = run_summary.summarize(rec.records, rec.wall_s, tag)
    b = res.summary(tag)
    keys = ("ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "queue_p99_ms", "tpot_p50_ms")
    return {k: rel(b[k], a[k]) for k in keys}


def compare_decisions(rec: Recorded, res: Result, first: int = 100) -> dict[str, Any]:
    """The admission decisions about the first ``first`` arrivals, recorded vs replayed."""
    ids = {s.rid for s in rec.requests[:first]}
    a = [d for d in rec.decisions if d[1] in ids]
    b = [d for d in res.decisions() if d[1] in ids]
    out: dict[str, Any] = {"requests": len(ids), "recorded": len(a), "replayed": len(b)}
    out["identical"] = a == b
    out["refusals_recorded"] = sum(d[0] == "refuse" for d in a)
    out["refusals_replayed"] = sum(d[0] == "refuse" for d in b)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            out["first_difference"] = {"index": i, "recorded": list(x), "replayed": list(y)}
            break
    else:
        if len(a) != len(b):
            out["first_difference"] = {"index": min(len(a), len(b)), "length": [len(a), len(b)]}
    return out


def _pct(row: dict[str, Any]) -> dict[str, Any]:
    """A steps-by-kind row with its errors as percentages."""
    return {
        k: f"{v:+.1%}" if k == "bias" else f"{v:.1%}" if k == "rel_err_p50" else v
        for k, v in row.items()
    }


def _run_entry(records: list[dict[str, Any]], kv: list[tuple[float, float]]) -> dict[str, Any]:
    return {"records": records, "kv_timeline": kv}


def plots(out: Path, rec: Recorded, results: dict[str, Result]) -> list[str]:
    """TTFT CDF, throughput and KV use over time: the recorded run and each replay."""
    runs = {"recorded": _run_entry(rec.records, rec.kv_timeline)}
    runs.update({n: _run_entry(r.records, r.kv_timeline) for n, r in results.items()})
    return run_summary.plots(out, runs, None)


def sweep_plot(out: Path, knob: str, points: list[dict[str, Any]]) -> str:
    """p99 TTFT and throughput against the swept knob, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [str(p["value"]) for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [p["ttft_p99_ms"] for p in points], marker="o", color="tab:red", label="TTFT p99")
    ax.set(xlabel=knob, ylabel="TTFT p99 (ms)", title=f"Replay: sweep of {knob}")
    ax2 = ax.twinx()
    tput = [p["throughput_tok_s"] for p in points]
    ax2.plot(xs, tput, marker="s", color="tab:blue", label="throughput")
    ax2.set_ylabel("output tokens/s")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [str(ln.get_label()) for ln in lines], loc="best")
    fig.tight_layout()
    name = "sweep.png"
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def events_dir(out: Path, name: str | None = None) -> Path:
    """The run directory of a replay's event log in report ``out`` (``minirt trace ID --run-dir``
    reads it): ``out/results``, or ``out/results/replays/NAME`` in a report of several replays."""
    raw = Path(out) / RESULTS
    return raw if name is None else raw / "replays" / name


def _fmt_decisions(d: dict[str, Any]) -> str:
    head = (
        f"Admission decisions about the first {d['requests']} requests: "
        f"{d['recorded']} recorded, {d['replayed']} replayed "
        f"({d['refusals_recorded']} / {d['refusals_replayed']} refusals): "
    )
    if d["identical"]:
        return head + "**identical sequence**.\n"
    return head + f"differ, first at {d.get('first_difference')}.\n"


def write(
    out: Path,
    command: str,
    rec: Recorded,
    model: StepModel,
    results: dict[str, Result],
    knobs: dict[str, Any],
    sweep: tuple[str, list[dict[str, Any]]] | None = None,
) -> Path:
    """README.md and plots; report.json and, per replay, its event log under ``results/``."""
    out.mkdir(parents=True, exist_ok=True)
    table_rows = rows(rec, results)
    sections = [
        f"Recorded run: `{rec.source}` ({len(rec.requests)} requests, configuration "
        f"{rec.config.describe()}).\n",
        f"Replayed with: {knobs or 'the recorded configuration'}.\n",
        f"Step-time model ({model.source or 'fitted from this run'}):\n\n```\n{model.summary()}\n```\n",
        "## Recorded vs replayed\n",
        run_summary.table(table_rows, COLS),
    ]
    data: dict[str, Any] = {
        "source": rec.source,
        "config": rec.config.describe(),
        "knobs": knobs,
        "step_model": model.__dict__,
        "notes": rec.notes,
        "rows": table_rows,
        "replays": {},
    }
    kinds = {"recorded": kinds_of(rec.steps, model)}
    for name, res in results.items():
        kinds[name] = kinds_of([e for e in res.events if e.get("event") == "executor.step"])
    sections += [
        "\n## Steps by kind, recorded vs replayed\n",
        run_summary.table(
            [{"run": n, "kind": k, **_pct(v)} for n, by in kinds.items() for k, v in by.items()],
            ["run", "kind", "steps", "p50_ms", "rel_err_p50", "bias"],
        ),
    ]
    sections.append(
        "\n`rel_err_p50`, `bias`: the step-time model on the recorded steps of that kind (its "
        "median relative error; its total over theirs). A replay that plans other steps than a "
        "real run would shows here as another count or median of a kind.\n"
    )
    data["step_kinds"] = kinds
    for name, res in results.items():
        fid = fidelity(rec, res)
        dec = compare_decisions(rec, res)
        sections.append(
            f"\n**{name}**: {len(res.records)} requests, {res.steps} steps simulated in "
            f"{res.sim_s:.2f} s (message latency {res.hop_s * 1e3:.2f} ms, to the executor "
            f"{res.to_executor_s * 1e3:.2f} ms). Relative difference from the recorded run: "
            + ", ".join(f"{k} {v:.1%}" for k, v in fid.items())
            + ".\n"
        )
        sections.append(_fmt_decisions(dec))
        run_dir = events_dir(out, None if len(results) == 1 else name)
        write_events(res.events, run_dir)
        data["replays"][name] = {
            "config": res.config.describe(),
            "fidelity": fid,
            "decisions": dec,
            "sim_s": res.sim_s,
            "steps": res.steps,
            "events": str(run_dir / "events"),
            "records": res.records,
        }
    if rec.notes:
        sections.append("\nNotes: " + "; ".join(rec.notes) + ".\n")
    pngs = plots(out, rec, results)
    if sweep is not None:
        knob, points = sweep
        sections += [f"\n## Sweep of {knob}\n", run_summary.table(points, SWEEP_COLS)]
        pngs.append(sweep_plot(out, knob, points))
        data["sweep"] = {"knob": knob, "points": points}
    some = next(iter(results.values()))
    if some.records:  # the request that waited longest
        rid = max(some.records, key=lambda r: r["queue_s"] or 0.0)["request_id"]
        where = events_dir(out, None if len(results) == 1 else next(iter(results)))
        sections.append(
            f"\nWhy a replayed request waited: `minirt trace {rid} --run-dir {where}`.\n"
        )
    return run_summary.write(out, command, "minirt replay", sections, data, pngs)
