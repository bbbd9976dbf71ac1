"""The adaptive step budget: how many prompt tokens the next step may prefill, from a step-time
model the executor fits online from its own steps.

A fixed budget (``--step-budget``, 8192) is one trade-off: a burst of prompts runs as one giant
step (the most prefill throughput), and every request's first token waits for all of them. The
adaptive budget instead keeps each step near a target time: the prefill tokens a step may take
are what the target leaves once the step's decodes are priced,

    cap = (target - c0 - c_decode * decodes - c_ctx * decode_ctx) / c_prefill

never fewer than ``MIN_PREFILL`` (prefill always moves on) nor more than the fixed budget. So a
burst's prompts are prefilled a few per step and their first tokens leave as each one completes,
and running requests' decode steps stay near the target (a TPOT bound) while prefill fills what
is left, as stall-free batching does.

The model (``t = c0 + c_prefill * prefill_tokens + c_decode * decode_rows + c_ctx * decode_ctx``,
draft rows counted as decode rows) starts from two forwards timed at start (one row; 256 rows)
and is refitted every ``REFIT_EVERY`` steps on the last ``WINDOW`` steps, by the robust
non-negative least squares (``actors/shared/stepfit.py``); a cost the window cannot tell (no
prefill in it) keeps the start's value, and the fitted per-token costs stay within
``[1/2, 4]`` of the start's (a busy machine slows steps; it does not make them free). The target,
unless given (``--step-target-ms``), is what a step prefilling ``AUTO_TOKENS`` prompt tokens
alone costs by the start's model (about vLLM's chunk on CPU; smaller steps lose throughput to the
per-step cost and to the decode rows that ride in every step, and bring the median first token no
earlier, which the prefill rate bounds: docs/benchmarks/openai-smollm2/step-target/README.md).
Pure: the executor and the replay drive it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from actors.shared.stepfit import robust_fit

MIN_PREFILL = 64
AUTO_TOKENS = 1024
WINDOW = 512
REFIT_EVERY = 32
MIN_STEPS = 24
SEED_ROWS = 256
BOUNDS = (0.5, 4.0)  # fitted per-token costs, as multiples of the start's


@dataclass(frozen=True)
class Costs:
    """Seconds: per step, per prompt token, per decode row, per key a decode reads."""

    c0: float
    prefill: float
    decode: float
    ctx: float = 0.0

    def predict(self, prefill: float, decodes: float, decode_ctx: float) -> float:
        return self.c0 + self.prefill * prefill + self.decode * decodes + self.ctx * decode_ctx

    def as_dict(self) -> dict[str, float]:
        return {
            "c0_s": round(self.c0, 7),
            "prefill_s": round(self.prefill, 9),
            "decode_s": round(self.decode, 9),
            "ctx_s": round(self.ctx, 12),
        }


def seed_costs(one_row_s: float, rows_s: float, rows: int = SEED_ROWS) -> Costs:
    """Costs from a one-row forward and a ``rows``-row forward (a row costs as a token)."""
    per = max((rows_s - one_row_s) / max(rows - 1, 1), 1e-9)
    return Costs(max(one_row_s - per, 1e-6), per, per)


def measure_seed(run: Callable[[int], None], reps: int = 3) -> Costs:
    """Time ``run(1)`` and ``run(SEED_ROWS)`` (best of ``reps``, after one warm-up each)."""

    def best(rows: int) -> float:
        run(rows)
        out = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            run(rows)
            out = min(out, time.perf_counter() - t0)
        return out

    return seed_costs(best(1), best(SEED_ROWS))


def step_target(seed: Costs, step_target_ms: float = 0.0) -> float:
    """The step time the adaptive budget keeps to: ``step_target_ms`` if given, else what a
    step prefilling ``AUTO_TOKENS`` prompt tokens alone costs by ``seed``."""
    return step_target_ms / 1000.0 if step_target_ms > 0 else seed.predict(AUTO_TOKENS, 0, 0)


class AdaptiveBudget:
    """The per-step prefill cap (see the module doc)."""

    def __init__(self, seed: Costs, step_budget: int, target_s: float = 0.0) -> None:
        self.seed = seed
        self.costs = seed
        self.step_budget = step_budget
        self.target_s = target_s if target_s > 0 else step_target(seed)
        self.rows: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)
        self.since_fit = 0
        self.fits = 0

    def cap(self, decodes: int, decode_ctx: int) -> int:
        """Prompt tokens the next step may prefill, with ``decodes`` rows decoding over
        ``decode_ctx`` keys in all."""
        c = self.costs
        left = self.target_s - c.predict(0, decodes, decode_ctx)
        n = int(left / c.prefill) if left > 0 else 0
        return max(MIN_PREFILL, min(self.step_budget, n))

    def observe(self, prefill: int, decodes: int, decode_ctx: int, seconds: float) -> bool:
        """Record one step; True when the model was refitted (``costs`` is new)."""
        self.rows.append((float(prefill), float(decodes), float(decode_ctx), seconds))
        self.since_fit += 1
        if len(self.rows) < MIN_STEPS or self.since_fit < REFIT_EVERY:
            return False
        self.since_fit = 0
        self.costs = self.fit()
        self.fits += 1
        return True

    def fit(self) -> Costs:
        """The model refitted on the window (see the module doc)."""
        data = np.array(self.rows, dtype=float)
        x, y = data[:, :3], data[:, 3]
        seen = x.max(axis=0) > x.min(axis=0)  # columns the window varies
        cols = [i for i in range(3) if seen[i]]
        a = np.column_stack([np.ones(len(y)), x[:, cols]])
        sol, _ = robust_fit(a, y)
        got = dict(zip(cols, sol[1:], strict=True))
        s = self.seed
        lo, hi = BOUNDS
        prefill = float(np.clip(got.get(0, s.prefill), lo * s.prefill, hi * s.prefill))
        decode = float(np.clip(got.get(1, s.decode), lo * s.decode, hi * s.decode))
        ctx = float(got.get(2, s.ctx)) if seen[2] else s.ctx
        c0 = float(sol[0]) if seen.any() else s.c0
        return Costs(max(c0, 1e-6), prefill, decode, max(ctx, 0.0))
