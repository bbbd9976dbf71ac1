"""The adaptive step budget end to end (``gpu/step/budget.py``): a burst of prompts on a real
runtime is prefilled a few prompts per step, so first tokens leave while later prompts are still
being prefilled, with every token as under the fixed budget; the executor's events carry each
step's cap and the model refits; the replay of the run makes the same decisions."""

from __future__ import annotations

import random

import pytest
import trio

from minirt.bench.workloads import Job
from minirt.replay import sim, stepmodel, workload
from tests.replay.test_replay import send
from tests.support.runtime import start_runtime

N, PROMPT, NEW = 6, 100, 8
TARGET = ("--step-target-ms", "0.01")  # below any step: each step prefills MIN_PREFILL tokens


def _burst() -> list[Job]:
    rng = random.Random(3)
    return [Job(f"b{i}", [rng.randrange(16, 500) for _ in range(PROMPT)], NEW) for i in range(N)]


def _run(model, run, *flags: str) -> tuple[dict[str, list[int]], list[dict]]:
    with start_runtime(model, run, "--burst-wait-ms", "500", *flags) as rt:
        results = trio.run(send, rt, _burst())
        events = [e for e in rt.events() if e.get("actor") == "executor"]
    return {r.request_id: r.token_ids for r in results}, events


def _prefill_steps(events: list[dict]) -> list[int]:
    return [e["prefill_tokens"] for e in events if e.get("event") == "executor.step"]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("adaptive")
    fixed = _run(tiny_model, base / "fixed", "--budget-policy", "fixed")
    adaptive = _run(tiny_model, base / "adaptive", "--budget-policy", "adaptive", *TARGET)
    return fixed, adaptive, base / "adaptive"


def test_a_burst_gets_first_tokens_while_it_is_prefilled_and_the_same_tokens(runs) -> None:
    (fixed_out, fixed_ev), (out, ev), _ = runs
    assert out == fixed_out and len(out) == N  # greedy: chunking changes no token
    assert all(len(t) == NEW for t in out.values())
    # the fixed budget prefills the whole burst in one step: every first token waits for it
    assert _prefill_steps(fixed_ev)[0] == N * PROMPT
    cfg = next(e for e in ev if e["event"] == "executor.config")
    assert cfg["budget_policy"] == "adaptive" and cfg["step_target_s"] == pytest.approx(1e-5)
    assert cfg["step_costs"]["prefill_s"] > 0 and cfg["step_costs"]["c0_s"] > 0
    steps = [e for e in ev if e["event"] == "executor.step" and e["prefill_tokens"]]
    assert all(e["prefill_cap"] == 64 and e["prefill_tokens"] <= 64 for e in steps)
    assert sum(e["prefill_tokens"] for e in steps) == N * PROMPT
    assert len(steps) == -(-N * PROMPT // 64)
    # the first request's first token left before the last prompt's prefill began
    order = [e["event"] for e in ev if e["event"] in ("executor.prefill_done", "executor.step")]
    first_done = order.index("executor.prefill_done")
    assert order[:first_done].count("executor.step") < len(steps) // 2, order


def test_the_replay_of_an_adaptive_run_makes_its_decisions(runs) -> None:
    *_, run = runs
    rec = workload.load(run)
    assert rec.config.budget.budget_policy == "adaptive"
    assert rec.config.step_target_s == pytest.approx(1e-5)
    model = stepmodel.fit(rec.steps)
    res = sim.replay(rec, model, to_executor_s=sim.calibrate(rec, model))
    steps = [e for e in res.events if e.get("event") == "executor.step"]
    # the same decisions: every step's prefill capped at 64, all prompts prefilled, in about as
    # many steps (not step for step: whether a prompt's tail shares a step with the next
    # arrival depends on when the burst's requests landed, in the run and in the replay)
    replayed = [e["prefill_tokens"] for e in steps if e["prefill_tokens"]]
    recorded = [e["prefill_tokens"] for e in rec.steps if e["prefill_tokens"]]
    assert sum(replayed) == sum(recorded) == N * PROMPT
    assert max(replayed) <= 64 and abs(len(replayed) - len(recorded)) <= 2
    assert all(e["prefill_cap"] == 64 for e in steps if e["prefill_tokens"])
    # what if the budget were fixed: each step prefills every prompt that is in (how many are
    # in at the first step depends on the recorded arrivals), in far fewer steps
    whatif = sim.replay(
        rec, model, {"budget-policy": "fixed"}, to_executor_s=sim.calibrate(rec, model)
    )
    fixed = [e for e in whatif.events if e.get("event") == "executor.step"]
    prefills = [e["prefill_tokens"] for e in fixed if e["prefill_tokens"]]
    assert sum(prefills) == N * PROMPT and max(prefills) >= 2 * PROMPT
    assert len(prefills) <= N < -(-N * PROMPT // 64)
    assert all("prefill_cap" not in e for e in fixed)
