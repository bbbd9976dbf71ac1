"""``minirt bench serve --compare``: the pipeline's prompts through the executor alone (this
process, no actors), vLLM's CPU backend (offline, its own venv and process) and transformers
(static batches of 16, and ``generate_batch``), beside the pipeline's run.

The machines these run on are shared and noisy: one system's throughput moves by 20-30% between
runs minutes apart, vLLM's as much as ours, so a single run's ratio can land anywhere in that
band. ``--rounds N`` runs the three that the goals compare (the pipeline, the executor alone,
vLLM) N times, interleaved (pipeline, executor alone, vLLM; again), so a slow spell falls on one
round of each rather than on one system; the report gives every round's ratios and the medians.
transformers runs once, after the rounds (it is far behind and slow)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXECUTOR = "executor alone (same process, no actors)"
VLLM = "vLLM CPU offline LLM.generate"


def executor_alone(model: Path, prompts: list[list[int]], new: int) -> tuple[float, list, Any]:
    """(tok/s, outputs, dtype) of the prompts through an ``ModelRunner`` in this process, with the
    runtime's default budgets (a smaller one would slow this row down)."""
    import torch

    from actors.runtime.config import ExecutorConfig, SchedulerConfig
    from benchmarks import executor as be
    from gpu.model.loader import load_spec
    from gpu.model_runner import ModelRunner

    torch.set_num_threads(2)
    spec = load_spec(model)
    blocks = sum(-(-(len(p) + new) // 16) for p in prompts) + 64
    x, sc = ExecutorConfig(), SchedulerConfig()
    ex = ModelRunner(
        model,
        num_blocks=blocks,
        chunk_cap=x.chunk_cap,
        step_budget=x.step_budget,
        max_batch_size=sc.max_batch_size,
        threads=2,
    )
    be.run_ours(ex, be.workload(4, 16, 64, spec.vocab_size, 99), 4)  # warm-up
    secs, outs, _ = be.run_ours(ex, prompts, new)
    return sum(len(o) for o in outs) / secs, outs, ex.dtype


def vllm_tok_s(
    model: Path, prompts: list[list[int]], new: int, outs: list, ours: float
) -> tuple[float, str, str]:
    """vLLM's tok/s on the prompts (with its prefix cache, as the pipeline has one), or 0 and
    why it was skipped; and how it ran (tcmalloc preloaded or not: its CPU docs' advice)."""
    from benchmarks.vllm_row import bench_row
    from gpu.model.loader import load_spec

    v = bench_row(
        model,
        prompts,
        new,
        outs,
        ours,
        single_runs=1,  # its time alone is not in this report
        max_model_len=load_spec(model).max_model_len,
        prefix_caching=True,
    )
    if "vllm_tok_s" in v:
        malloc = "tcmalloc" if "tcmalloc" in v["vllm_ld_preload"] else "glibc malloc: no tcmalloc"
        return float(v["vllm_tok_s"]), "", f"{malloc}, OpenMP threads bound"
    return 0.0, str(v["vllm_skipped"])[-300:], ""


def hf_rows(model: Path, prompts: list[list[int]], new: int, n: int, dt: Any) -> list[dict]:
    """transformers' static batched ``generate`` and ``generate_batch`` on the prompts."""
    from transformers import AutoModelForCausalLM

    from benchmarks import executor as be
    from gpu.model.loader import load_spec

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dt).eval()
    pad = int(load_spec(model).hf_config.pad_token_id or 0)
    secs, _, _ = be.run_hf_static(hf, prompts, new, 16, pad)
    rows = [{"run": "transformers generate (static batches of 16)", "throughput_tok_s": n / secs}]
    try:
        secs, _, _ = be.run_hf_cb(hf, prompts, new, pad, 2048)
        rows.append(
            {"run": "transformers generate_batch (continuous)", "throughput_tok_s": n / secs}
        )
    except Exception as e:  # report, do not crash the bench
        rows.append({"run": f"transformers generate_batch failed: {e}", "throughput_tok_s": 0.0})
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def compare(
    model: Path,
    prompts: list[list[int]],
    new: int,
    first_pipeline_tok_s: float,
    pipeline_again: Callable[[int], float],
    rounds: int = 1,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, rounds): each system's median tok/s with the pipeline's median over it, and each
    round's figures. Round 1's pipeline is the report's run (``first_pipeline_tok_s``); rounds
    after it call ``pipeline_again(round)``."""
    per: list[dict[str, Any]] = []
    skipped, how, n, dt = "", "", 0, None
    for k in range(1, max(1, rounds) + 1):
        pipe = first_pipeline_tok_s if k == 1 else pipeline_again(k)
        ex_tok, outs, dt = executor_alone(model, prompts, new)
        n = sum(len(o) for o in outs)
        v, skipped, how = vllm_tok_s(model, prompts, new, outs, ex_tok)
        per.append(
            {
                "round": k,
                "pipeline_tok_s": pipe,
                "executor_alone_tok_s": ex_tok,
                "vllm_tok_s": v,
                "pipeline_over_executor": _ratio(pipe, ex_tok),
                "pipeline_over_vllm": _ratio(pipe, v),
            }
        )

    def med(col: str) -> float:
        return statistics.median(r[col] for r in per)

    pipe = med("pipeline_tok_s")
    rows: list[dict[str, Any]] = [
        {"run": "minirt pipeline", "throughput_tok_s": pipe},
        {"run": EXECUTOR, "throughput_tok_s": med("executor_alone_tok_s")},
        {"run": f"{VLLM} ({how})", "throughput_tok_s": med("vllm_tok_s")}
        if not skipped
        else {"run": f"vLLM skipped: {skipped}", "throughput_tok_s": 0.0},
    ]
    rows += hf_rows(model, prompts, new, n, dt)
    for r in rows:
        r["minirt_pipeline_x"] = _ratio(pipe, r["throughput_tok_s"])
    return rows, per
