"""``minirt bench scaling``: how decode speed grows with batch size and with context length, for
minirt's executor (in this process) and vLLM's CPU backend (its own venv, when present).

Two sweeps, random token-id prompts, greedy, EOS ignored: decode tok/s at batch sizes 1..256 with
a 256-token context, and time per decode step at contexts 128..4096 with batch 16 (capped by the
model's context length). Both systems are timed the same way: each point runs its prompts twice,
to 1 output token and to ``1 + steps`` tokens; the difference is ``steps`` decode steps of the
whole batch (the prefill cancels; each run twice, the minimum taken; ``nan`` where noise
exceeded the decode time). minirt's steps are also timed one by one, which gives the same
quantity with less noise, and that is what its rows show. Writes README.md and two PNGs into
``--out``, report.json into its ``results/``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from minirt.eventlog import summary as report

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXTS = [128, 256, 512, 1024, 2048, 4096]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench scaling", description=__doc__)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: bench qwen2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--context", type=int, default=256, help="context of the batch sweep")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--context-batch", type=int, default=16, help="batch of the context sweep")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="default bench-out/scaling-TIME")
    return p.parse_args(argv)


def points(a: argparse.Namespace, max_len: int) -> list[tuple[str, int, int]]:
    """(sweep, batch, context) per point; contexts leave room for the decode steps."""
    cap = max_len - a.steps - 2
    pts = [("batch", int(b), min(a.context, cap)) for b in a.batches.split(",")]
    ctxs = sorted({min(int(c), cap) for c in a.contexts.split(",")})
    return pts + [("context", a.context_batch, c) for c in ctxs]


def prompts_for(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(context)] for _ in range(batch)]


def decode_seconds(ex, prompts: list[list[int]], steps: int) -> float:
    """Run ``prompts`` to ``1 + steps`` tokens; the mean time of the steps that decoded the whole
    batch and prefilled nothing, times ``steps`` (requests that finish prefill early decode in
    mixed steps and end early, so fewer than ``steps`` such steps may run)."""
    from messages.common import SamplingParams

    bs, nxt = ex.block_size, 0
    params = SamplingParams(max_tokens=1 + steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        n = -(-(len(p) + steps + 1) // bs)
        ex.add_request(f"s{i}", p, params, list(range(nxt, nxt + n)))
        nxt += n
    total, n = 0.0, 0
    while ex.has_work():
        t = time.perf_counter()
        res = ex.step()
        if res.num_prefill_tokens == 0 and res.num_decode_tokens == len(prompts):
            total, n = total + time.perf_counter() - t, n + 1
    return steps * total / n if n else float("nan")


def run_minirt(a, model: Path, pts, vocab: int) -> list[float]:
    """Seconds of ``steps`` decode steps at each point, for our executor, timed step by step
    (the same quantity as vLLM's difference of two runs, with less noise)."""
    from benchmarks.executor import run_ours, workload
    from gpu.model_runner import ModelRunner

    need = max(b * -(-(c + a.steps + 1) // 16) for _, b, c in pts) + 16
    ex = ModelRunner(
        model, dtype=a.dtype, num_blocks=need, step_budget=8192, max_batch_size=256,
        threads=a.threads,
    )  # fmt: skip
    run_ours(ex, workload(4, 16, 64, vocab, 99), 4)  # warm-up
    return [
        decode_seconds(ex, prompts_for(b, c, vocab, i), a.steps) for i, (_, b, c) in enumerate(pts)
    ]


def run_vllm(a, model: Path, pts, spec) -> list[float] | str:
    """The same for vLLM, or why it was skipped. Its KV space: the largest point's tokens, x1.5,
    in float32, rounded up to GiB."""
    from benchmarks import vllm_row

    vocab, max_len = spec.vocab_size, spec.max_model_len
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    tokens = max(b * (c + a.steps + 1) for _, b, c in pts)
    kv_gib = max(1, -(-int(1.5 * tokens * per_token) // 2**30))
    runs = []
    for i, (_, b, c) in enumerate(pts):
        ps = prompts_for(b, c, vocab, i)
        runs += [(ps, 1), (ps, 1 + a.steps)] * 2  # twice: the minimum of each
    got = vllm_row.run(model, runs, dtype=a.dtype, max_model_len=max_len, kv_gib=kv_gib)
    if isinstance(got, vllm_row.Skipped):
        return got.reason
    t = got.seconds
    diffs = [min(t[4 * i + 1], t[4 * i + 3]) - min(t[4 * i], t[4 * i + 2]) for i in range(len(pts))]
    return [d if d > 0 else float("nan") for d in diffs]  # nan: noise exceeded the decode time


def plot(out: Path, rows: list[dict[str, Any]], systems: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for sweep, x, key, ylabel, name in (
        ("batch", "batch", "tok_s", "decode tokens/s", "decode_vs_batch.png"),
        ("context", "context", "step_ms", "ms per decode step", "step_vs_context.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        pts = [r for r in rows if r["sweep"] == sweep]
        for s in systems:
            ax.plot([r[x] for r in pts], [r[f"{s}_{key}"] for r in pts], marker="o", label=s)
        ax.set(xlabel=x, ylabel=ylabel, xscale="log", title=f"{ylabel} vs {x}")
        ax.set_xscale("log", base=2)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append(name)
    return made


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    torch.set_num_threads(a.threads)
    from gpu.model.loader import load_spec
    from minirt.bench.serve import default_bench_model

    model = a.model or default_bench_model()
    spec = load_spec(model)
    pts = points(a, spec.max_model_len)
    timings = {"minirt": run_minirt(a, model, pts, spec.vocab_size)}
    skipped = None
    if not a.skip_vllm:
        got = run_vllm(a, model, pts, spec)
        if isinstance(got, str):
            skipped = got
        else:
            timings["vllm"] = got
    rows = []
    for i, (sweep, b, c) in enumerate(pts):
        row: dict[str, Any] = {"sweep": sweep, "batch": b, "context": c}
        for s, secs in timings.items():
            row[f"{s}_tok_s"] = b * a.steps / secs[i]
            row[f"{s}_step_ms"] = 1e3 * secs[i] / a.steps
        if "vllm" in timings:
            row["minirt_over_vllm"] = row["minirt_tok_s"] / row["vllm_tok_s"]
        rows.append(row)
    cols = ["batch", "context"] + [f"{s}_{k}" for s in timings for k in ("tok_s", "step_ms")]
    cols += ["minirt_over_vllm"] if "vllm" in timings else []
    sections = [
        f"Model `{model}`, {a.dtype}, {a.threads} threads, {a.steps} decode steps of the whole "
        "batch per point (minirt: the executor alone, steps timed one by one; vLLM: offline "
        "`LLM.generate`, time to 1 + steps tokens minus time to 1 token).\n",
        f"\nvLLM skipped: {skipped}\n" if skipped else "",
        f"\n## Decode tok/s vs batch size (context {pts[0][2]})\n",
        report.table([r for r in rows if r["sweep"] == "batch"], cols),
        f"\n## Time per decode step vs context (batch {a.context_batch})\n",
        report.table([r for r in rows if r["sweep"] == "context"], cols),
    ]
    out = a.out or Path(f"bench-out/scaling-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(out, rows, list(timings))
    command = "minirt bench scaling " + " ".join(shlex.quote(x) for x in argv)
    data = {"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows, "vllm_skipped": skipped}
    path = report.write(out, command, "minirt bench: decode scaling", sections, data, pngs)
    print("".join(sections))
    print(f"report: {path}")
    return 0
