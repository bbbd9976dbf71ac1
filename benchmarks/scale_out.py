"""``minirt bench scale-out``: a W2-like workload (system prompts x requests, shuffled, all at
once) through the router to N replicas, against one instance alone, in one run.

It starts ``minirt up --replicas N`` (the router on ``cache_aware``) and a second router on
``round_robin`` in front of the same replicas, then sends three workloads of the same shape
(fresh system prompts each, so no run reuses another's cache): to replica-0 alone, through the
``cache_aware`` router and through the ``round_robin`` one. It reports each one's prefix hit rate
(cached prompt tokens over prompt tokens, from the responses' usage), throughput, TTFT/TPOT and
which replica served each request (from the replicas' events), and with ``--check`` compares
every answer with transformers' greedy continuation. Needs the router (scripts/install-router).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from benchmarks.http_load import HttpRecord, hit_rate, reference_texts, run_jobs, text_w2
from minirt.eventlog import is_request, read_events
from minirt.eventlog import summary as report
from minirt.launch.router import RouterSpec, running_router

COLS = [
    "run",
    "requests",
    "errors",
    "prefix_hit_rate",
    "throughput_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "e2e_p99_ms",
    "served_by",
    "exact",
]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench scale-out", description=__doc__)
    p.add_argument("--model", help="model directory (default: the bench model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--groups", type=int, default=8, help="system prompts")
    p.add_argument("--per-group", type=int, default=8, help="requests per system prompt")
    p.add_argument("--system-tokens", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--check", action="store_true", help="every answer vs transformers (greedy)")
    p.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    p.add_argument("--flags", default="", help="more `minirt up` flags for every replica")
    p.add_argument("--out", help="report directory (default bench-out/scale-out)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that are free now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 40000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def replica_dirs(cluster_dir: Path) -> dict[str, Path]:
    """``{replica name: run dir}`` of a ``minirt up --replicas`` run dir."""
    return {d.name: d for d in sorted(cluster_dir.glob("replica-*")) if d.is_dir()}


def served_by(
    dirs: dict[str, Path], rids: list[str], event: str = "client.completed"
) -> dict[str, str]:
    """``{request id: replica}`` for the requests that ``event`` (by default: completed) names in
    each replica's own event files."""
    out: dict[str, str] = {}
    for name, run in dirs.items():
        ids = {e.get("request_id") for e in read_events(run) if event in ("", e.get("event"))}
        for rid in rids:
            if any(is_request(v, rid) for v in ids):
                out[rid] = name
    return out


def phase(
    name: str, url: str, jobs: list[Any], a: argparse.Namespace, model: str, cluster: Path
) -> dict[str, Any]:
    print(f"{name}: {len(jobs)} requests to {url}", file=sys.stderr)
    records, wall = trio.run(lambda: run_jobs(url, jobs, model=model, max_tokens=a.max_tokens))
    recs = [r.summary() for r in records]
    where = served_by(replica_dirs(cluster), [r.rid for r in records])
    counts: dict[str, int] = {}
    for rid in where.values():
        counts[rid] = counts.get(rid, 0) + 1
    summary = {"run": name, **report.summarize(recs, wall)}
    summary["prefix_hit_rate"] = hit_rate(records)
    summary["served_by"] = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return {"records": recs, "wall_s": wall, "summary": summary, "_records": records}


