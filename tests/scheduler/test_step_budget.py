"""The adaptive step budget (``gpu/step/budget.py``): each step's prefill sized to a step-time
target from a model fitted on the executor's own steps."""

from __future__ import annotations

import random

import pytest

from gpu.step.budget import (
    AUTO_TOKENS,
    MIN_PREFILL,
    REFIT_EVERY,
    AdaptiveBudget,
    Costs,
    seed_costs,
)
from gpu.step.plan import StepBudget, plan_step
from tests.scheduler.test_step_plan import names, st


def test_seed_from_two_forwards():
    c = seed_costs(0.020, 0.020 + 255 * 0.0005)
    assert c.prefill == pytest.approx(0.0005) and c.decode == pytest.approx(0.0005)
    assert c.c0 == pytest.approx(0.0195)
    # the default target: a step prefilling AUTO_TOKENS alone
    assert AdaptiveBudget(c, 8192).target_s == pytest.approx(0.0195 + AUTO_TOKENS * 0.0005)
    assert AdaptiveBudget(c, 8192).cap(0, 0) == AUTO_TOKENS


def test_cap_is_what_the_target_leaves_once_decodes_are_priced():
    c = Costs(c0=0.02, prefill=0.001, decode=0.002, ctx=1e-6)
    b = AdaptiveBudget(c, 8192, target_s=0.5)
    assert b.cap(0, 0) == 480  # (0.5 - 0.02) / 0.001
    assert b.cap(64, 64 * 1000) == int((0.5 - 0.02 - 0.128 - 0.064) / 0.001)
    assert b.cap(1000, 0) == MIN_PREFILL  # decodes alone pass the target: prefill still moves
    assert AdaptiveBudget(c, 256, target_s=10.0).cap(0, 0) == 256  # never past --step-budget


def test_a_burst_is_prefilled_a_few_prompts_per_step():
    """Eight prompts of 128 at once: the fixed budget prefills them in one step (every first
    token waits for all); the adaptive cap of 300 tokens completes two or three per step."""
    pre = [st(f"p{i}", 128) for i in range(8)]
    fixed = plan_step([], pre, StepBudget(), 16)
    assert len(fixed.completing()) == 8
    b = AdaptiveBudget(Costs(0.02, 0.001, 0.002), 8192, target_s=0.32)
    plan = plan_step([], pre, StepBudget(), 16, b.cap(0, 0))
    assert names(plan)[1] == [("p0", 128), ("p1", 128), ("p2", 44)]
    assert [r.rid for r in plan.completing()] == ["p0", "p1"]


def test_refit_learns_the_machine_from_its_steps():
    """Steps timed by a cost the seed got wrong (decodes three times dearer, a dearer step):
    after a refit the cap follows the machine, within the bounds of the seed."""
    seed = Costs(c0=0.01, prefill=0.001, decode=0.001)
    true = Costs(c0=0.03, prefill=0.0012, decode=0.003, ctx=2e-7)
    b = AdaptiveBudget(seed, 8192, target_s=0.5)
    rng = random.Random(0)
    refits = 0
    for _ in range(4 * REFIT_EVERY):
        p, d = rng.choice([0, 0, 64, 256, 512]), rng.randrange(1, 65)
        ctx = d * rng.randrange(100, 1000)
        t = true.predict(p, d, ctx) * rng.uniform(0.97, 1.03)
        refits += b.observe(p, d, ctx, t)
    assert refits == 4 and b.fits == 4
    got = b.costs
    assert got.prefill == pytest.approx(true.prefill, rel=0.1)
    assert got.decode == pytest.approx(true.decode, rel=0.15)
    want = int((0.5 - true.predict(0, 32, 32 * 500)) / true.prefill)
    assert b.cap(32, 32 * 500) == pytest.approx(want, rel=0.1)


def test_refit_keeps_the_seed_for_what_its_window_cannot_tell():
    """Decode-only steps say nothing of a prompt token's cost: the seed's stays."""
    seed = Costs(c0=0.01, prefill=0.001, decode=0.001)
    b = AdaptiveBudget(seed, 8192, target_s=0.5)
    for i in range(REFIT_EVERY):
        d, ctx = 1 + i % 16, (1 + i % 16) * (50 + 37 * (i % 5))
        b.observe(0, d, ctx, 0.01 + 0.002 * d + 1e-7 * ctx)
    assert b.fits == 1
    assert b.costs.prefill == seed.prefill
    assert b.costs.decode == pytest.approx(0.002, rel=0.05)
