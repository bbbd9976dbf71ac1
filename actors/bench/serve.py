"""``minirt bench serve``: a workload against a runtime, a report directory out.

Against a running runtime (``--run-dir``, default .minirt) or one it starts per variant
(``--start --model DIR --variant NAME='--flag value ...'``). ``--compare`` adds, in the same run,
the executor alone and transformers' static batched generate and continuous batching on the same
prompts (workloads whose requests all arrive at t=0). ``--sweep`` runs Poisson arrivals at each
rate. Writes report.json, README.md (Markdown summary) and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from actors.bench.driver import drive
from actors.bench.workloads import WORKLOADS, Job, poisson
from actors.eventlog import read_events
from actors.eventlog import summary as report
from actors.replay.runlog import keep_run, slug

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
    p.add_argument("--workload", choices=[*WORKLOADS, "poisson"], default="w1")
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
        "--requests", type=int, help="override the workload's request count (w1, poisson)"
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the executor alone and transformers (static, continuous) here",
    )
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--out", help="report directory (default bench-out/WORKLOAD-TIME)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def default_bench_model() -> Path:
    from actors.bench.executor import DEFAULT_MODEL
    from gpu.make_model import make_model

    if not (DEFAULT_MODEL / "config.json").exists():
        make_model("qwen2", "bench", DEFAULT_MODEL)
    return DEFAULT_MODEL


def make_jobs(
    a: argparse.Namespace, vocab: int, rate: float | None = None, context: int = 4096
) -> list[Job]:
    if a.workload == "poisson" or rate is not None:
        return poisson(vocab, rate or a.rate, a.seed, n=a.requests or 64)
    if a.workload == "w1" and a.requests:
        return WORKLOADS["w1"](vocab, a.seed, n=a.requests)
    if a.workload == "mix":  # long prompts of 2,000 tokens, or what the model's context allows
        return WORKLOADS["mix"](vocab, a.seed, long_len=min(2000, context - 64))
    return WORKLOADS[a.workload](vocab, a.seed)


@contextlib.contextmanager
def runtime(a: argparse.Namespace, flags: str) -> Iterator[tuple[str, Path]]:
    """(endpoint, run dir) of the runtime to drive: started here with ``flags`` or the running one."""
    if not a.start:
        run = Path(a.run_dir).absolute()
        yield f"ipc://{run / 'sock' / 'client'}", run
        return
    from actors.launch.launch import start_runtime

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


def run_once(a: argparse.Namespace, name: str, flags: str, jobs: list[Job]) -> dict[str, Any]:
    with runtime(a, flags) as (endpoint, run_dir):
        print(f"{name}: {len(jobs)} requests", file=sys.stderr)
        t_start = time.time()
        records, wall = trio.run(drive, endpoint, jobs, a.concurrency, progress_printer(len(jobs)))
        t_end = time.time()
        events = read_events(run_dir)
        if a.out:  # keep the run's events: `minirt replay OUT --run NAME` replays it
            keep_run(events, t_start - 1.0, t_end + 1.0, Path(a.out) / "runs" / slug(name))
    recs = [r.summary() for r in records]
    run = {
        "name": name,
        "flags": flags,
        "records": recs,
        "wall_s": wall,
        "summary": {"run": name, **report.summarize(recs, wall)},
        "kv_timeline": report.kv_timeline(events, t_start, t_end),
        "control": report.control_share(events, t_start, t_end),
    }
    for tag in sorted({t for r in recs for t in r["tags"]}):
        run[f"summary_{tag}"] = {"run": f"{name} ({tag})", **report.summarize(recs, wall, tag)}
    return run


def compare_rows(
    a: argparse.Namespace, jobs: list[Job], pipeline_tok_s: float
) -> list[dict[str, Any]]:
    """The same prompts through the executor alone and transformers, in this process."""
    import torch

    from actors.bench import executor as be
    from gpu.executor import Executor
    from gpu.loader import load_spec

    torch.set_num_threads(2)
    model = Path(a.model) if a.model else default_bench_model()
    spec = load_spec(model)
    prompts, new = [j.prompt for j in jobs], jobs[0].max_tokens
    blocks = sum(-(-(len(p) + new) // 16) for p in prompts) + 64
    from actors.runtime.config import ExecutorConfig, SchedulerConfig

    # the budgets the runtime runs with by default (a smaller one would slow this row down)
    x, sc = ExecutorConfig(), SchedulerConfig()
    ex = Executor(
        model,
        num_blocks=blocks,
        chunk_cap=x.chunk_cap,
        step_budget=x.step_budget,
        max_batch_size=sc.max_batch_size,
        threads=2,
    )
    be.run_ours(ex, be.workload(4, 16, 64, spec.vocab_size, 99), 4)  # warm-up
    secs, outs, _ = be.run_ours(ex, prompts, new)
    n = sum(len(o) for o in outs)
    rows: list[dict[str, Any]] = [
        {"run": "executor alone (same process, no actors)", "throughput_tok_s": n / secs}
    ]
    dt = ex.dtype
    del ex
    from actors.bench.vllm_row import bench_row  # vLLM CPU offline, its own venv and process

    v = bench_row(  # with its prefix cache, as the pipeline has one (W2 shares prefixes)
        model,
        prompts,
        new,
        outs,
        n / secs,
        single_runs=1,  # its time alone is not in this report
        max_model_len=spec.max_model_len,
        prefix_caching=True,
    )
    rows.append(
        {"run": "vLLM CPU offline LLM.generate", "throughput_tok_s": v["vllm_tok_s"]}
        if "vllm_tok_s" in v
        else {"run": f"vLLM skipped: {v['vllm_skipped'][-300:]}", "throughput_tok_s": 0.0}
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dt).eval()
    pad = int(spec.hf_config.pad_token_id or 0)
    secs, _, outs = be.run_hf_static(hf, prompts, new, 16, pad)
    rows.append(
        {"run": "transformers generate (static batches of 16)", "throughput_tok_s": n / secs}
    )
    try:
        secs, _, outs = be.run_hf_cb(hf, prompts, new, pad, 2048)
        rows.append(
            {"run": "transformers generate_batch (continuous)", "throughput_tok_s": n / secs}
        )
    except Exception as e:  # report, do not crash the bench
        rows.append({"run": f"transformers generate_batch failed: {e}", "throughput_tok_s": 0.0})
    for r in rows:
        r["minirt_pipeline_x"] = (
            pipeline_tok_s / r["throughput_tok_s"] if r["throughput_tok_s"] else 0.0
        )
    return rows


def main(argv: list[str]) -> int:
    # The in-process comparisons run on this main thread with OpenMP's default wait policy,
    # as the executor actor's steps do (gpu/main_thread.py).
    a = _args(list(argv))
    a.out = a.out or f"bench-out/{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    vocab, context = 32000, 4096
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
        jobs = make_jobs(a, vocab, context=context)
        for name, flags in variants:
            runs[name] = run_once(a, name, flags, [Job(**vars(j)) for j in jobs])
    rows = [r["summary"] for r in runs.values()]
    rows += [r[k] for r in runs.values() for k in sorted(r) if k.startswith("summary_")]
    sections = ["## Results\n", report.table(rows, SUMMARY_COLS)]
    ctl = [{"run": n, **r["control"]} for n, r in runs.items()]
    sections += [
        "\n## Time outside the forward (executor step events)\n",
        report.table(ctl, ["run", "steps", "forward_s", "step_s", "control_s", "control_share"]),
    ]
    data: dict[str, Any] = {"args": vars(a), "runs": runs, "sweep": sweep}
    if a.compare:
        first = next(iter(runs.values()))
        cmp_rows = compare_rows(
            a, make_jobs(a, vocab, context=context), first["summary"]["throughput_tok_s"]
        )
        cmp_rows.insert(
            0,
            {
                "run": f"minirt pipeline ({first['name']})",
                "throughput_tok_s": first["summary"]["throughput_tok_s"],
                "minirt_pipeline_x": 1.0,
            },
        )
        data["compare"] = cmp_rows
        sections += [
            "\n## Same workload, same run (output tokens/s)\n",
            report.table(cmp_rows, ["run", "throughput_tok_s", "minirt_pipeline_x"]),
        ]
    out = Path(a.out or f"bench-out/{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    pngs = report.plots(out, runs, sweep or None)
    command = "minirt bench serve " + " ".join(shlex.quote(x) for x in argv)
    path = report.write(out, command, f"minirt bench: {a.workload}", sections, data, pngs)
    print("".join(sections))
    print(f"report: {path}")
    return 0
