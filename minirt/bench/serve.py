"""``minirt bench serve``: a workload against a runtime, a report directory out.

Against a running runtime (``--run-dir``, default .minirt) or one it starts per variant
(``--start --model DIR --variant NAME='--flag value ...'``). ``--compare`` adds, in the same run,
the executor alone, vLLM's CPU backend and transformers' static batched generate and continuous
batching on the same prompts (workloads whose requests all arrive at t=0; benchmarks/compare.py),
``--rounds N`` the pipeline, the executor alone and vLLM N times interleaved. ``--sweep`` runs Poisson arrivals at each
rate. Writes README.md (Markdown summary) and PNG plots into ``--out``, and its raw data into
``--out``'s ``results/``: report.json and each run's events (``results/runs/NAME/events``).

``docs-qa`` and ``code-edit`` are real-text workloads (minirt/bench/workloads.py): their prompts
are rendered by the model's chat template and tokenizer, so they need ``--model`` (or ``--start``,
which defaults to the bench model). The SmolLM2 comparison with vLLM, for example::

    minirt bench serve --start --model ~/.cache/minirt/models/SmolLM2-135M-Instruct \
        --workload docs-qa --compare --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from minirt.bench.driver import drive
from minirt.bench.workloads import REAL_WORKLOADS, WORKLOADS, Job, load_tokenizer, poisson
from minirt.eventlog import read_events
from minirt.eventlog import summary as report
from minirt.eventlog.summary import RESULTS
from minirt.launch.launch import actor_pids
from minirt.replay.runlog import keep_run, slug

# the benchmarks' random-weight model (``minirt make-model qwen2 bench``), built on first use
DEFAULT_MODEL = Path.home() / ".cache" / "minirt" / "models" / "bench-qwen2"
# one row per --compare round (benchmarks/compare.py fills them)
ROUND_COLS = [
    "round",
    "pipeline_tok_s",
    "executor_alone_tok_s",
    "vllm_tok_s",
    "pipeline_over_executor",
    "pipeline_over_vllm",
]

SUMMARY_COLS = [
    "run",
    "requests",
    "errors",
    "throughput_tok_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p99_ms",
    "queue_p99_ms",
    "prefix_hit_rate",
    "preemptions",
]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench serve", description=__doc__)
    p.add_argument(
        "--workload",
        choices=[*WORKLOADS, *REAL_WORKLOADS, "poisson"],
        default="w1",
        help="docs-qa and code-edit: real text through the model's chat template (need --model "
        "or --start)",
    )
    p.add_argument("--run-dir", default=".minirt", help="a running runtime's run dir")
    p.add_argument(
        "--start", action="store_true", help="start a runtime (per variant) and stop it after"
    )
    p.add_argument("--model", help="with --start: model dir (default: the bench model)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="with --start: a runtime config to compare, e.g. sjf='--policy sjf'",
    )
    p.add_argument("--rate", type=float, default=4.0, help="poisson: requests per second")
    p.add_argument("--sweep", help="poisson: comma-separated rates")
    p.add_argument(
        "--requests",
        type=int,
        help="override the workload's request count (w1, poisson, docs-qa, code-edit)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the executor alone and transformers (static, continuous) here; those "
        "run greedy: add --temperature 0 for a like-for-like pipeline row",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --compare: run the pipeline, the executor alone and vLLM this many times, "
        "interleaved; the report gives each round and the medians",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="every request samples at this temperature (seeded per request); the default 1.0 "
        "is what users' clients get (OpenAI's default; vllm bench serve sends none); 0: greedy",
    )
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--out", help="report directory (default bench-out/WORKLOAD-TIME)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def default_bench_model() -> Path:
    from gpu.model.make_model import make_model

    if not (DEFAULT_MODEL / "config.json").exists():
        make_model("qwen2", "bench", DEFAULT_MODEL)
    return DEFAULT_MODEL


def make_jobs(
    a: argparse.Namespace,
    vocab: int,
    rate: float | None = None,
    context: int = 4096,
    model: Path | None = None,
) -> list[Job]:
    if a.workload == "poisson" or rate is not None:
        return poisson(vocab, rate or a.rate, a.seed, n=a.requests or 64)
    if a.workload in REAL_WORKLOADS:
        if model is None:
            raise SystemExit(f"--workload {a.workload} needs --model DIR (or --start)")
        return real_jobs(a.workload, load_tokenizer(model), a.seed, a.requests, context)
    if a.workload == "w1" and a.requests:
        return WORKLOADS["w1"](vocab, a.seed, n=a.requests)
    if a.workload == "mix":  # long prompts of 2,000 tokens, or what the model's context allows
        return WORKLOADS["mix"](vocab, a.seed, long_len=min(2000, context - 64))
    return WORKLOADS[a.workload](vocab, a.seed)


def real_jobs(
    name: str, tok: Any, seed: int = 0, requests: int | None = None, context: int = 4096
) -> list[Job]:
    """A real-text workload's jobs, its lengths cut where the model's ``context`` needs it
    (the tests' tiny model has 1,024 positions): docs-qa's system prompt 600..1,000 tokens and
    code-edit's code 150..600, or less."""
    from minirt.bench import workloads as w

    if name == "docs-qa":
        new = 64
        hi = min(w.DOCS_QA_SYSTEM[1], context - new - 128)  # room for the question
        lo = min(w.DOCS_QA_SYSTEM[0], hi - 200)
        groups, per = 8, 8
        if requests:
            groups = max(1, -(-requests // 8))
            per = -(-requests // groups)
        jobs = w.docs_qa(tok, seed, groups, per, (lo, hi), new)
        return jobs[:requests] if requests else jobs
    new = 128
    hi = min(w.CODE_EDIT_CODE[1], context - new - 256)  # room for the instruction
    lo = min(w.CODE_EDIT_CODE[0], hi // 2)
    return w.code_edit(tok, seed, requests or 64, (lo, hi), new)


@contextlib.contextmanager
def runtime(a: argparse.Namespace, flags: str) -> Iterator[tuple[str, Path]]:
    """(endpoint, run dir) of the runtime to drive: started here with ``flags`` or the running one."""
    if not a.start:
        run = Path(a.run_dir).absolute()
        yield f"ipc://{run / 'sock' / 'client'}", run
        return
    from minirt.launch.launch import start_runtime

    model = Path(a.model) if a.model else default_bench_model()
    with (
        tempfile.TemporaryDirectory(prefix="minirt-bench-") as d,
        start_runtime(model, Path(d) / "rt", *shlex.split(flags), timeout=300) as rt,
    ):
        yield rt.endpoint, rt.run_dir


def progress_printer(total: int) -> Any:
    done = [0]

    def tick(_: Any) -> None:
        done[0] += 1
        bar = int(30 * done[0] / total)
        sys.stderr.write(f"\r  [{'#' * bar}{'.' * (30 - bar)}] {done[0]}/{total}")
        if done[0] == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return tick


CPU_COLS = ["run", "executor", "tokenizer", "scheduler", "kv_manager", "client", "others_pct"]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each actor and of this process (the client)."""
    return {n: process_cpu_s(p) for n, p in pids.items()} | {"client": time.process_time()}


def cpu_during(pids: dict[str, int], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds each actor and the client took since ``before`` (``cpu_now``), and the
    percentage of all of it that was not the executor's: what competes with its threads for the
    cores (the pipeline's cost against the executor alone)."""
    now = cpu_now(pids)
    used = {n: round(now[n] - before.get(n, 0.0), 2) for n in now}
    total = sum(used.values())
    others = 100 * (1 - used.get("executor", 0.0) / total) if total else 0.0
    return used | {"others_pct": round(others, 1)}


def run_once(
    a: argparse.Namespace, name: str, flags: str, jobs: list[Job], keep: bool = True
) -> dict[str, Any]:
    with runtime(a, flags) as (endpoint, run_dir):
        print(f"{name}: {len(jobs)} requests", file=sys.stderr)
        pids = actor_pids(run_dir)
        cpu0 = cpu_now(pids)
        t_start = time.time()
        records, wall = trio.run(
            drive, endpoint, jobs, a.concurrency, progress_printer(len(jobs)), None, sampling(a)
        )
        t_end = time.time()
        cpu = cpu_during(pids, cpu0)
        events = read_events(run_dir)
        if a.out and keep:  # keep the run's events: `minirt replay OUT --run NAME` replays it
            dest = Path(a.out) / RESULTS / "runs" / slug(name)
            keep_run(events, t_start - 1.0, t_end + 1.0, dest)
    recs = [r.summary() for r in records]
    run = {
        "name": name,
        "flags": flags,
        "records": recs,
        "wall_s": wall,
        "summary": {"run": name, **report.summarize(recs, wall)},
        "kv_timeline": report.kv_timeline(events, t_start, t_end),
        "control": report.control_share(events, t_start, t_end),
        "cpu_s": cpu,
    }
    for tag in sorted({t for r in recs for t in r["tags"]}):
        run[f"summary_{tag}"] = {"run": f"{name} ({tag})", **report.summarize(recs, wall, tag)}
    return run


def sampling(a: argparse.Namespace) -> dict[str, Any]:
    """The requests' sampling fields (``--temperature``)."""
    return {"temperature": a.temperature}


def _compare(
    a: argparse.Namespace,
    runs: dict[str, dict[str, Any]],
    flags: str,
    jobs: list[Job],
    data: dict[str, Any],
) -> list[str]:
    """The ``--compare`` rows (benchmarks.compare), over ``--rounds`` interleaved rounds."""
    from minirt.bench import developer_benchmark

    compare = developer_benchmark("compare").compare

    first = next(iter(runs.values()))

    def again(k: int) -> float:
        run = run_once(
            a, f"{first['name']} round {k}", flags, [Job(**vars(j)) for j in jobs], False
        )
        return float(run["summary"]["throughput_tok_s"])

    model = Path(a.model) if a.model else default_bench_model()
    rows, per = compare(
        model,
        [j.prompt for j in jobs],
        jobs[0].max_tokens,
        first["summary"]["throughput_tok_s"],
        again,
        a.rounds,
    )
    rows[0]["run"] = f"minirt pipeline ({first['name']})"
    data["compare"], data["compare_rounds"] = rows, per
    title = "same run" if a.rounds <= 1 else f"medians of {a.rounds} interleaved rounds"
    return compare_sections(rows, per, title)


def compare_sections(rows: list[dict], per: list[dict], title: str) -> list[str]:
    """The Markdown of the ``--compare`` rows and rounds (ratios to two decimals)."""

    def two(r: dict) -> dict:
        return {k: f"{v:.2f}" if k.endswith(("_x", "_over_executor", "_over_vllm")) else v
                for k, v in r.items()}  # fmt: skip

    out = [
        f"\n## Same workload, {title} (output tokens/s)\n",
        report.table([two(r) for r in rows], ["run", "throughput_tok_s", "minirt_pipeline_x"]),
    ]
    if len(per) > 1:
        # each column's median: for the ratios, the median of the rounds' own (paired) ratios,
        # which a slow spell in one system's round moves less than a ratio of the medians above
        med = {"round": "median"} | {
            c: statistics.median(r[c] for r in per) for c in ROUND_COLS[1:]
        }
        out += [
            "\n### Each round (pipeline, then the executor alone, then vLLM)\n",
            report.table([two(r) for r in [*per, med]], ROUND_COLS),
        ]
    return out


def main(argv: list[str]) -> int:
    # The in-process comparisons run on this main thread with OpenMP's default wait policy,
    # as the executor actor's steps do (gpu/main_thread.py).
    a = _args(list(argv))
    a.out = a.out or f"bench-out/{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    vocab, context = 32000, 4096
    model: Path | None = None
    if a.model or a.start:
        import json as _json

        model = Path(a.model) if a.model else default_bench_model()
        mcfg = _json.loads((model / "config.json").read_text())
        vocab, context = int(mcfg["vocab_size"]), int(mcfg.get("max_position_embeddings", 4096))
    variants = [v.split("=", 1) for v in a.variant] or [["minirt", ""]]
    if a.variant and not a.start:
        print("--variant needs --start (each variant is its own runtime)", file=sys.stderr)
        return 2
    runs: dict[str, dict[str, Any]] = {}
    sweep: list[dict[str, Any]] = []
    if a.sweep:
        for rate in [float(r) for r in a.sweep.split(",")]:
            run = run_once(a, f"rate {rate:g}/s", variants[0][1], make_jobs(a, vocab, rate))
            runs[run["name"]] = run
            sweep.append({"rate": rate, **run["summary"]})
    else:
        jobs = make_jobs(a, vocab, context=context, model=model)
        for name, flags in variants:
            runs[name] = run_once(a, name, flags, [Job(**vars(j)) for j in jobs])
    rows = [r["summary"] for r in runs.values()]
    rows += [r[k] for r in runs.values() for k in sorted(r) if k.startswith("summary_")]
    how = f"temperature {a.temperature:g}" if a.temperature else "greedy (--temperature 0)"
    sections = [
        f"Sampling: {how}, EOS ignored.\n",
        "## Results\n",
        report.table(rows, SUMMARY_COLS),
    ]
    ctl = [{"run": n, **r["control"]} for n, r in runs.items()]
    sections += [
        "\n## Time outside the forward (executor step events)\n",
        report.table(
            ctl,
            ["run", "steps", "forward_s", "step_s", "control_s", "control_share"]
            + (["spec_drafted", "spec_accepted"] if any(c["spec_drafted"] for c in ctl) else []),
        ),
        "\n## CPU seconds during the run, per process (the client is this benchmark's driver)\n",
        report.table(
            [{"run": n} | {k: f"{v:g}" for k, v in r["cpu_s"].items()} for n, r in runs.items()],
            CPU_COLS,
        ),
    ]
    data: dict[str, Any] = {"args": vars(a), "runs": runs, "sweep": sweep}
    if a.compare:
        jobs = make_jobs(a, vocab, context=context, model=model)
        sections += _compare(a, runs, variants[0][1], jobs, data)
    out = Path(a.out or f"bench-out/{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    pngs = report.plots(out, runs, sweep or None)
    command = "minirt bench serve " + " ".join(shlex.quote(x) for x in argv)
    path = report.write(out, command, f"minirt bench: {a.workload}", sections, data, pngs)
    print("".join(sections))
    print(f"report: {path}")
    return 0
