"""What a step's rows cost: the forward-time table that prices draft rows.

A forward's time grows little with its rows while the weights' reads dominate (a memory-bound
decode) and linearly once the arithmetic does, and on a CPU the curve is not a line: once a
step pays for the row where the linears turn compute-bound, several more are nearly free
(docs/spec-decode.md), so a bound on a step's rows (or a line fitted to the times) prices
drafts wrongly on one side or the other.

The executor therefore times, once at start, the forward of every row count from 1 to 16 and
of 20, 24, 32, 48 and 64 rows (all rows with logits, as verification needs), in interleaved
rounds (a busy moment of the machine weighs on all rungs alike), keeps each rung's best, and
prices ``rows`` by :class:`StepCost`: straight between the rungs, the last rungs' slope beyond,
never decreasing. The planner (``gpu/spec/plan.py``) adds drafts where they raise the step's
expected tokens per second on that table. ``--spec-max-rows N`` (``StepCost.flat``) prices
every step of up to ``N`` rows alike and none above (drafts then fill up to ``N`` rows).

The start's forwards run alone; a served step does not: its rows are other requests' at other
contexts, and on a 2-core machine the HTTP server and its clients wake during it and take a
core from one of the forward's two threads, so served rows cost up to twice what the table
says (docs/spec-decode.md). So each step's forward time corrects the table where it ran
(:meth:`StepCost.observe`, steps without prompt rows): per band of rows between two rungs a
running ratio of what the steps took to what the table says, applied to the rows of that band;
a band no step has run in yet takes the nearest band's. Explorations (``gpu/spec/explore.py``)
run in the band of rows checked least recently (:meth:`StepCost.stalest`), so a band the
planner would not choose is checked too.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping

import torch

from gpu.model.attention import build_metadata
from gpu.model.kv_cache import PagedKVCache
from gpu.step.budget import SEED_ROWS, Costs, measure_seed

LADDER = (*range(1, 17), 20, 24, 32, 48, 64)
ROUNDS = 3
WEIGHT = 0.2  # of a step's forward time in its band's running ratio


class StepCost:
    """Seconds of a forward of ``rows`` rows (:meth:`__call__`): piecewise linear through the
    measured ``times`` (rows -> seconds), made non-decreasing (a rung timed faster than one
    below it takes that one's time), the last two rungs' slope beyond the top; ``limit``: no
    step of more rows may run drafts (infinite cost), 0 for none."""

    def __init__(self, times: Mapping[int, float], limit: int = 0) -> None:
        if not times or min(times) < 1 or min(times.values()) <= 0:
            raise ValueError("step costs need positive times for row counts >= 1")
        self.rows = sorted(times)
        self.secs: list[float] = []
        for r in self.rows:
            self.secs.append(max(times[r], self.secs[-1] if self.secs else 0.0))
        self.limit = limit
        # per band (rows up to rungs[0], then between two rungs, then past the top): the
        # running ratio of served steps' forward time to the table's, None until one ran there
        # (``seen``); band ``b`` is priced by the ratio of band ``source[b]`` (its own, else the
        # nearest band's that has one; None while no band has one: the table as timed)
        self.seen: list[float | None] = [None] * (len(self.rows) + 1)
        self.source: list[int | None] = [None] * len(self.seen)
        # per band, the served step (counted by :meth:`observe`) that last ran in it; -1: none
        self.checked = [-1] * len(self.seen)
        self.observed = 0
        # per band, the most any rung below it costs as corrected: a band's price never falls
        # under it (bands corrected by different ratios would otherwise price a row that
        # crosses into a cheaper-ratio band below zero)
        self.floor = [0.0] * len(self.seen)

    @classmethod
    def flat(cls, rows: int) -> StepCost:
        """Every step of up to ``rows`` rows costs the same, more than that cannot have drafts."""
        return cls({1: 1.0, max(rows, 1): 1.0}, limit=rows)

    def __call__(self, rows: int) -> float:
        if self.limit and rows > self.limit:
            return float("inf")
        band = self._band(rows)
        return max(self.table(rows) * self._ratio(band), self.floor[band])

    def _ratio(self, band: int) -> float:
        src = self.source[band]
        return 1.0 if src is None else (self.seen[src] or 1.0)

    def observe(self, rows: int, seconds: float) -> None:
        """A served step of ``rows`` decode and draft rows (no prompt's: those have no logits
        and other contexts) took ``seconds`` of forward: its band's ratio moves toward
        ``seconds / table(rows)`` (not for a flat table, which is not timed). A band no step
        has run in takes the nearest band's below (else above) that has one: a step's rows
        wake the same other processes."""
        if self.limit or rows < 1 or seconds <= 0:
            return
        band = self._band(rows)
        self.checked[band] = self.observed
        self.observed += 1
        ratio = seconds / self.table(rows)
        old = self.seen[band]
        self.seen[band] = ratio if old is None else old + WEIGHT * (ratio - old)
        if old is None:  # a band's first step: which band prices each may change (rarely)
            for b in range(len(self.source)):
                near = (*range(b, -1, -1), *range(b + 1, len(self.seen)))
                self.source[b] = next(c for c in near if self.seen[c] is not None)
        top = 0.0  # rung i (rows[i]) is in band i
        for i, secs in enumerate(self.secs):
            self.floor[i] = top
            top = max(top, secs * self._ratio(i))
        self.floor[-1] = top

    def stalest(self, lo: int, hi: int) -> int:
        """The row count from ``lo`` to ``hi`` whose band a served step ran in least recently
        (never first), the most rows of that band: where an exploration checks the table."""
        best = hi
        for rows in range(hi, lo - 1, -1):
            if self.checked[self._band(rows)] < self.checked[self._band(best)]:
                best = rows
        return best

    def _band(self, rows: int) -> int:
        return bisect.bisect_left(self.rows, rows)

    def table(self, rows: int) -> float:
        """The start's table at ``rows``, uncorrected."""
        rs, ts = self.rows, self.secs
        if rows <= rs[0]:
            return ts[0]
        i = bisect.bisect_left(rs, rows)
        if i < len(rs) and rs[i] == rows:
            return ts[i]
        lo = min(i, len(rs) - 1) - 1  # the segment from rs[lo] to rs[lo + 1]
        slope = (ts[lo + 1] - ts[lo]) / (rs[lo + 1] - rs[lo])
        return ts[lo] + slope * (rows - rs[lo])

    def as_dict(self) -> dict[int, float]:
        """rows -> milliseconds of the start's table (``executor.config``'s ``spec_costs``)."""
        return {r: round(t * 1e3, 3) for r, t in zip(self.rows, self.secs, strict=True)}


def measure(
    run: Callable[[int], None], ladder: tuple[int, ...] = LADDER, rounds: int = ROUNDS
) -> dict[int, float]:
    """``{rows: best seconds}`` of ``run(rows)`` over ``rounds`` passes up the ladder, after a
    warm-up pass (the first forward of a shape may build its kernels)."""
    for r in ladder:
        run(r)
    times: dict[int, float] = {}
    for _ in range(rounds):
        for r in ladder:
            t0 = time.perf_counter()
            run(r)
            times[r] = min(times.get(r, float("inf")), time.perf_counter() - t0)
    return times


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


def timed_at_start(
    model,
    spec,
    kv_dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    speculating: bool,
    spec_rows: int | None,
) -> tuple[Costs, StepCost]:
    """The start's timings: the step-time model from two forwards (``gpu/step/budget.py``'s
    seed, logged under either budget policy so a replay can run the other), and what a step's
    rows cost, which prices draft rows: timed when speculating without ``spec_rows``, else
    flat in steps of up to ``spec_rows``."""
    seed = measure_seed(model_forward(model, spec, kv_dtype, device, block_size, SEED_ROWS, False))
    rows = StepCost.flat(spec_rows or 1)
    if speculating and not spec_rows:
        rows = StepCost(measure(model_forward(model, spec, kv_dtype, device, block_size)))
    return seed, rows
