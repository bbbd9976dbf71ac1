"""The W1 executor-alone profile of any checkout of minirt, for before/after op tables.

``scripts/profile-tree TREE OUT [TITLE]`` runs W1 (64 requests, prompts 32..256, 64 new tokens,
bench model, float32, 2 threads, step budget 8192) through TREE's own ``ModelRunner`` and
``run_ours`` (e.g. a ``git worktree`` of an older commit), once timed and once under
torch.profiler, and writes the op table (self CPU time, top 30) to OUT with both tok/s and a hash
of the output tokens (equal hashes: identical outputs). Run as a file, not a module: TREE goes
first on ``sys.path``, so every import below is TREE's.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def main(tree: str, out: str, title: str) -> None:
    sys.path.insert(0, str(Path(tree).resolve()))
    import torch

    try:
        from benchmarks.executor import DEFAULT_MODEL, run_ours, workload
    except ImportError:  # a tree from before the benchmarks left the package
        from minirt.bench.executor import DEFAULT_MODEL, run_ours, workload  # type: ignore
    from gpu.model.loader import load_spec
    from gpu.model_runner import ModelRunner

    torch.set_num_threads(2)
    spec = load_spec(DEFAULT_MODEL)
    prompts = workload(64, 32, 256, spec.vocab_size, 0)
    blocks = sum(-(-(len(p) + 64) // 16) for p in prompts) + 64
    ex = ModelRunner(
        DEFAULT_MODEL, dtype="float32", device="cpu", num_blocks=blocks, chunk_cap=1024,
        step_budget=8192, max_batch_size=256, threads=2,
    )  # fmt: skip
    run_ours(ex, workload(4, 16, 64, spec.vocab_size, 99), 4)  # warm-up
    secs, outs, _ = run_ours(ex, prompts, 64)
    with torch.profiler.profile() as prof:
        psecs, _, _ = run_ours(ex, prompts, 64)
    n = sum(len(o) for o in outs)
    digest = hashlib.sha256(str(outs).encode()).hexdigest()[:12]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    line = (
        f"timed: {n / secs:.1f} tok/s; under the profiler: {n / psecs:.1f} tok/s; "
        f"output tokens' sha256 {digest}"
    )
    Path(out).write_text(f"{title}\n\n{line}\n\n{table}\n")
    print(line)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: scripts/profile-tree TREE OUT [TITLE]")
    main(
        sys.argv[1],
        sys.argv[2],
        sys.argv[3] if len(sys.argv) > 3 else f"W1 profile of {sys.argv[1]}",
    )
