"""``minirt replay RUN_DIR``: rerun a recorded event log under another policy or budget, without
the model. Reads a run directory (``RUN_DIR/events``) or a ``minirt bench serve`` report
(``--run`` picks the variant), replays its workload through the real scheduler core and KV
manager with a simulated executor on a virtual clock, and writes a report directory with the
replayed event log. ``--fit`` fits the step-time model and stores it with the run;
``--fit-also RUN`` pools another run's steps into that fit (a run of varied batches, so the
per-decode cost is identified); ``--step-model`` replays with another run's fit; ``--sweep KNOB=V1,V2,...`` replays once per
value and plots p99 TTFT and throughput against it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minirt.replay import stepmodel, workload

# the knobs given as flags of their own (sim.KNOBS, the same spelling); the others are swept
KNOB_FLAGS = (
    "policy",
    "max-batch-size",
    "num-blocks",
    "chunk-cap",
    "step-budget",
    "long-prefill-threshold",
    "max-long-prefills",
    "kv-mode",
    "max-wait-s",
    "budget-policy",
    "step-target-ms",
)
# what a recorded run had and a replay can take away (sim.SWITCHES)
SWITCHES = {
    "no-spec": "replay without speculative decoding: one token per decode step, the recorded "
    "drafts not verified",
    "no-kv-disk": "replay without the disk tier: the prefixes the run loaded are computed",
}


def build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir or a bench serve report dir")
    p.add_argument("--run", help="which run of a bench serve report (default: the first)")
    for flag in KNOB_FLAGS:
        p.add_argument(f"--{flag}", help=f"replay with this {flag} instead of the recorded one")
    p.add_argument("--prefill-first", action="store_true", help="replay with prefill first")
    for flag, text in SWITCHES.items():
        p.add_argument(f"--{flag}", action="store_true", help=text)
    p.add_argument(
        "--out",
        help="report directory (default bench-out/replay-TIME); with --fit, where the model goes",
    )
    p.add_argument("--fit", action="store_true", help="fit the step model, store it, and stop")
    p.add_argument(
        "--fit-also",
        action="append",
        default=[],
        metavar="RUN",
        help="with --fit: pool this run's steps too (a run of the same report, or a run dir)",
    )
    p.add_argument("--step-model", help="a stepmodel.json (or a run dir holding one) to use")
    p.add_argument(
        "--sweep",
        metavar="KNOB=V1,V2,...",
        help="replay once per value of a knob (one of the flags above, or prefix-defer-tokens, "
        "decode-first), e.g. max-batch-size=4,8,16,32",
    )
    p.add_argument("--first", type=int, default=100, help="decisions compared for N requests")
    p.add_argument(
        "--executor-latency-s",
        type=float,
        help="latency of messages to the executor (default: calibrated on the recorded run)",
    )


def knobs_from(a: argparse.Namespace) -> dict[str, Any]:
    from minirt.replay import sim

    knobs = {}
    for flag in KNOB_FLAGS:
        value = getattr(a, flag.replace("-", "_"))
        if value is not None:
            knobs[flag] = sim.parse_knob(flag, value)
    if a.prefill_first:
        knobs["decode-first"] = False
    for flag in SWITCHES:
        if getattr(a, flag.replace("-", "_")):
            knobs[flag] = True
    return knobs


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    from minirt.replay import sim

    name, sep, values = text.partition("=")
    if not sep or not values:
        raise ValueError(f"--sweep {text!r}: expected KNOB=V1,V2,... (e.g. max-batch-size=4,8,16)")
    return name, [sim.parse_knob(name, v) for v in values.split(",") if v]


def model_dir(a: argparse.Namespace) -> Path:
    """Where ``--fit`` stores the model: the run dir, or the report's run."""
    from minirt.replay import runlog, workload

    p = Path(a.run_dir)
    raw = workload.raw_dir(p)
    if (raw / "report.json").exists():
        return raw / "runs" / runlog.slug(a.run or workload.first_run(p))
    return p


def also_run(a: argparse.Namespace, name: str) -> workload.Recorded:
    """A run to pool into the fit: a run directory, or a run of the same bench report."""
    from minirt.replay import workload

    p = Path(name)
    raw = workload.raw_dir(p)
    if (raw / "events").is_dir() or (raw / "report.json").exists():
        return workload.load(p)
    return workload.load(a.run_dir, name)


def step_model(a: argparse.Namespace, rec: workload.Recorded) -> stepmodel.StepModel:
    from minirt.replay import stepmodel

    if a.step_model:
        return stepmodel.StepModel.load(a.step_model)
    stored = model_dir(a) / stepmodel.FILENAME
    if stored.exists():
        return stepmodel.StepModel.load(stored)
    return stepmodel.fit(rec.steps, f"fitted from {rec.source}", rec.config.step_costs)


def run(a: argparse.Namespace, argv: list[str]) -> int:
    from minirt.eventlog import summary as run_summary
    from minirt.replay import report, sim, stepmodel, workload

    rec = workload.load(a.run_dir, a.run)
    if a.fit_also and not a.fit:
        raise ValueError("--fit-also pools runs into a fit: use it with --fit")
    if a.fit:
        others = [also_run(a, r) for r in a.fit_also]
        model = stepmodel.fit_runs(
            [rec.steps] + [o.steps for o in others],
            source="fitted from " + " + ".join([rec.source] + [o.source for o in others]),
            seed=rec.config.step_costs,
        )
        print(model.summary())
        for note in model.notes:
            print(f"note: {note}")
        print(f"step model: {model.save(Path(a.out) if a.out else model_dir(a))}")
        return 0
    knobs = knobs_from(a)
    sweep = parse_sweep(a.sweep) if a.sweep else None
    model = step_model(a, rec)
    print(model.summary())
    lat = a.executor_latency_s
    if lat is None:
        lat = sim.calibrate(rec, model)
    print(
        f"message latency: {rec.hop_s * 1e3:.2f} ms, to the executor {lat * 1e3:.2f} ms",
        file=sys.stderr,
    )
    res = sim.replay(rec, model, knobs, lat)
    points = []
    if sweep is not None:
        knob, values = sweep
        for v in values:
            r = sim.replay(rec, model, {**knobs, knob: v}, lat)
            points.append({"value": v, **r.summary()})
            print(f"  {knob}={v}: {r.sim_s:.2f} s", file=sys.stderr)
    out = Path(a.out or f"bench-out/replay-{time.strftime('%Y%m%d-%H%M%S')}")
    command = "minirt replay " + " ".join(shlex.quote(x) for x in argv)
    path = report.write(
        out,
        command,
        rec,
        model,
        {"replay": res},
        knobs,
        (sweep[0], points) if sweep is not None else None,
    )
    print(run_summary.table(report.rows(rec, {"replay": res}), report.COLS))
    dec = report.compare_decisions(rec, res, a.first)
    same = "identical" if dec["identical"] else f"differ: {dec.get('first_difference')}"
    print(f"admission decisions (first {a.first} requests): {same}")
    print(f"replayed {len(res.records)} requests in {res.sim_s:.2f} s; report: {path}")
    print(f"events: minirt trace REQUEST_ID --run-dir {report.events_dir(out)}")
    return 0


def run_checked(a: argparse.Namespace, argv: list[str]) -> int:
    """``run``, with bad input reported as one line naming what is wrong (exit status 2)."""
    try:
        return run(a, argv)
    except (ValueError, OSError) as e:
        print(f"minirt replay: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="minirt replay", description=__doc__)
    build_args(p)
    return run_checked(p.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
