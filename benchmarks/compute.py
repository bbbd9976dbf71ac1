"""The compute limit of a workload: its matmul FLOPs at the GEMM rate of the path the executor
actually runs (oneDNN with prepacked weights on CPU in float32 or bfloat16, else ``F.linear``),
and the profile of where a run's time goes."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def _probe(executor):
    """The native model's first gate/up linear (a sparse layer's first expert's); the
    transformers path's widest packed linear short of its head (gpu/model/generic.py); None
    where it packs none."""
    model = executor.model
    if hasattr(model, "layers"):
        first = model.layers[0]
        return first.gate_up if first.experts is None else first.experts.gate_up[0]
    body = [x for x in model.linears if x.out_features != model.spec.vocab_size]
    return max(body, key=lambda x: x.in_features * x.out_features, default=None)


def gemm_path(executor) -> str:
    """The linears' kernel, as reports name it, e.g. ``oneDNN packed bfloat16``."""
    lin = _probe(executor)
    if lin is None:
        return f"F.linear {str(executor.dtype).removeprefix('torch.')}"
    dt = str(lin.dtype).removeprefix("torch.")
    return f"oneDNN packed {dt}" if lin.packed is not None else f"F.linear {dt}"


def gemm_rate(executor, rows: int = 256, reps: int = 50) -> float:
    """Best FLOP/s over ``reps`` calls of one of the executor's own linears (gate/up, the
    largest per layer) at ``rows`` input rows: the kernel and packing the forward uses."""
    lin = _probe(executor)
    if lin is None:  # transformers' own nn.Linear modules: not timed here
        return float("nan")
    best = linear_seconds(lin, rows, reps, executor.device)
    return 2 * rows * lin.in_features * lin.out_features / best


def linear_seconds(lin, rows: int, reps: int, dev: torch.device) -> float:
    """Best seconds of ``reps`` calls of the linear ``lin`` on ``rows`` random rows on ``dev``,
    after one untimed call (its kernel built)."""
    x = torch.randn(rows, lin.in_features, device=dev, dtype=lin.dtype)
    best = float("inf")
    with torch.inference_mode():
        lin(x)
        for _ in range(reps):
            t = time.perf_counter()
            lin(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return best


def workload_flops(spec, prompts: list[list[int]], new_tokens: int) -> float:
    """Matmul FLOPs the workload needs: linears for every computed token, attention scores and
    values over each token's context, the LM head once per output token."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    per_tok = 2 * (h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size) * spec.num_layers
    total = 0.0
    for p in prompts:
        n = len(p) + new_tokens - 1  # tokens that go through the model
        total += n * per_tok
        total += 4 * q * spec.num_layers * n * (n + 1) / 2  # QK^T and PV over the causal context
        total += 2 * h * spec.vocab_size * new_tokens
    return total


def write_profile(prof, path: Path, title: str) -> None:
    """torch.profiler's op table (self CPU time, top 30) of a whole run, as a text file."""
    avg = prof.key_averages()
    table = avg.table(sort_by="self_cpu_time_total", row_limit=30)
    if any(getattr(e, "self_device_time_total", 0) for e in avg):  # the GPU's side too
        table += "\n\n" + avg.table(sort_by="self_device_time_total", row_limit=30)
    path.write_text(f"{title}\n\n{table}\n")
