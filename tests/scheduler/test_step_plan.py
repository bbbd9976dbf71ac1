"""The per-step budget policy: chunk sizes, decode-first vs prefill-first, long-prefill limit."""

from __future__ import annotations

from gpu.requests import RequestState
from gpu.step.plan import StepBudget, burst_end, fills_a_step, plan_step
from messages.common import SamplingParams


def st(rid: str, prompt: int, computed: int = 0, blocks: int = 64, out: int = 0) -> RequestState:
    r = RequestState(
        rid, [1] * prompt, SamplingParams(), list(range(blocks)), computed, 0, frozenset()
    )
    r.out = [2] * out
    return r


def names(plan):
    return [r.rid for r in plan.decodes], [(r.rid, c) for r, c in plan.chunks]


def test_chunk_is_min_of_budget_cap_and_prompt_left():
    pre = [st("a", 100), st("b", 30, computed=25), st("c", 500)]
    plan = plan_step([], pre, StepBudget(step_budget=64, chunk_cap=40), 16)
    assert names(plan)[1] == [("a", 40), ("b", 5), ("c", 19)]


def test_decode_first_vs_prefill_first():
    dec = [st("d1", 10, computed=10, out=1), st("d2", 10, computed=10, out=1)]
    pre = [st("p", 100)]
    first = plan_step(dec, pre, StepBudget(step_budget=50, chunk_cap=100), 16)
    assert names(first) == (["d1", "d2"], [("p", 48)])
    pf = plan_step(dec, pre, StepBudget(step_budget=50, chunk_cap=100, decode_first=False), 16)
    assert names(pf) == ([], [("p", 50)])  # the prefill takes the whole budget


def test_long_prefill_limit_lets_short_prompts_through():
    pre = [st("long1", 2048), st("long2", 2048), st("short", 50)]
    off = plan_step([], pre, StepBudget(step_budget=4096, chunk_cap=2048), 16)
    assert [r for r, _ in names(off)[1]] == ["long1", "long2"]  # budget gone before "short"
    on = plan_step(
        [],
        pre,
        StepBudget(
            step_budget=4096, chunk_cap=2048, long_prefill_threshold=512, max_long_prefills=1
        ),
        16,
    )
    assert [r for r, _ in names(on)[1]] == ["long1", "short"]


def test_decode_without_block_room_is_skipped_not_waited_on():
    full = st("full", 16, computed=32, blocks=2, out=17)
    ok = st("ok", 16, computed=16, blocks=2, out=1)
    plan = plan_step([full, ok], [], StepBudget(), 16)
    assert names(plan)[0] == ["ok"] and plan.skipped == ["full"]


def test_max_batch_size_counts_requests():
    dec = [st(f"d{i}", 4, computed=4, out=1) for i in range(5)]
    plan = plan_step(dec, [st("p", 10)], StepBudget(max_batch_size=3), 16)
    assert len(plan.decodes) + len(plan.chunks) == 3


def test_a_burst_wait_ends_once_the_step_is_full():
    """An idle executor waiting for a burst starts as soon as what it holds fills one step."""
    b = StepBudget(step_budget=100, chunk_cap=64, max_batch_size=3)
    assert not fills_a_step([st("a", 60), st("b", 50, computed=20)], 2, b)  # 90 tokens left
    assert fills_a_step([st("a", 60), st("b", 50)], 2, b)  # 110 >= the step budget
    assert fills_a_step([st("a", 5)], 3, b)  # as many requests as a step takes
    assert [burst_end(False, False), burst_end(True, True), burst_end(True, False)] == [
        "burst_in",
        "step_full",
        "timeout",
    ]
