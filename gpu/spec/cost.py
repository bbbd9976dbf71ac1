"""When draft rows are cheap: the cost model that turns speculation off in large batches.

A forward's time grows little with its rows while the weights' reads dominate (a memory-bound
decode) and linearly once the arithmetic does. Speculation pays while its draft rows ride along
nearly free, so the executor measures, once at start, the forward of 1, 2, 4, ... 64 rows (all
with logits, as verification needs) and keeps ``fitted_rows``: the most rows whose forward, on a
straight line fitted to the times, takes at most ``SLOWDOWN`` times the one-row forward. A step then adds draft rows only up to that
many rows in all (its decodes and prefill tokens first); a step already at or past it runs
without drafts (``off: "batch"``). Even if every draft is rejected, a step is then at most
``SLOWDOWN`` times slower than the cheapest one, and a lone request earns that back with one
accepted draft per step (two tokens for one forward); n-gram drafts, proposed only where the
text repeats, are mostly accepted there (a code edit on SmolLM2: 86%). A CPU's curve bends
early (SmolLM2-135M, 1 thread: 24, 29, 35, 50 ms for 1, 2, 4, 8 rows); an accelerator's stays
flat far longer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from gpu.attention import build_metadata
from gpu.kv_cache import PagedKVCache

LADDER = (1, 2, 4, 8, 16, 32, 64)
SLOWDOWN = 2.0
REPS = 3


def fitted_rows(times: Mapping[int, float], slowdown: float = SLOWDOWN) -> int:
    """``cheap_rows`` of a straight line ``t = a + b r`` fitted to ``times`` by Theil-Sen (the
    median of the pairwise slopes, then the median intercept): one rung timed in a busy moment
    of the machine does not move it."""
    rows = sorted(times)
    if len(rows) < 3:
        return cheap_rows(times, slowdown)
    slopes = [(times[q] - times[p]) / (q - p) for i, p in enumerate(rows) for q in rows[i + 1 :]]
    b = statistics.median(slopes)
    a = statistics.median(times[r] - b * r for r in rows)
    one = a + b * rows[0]
    if b <= 0 or one <= 0:
        return cheap_rows(times, slowdown)
    most = rows[0] + (slowdown - 1.0) * one / b  # where the line reaches slowdown x one row
    return max(rows[0], min(int(most), 2 * rows[-1]))


def cheap_rows(times: Mapping[int, float], slowdown: float = SLOWDOWN) -> int:
    """The most rows of ``times`` (rows -> forward seconds, climbing) before the first whose
    forward takes more than ``slowdown`` times the fewest rows' forward."""
    ladder = sorted(times)
    base, rows = times[ladder[0]], ladder[0]
    for r in ladder:
        if times[r] > slowdown * base:
            break
        rows = r
    return rows


def measure(
    run: Callable[[int], None],
    ladder: tuple[int, ...] = LADDER,
    reps: int = REPS,
    slowdown: float = SLOWDOWN,
) -> dict[int, float]:
    """``{rows: best of reps seconds}`` of ``run(rows)`` up the ladder, each rung after a
    warm-up run (the first forward of a shape may build its kernels), the rungs below it timed
    again alongside (interleaved: a busy moment of the machine weighs on all of them); stops at
    the first rung past ``slowdown`` times the first (none higher can be cheap)."""
    times: dict[int, float] = {}
    for r in ladder:
        run(r)
        times[r] = _timed(run, r)
        # again with the rungs below, so a burst of another process's work on the cores
        # (which would make one rung look dear) is seen by the others too: best of each
        for _ in range(reps - 1):
            for q in times:
                times[q] = min(times[q], _timed(run, q))
        if times[r] > slowdown * times[ladder[0]]:
            break
    return times


def _timed(run: Callable[[int], None], rows: int) -> float:
    t0 = time.perf_counter()
    run(rows)
    return time.perf_counter() - t0


def model_forward(
    model,
    spec,
    kv_dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    most: int = 0,
    all_logits: bool = True,
):
    """``run(rows)`` for :func:`measure`: the model's forward over ``rows`` tokens (at most
    ``most``, default the ladder's top) with logits for each (``all_logits``; else for the last,
    as a prefill), on a scratch KV cache of its own (the executor's pool is not touched)."""
    nblk = -(-max(most, *LADDER) // block_size)
    cache = PagedKVCache(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, nblk, block_size, kv_dtype, device
    )
    table = list(range(nblk))

    def run(rows: int) -> None:
        meta = build_metadata([], [(table, 0, rows)], cache, kv_dtype, device)
        ids = torch.zeros(rows, dtype=torch.long, device=device)
        pos = torch.arange(rows, device=device)
        logits = model.forward(ids, pos, meta, cache, pos if all_logits else pos[-1:])
        float(logits[-1, 0])  # waits for the device

    return run