def plot(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Prefix hit rate and TTFT p50 per run, side by side (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"].replace(", ", "\n").replace(" (", "\n(") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(
        names, [100 * r["prefix_hit_rate"] for r in rows], color=["grey", "tab:green", "tab:red"]
    )
    a1.set(ylabel="prefix hit rate (%)", title="Cached prompt tokens / prompt tokens")
    a2.bar(names, [r["ttft_p50_ms"] for r in rows], color=["grey", "tab:green", "tab:red"])
    a2.set(ylabel="ms", title="TTFT p50")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "hit_rate.png", dpi=100)
    plt.close(fig)
    return ["hit_rate.png"]


def check(model_dir: Path, jobs: list[Any], records: list[HttpRecord], n: int) -> int:
    ref = reference_texts(model_dir, jobs, n)
    return sum(1 for r in records if r.status == 200 and not r.error and r.text == ref[r.rid])


def _about(a: argparse.Namespace, model_dir: Path) -> str:
    import os
    import platform

    return (
        f"\nWorkload: {a.groups} system prompts of {a.system_tokens} tokens x {a.per_group} "
        f"requests, each with its own 16..64-token tail, shuffled, all sent at once; "
        f"{a.max_tokens} new tokens, greedy. Each run gets fresh system prompts. Model "
        f"`{model_dir.name}`; {a.replicas} replicas on {len(os.sched_getaffinity(0))} CPUs "
        f"({platform.machine()}), sglang-router. Prefix hit rate: cached prompt tokens / prompt "
        "tokens, from each response's `usage.prompt_tokens_details.cached_tokens`; `served_by` "
        "from the replicas' events (`X-Request-Id`); `exact`: answers equal to transformers' "
        "greedy continuation (with `--check`).\n"
    )


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    from minirt.bench.serve import default_bench_model
    from minirt.launch.launch import start_runtime

    model_dir = Path(a.model) if a.model else default_bench_model()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    shape = {"groups": a.groups, "per_group": a.per_group, "system": a.system_tokens}
    workloads = {
        "one instance (replica-0 alone)": text_w2(tok, a.seed + 1, tag="single", **shape),
        f"router cache_aware, {a.replicas} replicas": text_w2(tok, a.seed + 2, tag="ca", **shape),
        f"router round_robin, {a.replicas} replicas": text_w2(tok, a.seed + 3, tag="rr", **shape),
    }
    port = a.port or free_ports(a.replicas + 1)
    flags = [
        "--replicas",
        str(a.replicas),
        "--http-port",
        str(port),
        "--replica-base-port",
        str(port + 1),
        "--router-metrics-port",
        str(free_port()),
        *shlex.split(a.flags),
    ]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="minirt-scale-out-") as d:
        cluster = Path(d) / "cluster"
        with start_runtime(model_dir, cluster, *flags, timeout=600) as rt:
            replicas = [f"http://127.0.0.1:{port + 1 + i}" for i in range(a.replicas)]
            rr = RouterSpec(
                replicas, port=free_port(), metrics_port=free_port(), policy="round_robin"
            )
            with running_router(rr, cluster / "logs" / "router-rr.log"):
                urls = [replicas[0], rt.endpoint, rr.url]
                for (name, jobs), url in zip(workloads.items(), urls, strict=True):
                    runs[name] = phase(name, url, jobs, a, str(model_dir), cluster)
    if a.check:
        for name, jobs in workloads.items():
            run = runs[name]
            run["summary"]["exact"] = (
                f"{check(model_dir, jobs, run['_records'], a.max_tokens)}/{len(jobs)}"
            )
    for run in runs.values():
        del run["_records"]
    rows = [r["summary"] for r in runs.values()]
    single, ca, rrun = (r["prefix_hit_rate"] for r in rows)
    verdict = (
        f"cache_aware's hit rate is {ca / single:.0%} of one instance's and "
        f"{ca - rrun:+.1%} (absolute) over round_robin's."
        if single
        else "no prefix hits at all: is the prefix cache on?"
    )
    shown = [{**r, "prefix_hit_rate": f"{r['prefix_hit_rate']:.1%}"} for r in rows]
    sections = ["## Results\n", report.table(shown, COLS), f"\n{verdict}\n", _about(a, model_dir)]
    out = Path(a.out or "bench-out/scale-out")
    command = "minirt bench scale-out " + " ".join(shlex.quote(x) for x in argv)
    data = {"args": vars(a), "runs": runs, "verdict": verdict}
    pngs = plot(out, rows)
    path = report.write(
        out, command, "minirt bench: scale-out (W2-like through the router)", sections, data, pngs
    )
    print("".join(sections))
    print(f"report: {path}")
    print(json.dumps({"single": single, "cache_aware": ca, "round_robin": rrun}))
    return 0
