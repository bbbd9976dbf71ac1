"""Turn bench records into numbers, a Markdown summary, a JSON file and PNG plots: a report
directory (``write``: README.md and the plots in it, report.json in its ``results/``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gpu import cpu_name

# A report directory holds README.md (the report, the command at its top) and the pictures it
# shows; its results/ folder the raw data (report.json, event logs, raw sub-runs). The layout of
# docs/benchmarks, which every tool that writes a report directory follows.
RESULTS = "results"


def results_dir(out: Path) -> Path:
    """``out/results``, made if missing: where a report directory keeps its raw data."""
    path = Path(out) / RESULTS
    path.mkdir(parents=True, exist_ok=True)
    return path


def pct(values: list[float], q: float) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))
    return v[k]


def summarize(
    records: list[dict[str, Any]], wall_s: float, tag: str | None = None
) -> dict[str, Any]:
    rs = [r for r in records if tag is None or tag in r["tags"]]
    ok = [r for r in rs if not r["error"]]
    out_tokens = sum(r["completion_tokens"] for r in rs)
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    s: dict[str, Any] = {
        "requests": len(rs),
        "errors": len(rs) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "throughput_tok_s": out_tokens / wall_s if wall_s else 0.0,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "preemptions": sum(r["preemptions"] for r in ok),
    }
    for key in ("ttft_s", "tpot_s", "queue_s", "e2e_s"):
        vals = [r[key] for r in ok if r[key] is not None]
        for q in (50, 90, 99):
            s[f"{key[:-2]}_p{q}_ms"] = (pct(vals, q) or 0.0) * 1000
    itl = [x for r in ok for x in r["itl_s"]]
    for q in (50, 90, 99):
        s[f"itl_p{q}_ms"] = (pct(itl, q) or 0.0) * 1000
    return s


def kv_timeline(events: list[dict[str, Any]], t0: float, t1: float) -> list[tuple[float, float]]:
    """(seconds since start, fraction of blocks not free) from the KV manager's events."""
    cfg = [e for e in events if e.get("event") == "kv.config"]
    if not cfg:
        return []
    total = cfg[-1]["num_blocks"]
    return [
        (e["ts"] - t0, 1 - e["free"] / total)
        for e in events
        if e.get("actor") == "kv_manager"
        and "free" in e
        and t0 <= e.get("ts", 0) <= t1
        and e.get("event") in ("kv.allocated", "kv.released", "kv.extended", "kv.reset")
    ]


def control_share(events: list[dict[str, Any]], t0: float, t1: float) -> dict[str, float]:
    steps = [e for e in events if e.get("event") == "executor.step" and t0 <= e.get("ts", 0) <= t1]
    control = sum(e.get("control_s", 0.0) for e in steps)
    step = sum(e.get("step_s", 0.0) for e in steps)
    forward = sum(e.get("forward_s", 0.0) for e in steps)
    return {
        "steps": len(steps),
        "control_s": control,
        "step_s": step,
        "forward_s": forward,
        "control_share": control / (control + step) if step else 0.0,
        # speculative decoding (zero without): drafts verified and accepted
        "spec_drafted": sum(e.get("spec_draft_tokens", 0) for e in steps),
        "spec_accepted": sum(e.get("spec_accepted", 0) for e in steps),
    }


def _fmt(v: Any) -> str:
    return f"{v:,.1f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join(
        "| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |\n" for r in rows
    )


def plots(
    out: Path, runs: dict[str, dict[str, Any]], sweep: list[dict[str, Any]] | None
) -> list[str]:
    """TTFT CDF per run, throughput and KV utilization over time, latency vs rate. PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        v = sorted(r["ttft_s"] * 1000 for r in run["records"] if r["ttft_s"] is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=100)
    plt.close(fig)
    made.append("ttft_cdf.png")

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, run in runs.items():
        times = sorted(t for r in run["records"] for t in r["token_times_s"])
        if times:
            width = max(0.25, times[-1] / 40)
            bins = int(times[-1] / width) + 1
            counts = [0] * bins
            for t in times:
                counts[int(t / width)] += 1
            a1.plot([i * width for i in range(bins)], [c / width for c in counts], label=name)
        kv = run.get("kv_timeline") or []
        if kv:
            a2.step([t for t, _ in kv], [u * 100 for _, u in kv], where="post", label=name)
    a1.set(ylabel="output tokens/s", title="Throughput and KV utilization over time")
    a2.set(xlabel="seconds", ylabel="KV blocks used (%)")
    a1.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_kv.png", dpi=100)
    plt.close(fig)
    made.append("throughput_kv.png")

    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [s["rate"] for s in sweep]
        for key, label in (
            ("ttft_p50_ms", "TTFT p50"),
            ("ttft_p99_ms", "TTFT p99"),
            ("tpot_p50_ms", "TPOT p50"),
            ("e2e_p50_ms", "e2e p50"),
        ):
            ax.plot(rates, [s[key] for s in sweep], marker="o", label=label)
        ax.set(
            xlabel="request rate (req/s)",
            ylabel="ms",
            yscale="log",
            title="Latency vs request rate",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "latency_vs_rate.png", dpi=100)
        plt.close(fig)
        made.append("latency_vs_rate.png")
    return made


def write(
    out: Path, command: str, title: str, sections: list[str], data: dict[str, Any], pngs: list[str]
) -> Path:
    (results_dir(out) / "report.json").write_text(json.dumps(data, indent=1, default=str))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"Machine: {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs; written {when}.\n"
    md = [f"# {title}\n", f"Regenerate with:\n\n```sh\n{command}\n```\n", machine, *sections]
    md += [f"![{p}]({p})\n" for p in pngs]
    path = out / "README.md"
    path.write_text("\n".join(md))
    return path
