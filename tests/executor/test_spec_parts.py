"""Speculative decoding's parts, without a model: ``--speculative-config`` parsing and its
refusals, the n-gram proposer (against a brute-force search, and its speed), the cost model,
the per-step draft plan's caps and reasons, and how a step's several tokens per request are
published (one growth, from the last) and logged."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest

from gpu.core import ExecutorCore
from gpu.model_runner import ModelRunner
from gpu.publish import step_messages
from gpu.request_table import RequestTable
from gpu.requests import RequestState, StepResult, TokenOutput
from gpu.spec import cost, explore
from gpu.spec.config import SpecConfig, parse
from gpu.spec.explore import Allowance
from gpu.spec.ngram import NgramTokens, propose
from gpu.spec.plan import plan_drafts
from gpu.spec.verify import SpecStats, accepted, spec_fields
from gpu.state import Flight
from gpu.step.plan import StepBudget
from messages.common import SamplingParams
from messages.kv import Grow
from messages.tokenizer import TokenBatch


# ---------------------------------------------------------------------------------- config
def test_config_parses_vllms_json_with_its_defaults():
    assert parse("") is None and parse(None) is None and parse("  ") is None
    c = parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert c == SpecConfig("ngram", 3, 4, 2) and c.k == 3
    # vLLM's defaults: neither lookup bound, both 5; one of them, the other takes its value
    assert parse({"method": "ngram", "num_speculative_tokens": 2}) == SpecConfig("ngram", 2, 5, 5)
    only_max = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert parse(only_max) == SpecConfig("ngram", 2, 3, 3)
    only_min = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}
    assert parse(only_min) == SpecConfig("ngram", 2, 4, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x", "zz": 1}',
         ["unknown keys", "'draft_model'", "'zz'"]),
        ('{"method": "eagle", "num_speculative_tokens": 2}', ["method", "eagle"]),
        ('{"num_speculative_tokens": 2}', ["method"]),
        ('{"method": "ngram"}', ["num_speculative_tokens", "required"]),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens", ">= 1"]),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', ["num_speculative_tokens"]),
        ('{"method": "ngram", "num_speculative_tokens": true}', ["num_speculative_tokens"]),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}',
         ["prompt_lookup_max"]),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, '
         '"prompt_lookup_min": 3}', ["prompt_lookup_min", "prompt_lookup_max"]),
        ("[1, 2]", ["JSON object"]),
        ("{method: ngram}", ["not JSON"]),
    ],
)  # fmt: skip
def test_config_refusals_name_the_key(text, names):
    with pytest.raises(ValueError) as e:
        parse(text)
    for name in names:
        assert name in str(e.value)


def test_executor_refuses_a_bad_config_before_loading(tmp_path):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ModelRunner(
            tmp_path / "no-model-here",
            speculative={"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 0},
        )


def test_runtime_flag_reaches_the_executor_config():
    from minirt.cli import build_parser, config_from_args

    text = '{"method": "ngram", "num_speculative_tokens": 4}'
    cfg = config_from_args(build_parser().parse_args(["up", "--speculative-config", text]))
    assert cfg.executor.speculative_config == text
    assert parse(cfg.executor.speculative_config) == SpecConfig("ngram", 4, 5, 5)


# ---------------------------------------------------------------------------------- proposer
def brute(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    n = len(tokens)
    for m in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - m :]
        for end in range(n - 2, m - 2, -1):  # the most recent earlier occurrence first
            if tokens[end - m + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(3000):
        toks = [rng.randrange(rng.choice([2, 4, 50])) for _ in range(rng.randint(0, 60))]
        k, lo = rng.randint(1, 5), rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        assert propose(np.array(toks, dtype=np.int32), k, lo, hi) == brute(toks, k, lo, hi)


def test_proposer_examples_and_incremental_tokens():
    t = NgramTokens([1, 2, 3, 4, 9, 1, 2, 3])
    assert t.propose(3, 2, 4) == [4, 9, 1]  # "1 2 3" occurred before: what followed
    assert t.propose(3, 4, 4) == []  # "9 1 2 3" never occurred before
    t.extend([4])
    assert t.propose(2, 1, 3) == [9, 1]  # "2 3 4" again
    # the longest suffix wins over a more recent shorter one
    t = NgramTokens([5, 6, 7, 8, 0, 6, 7, 1, 6, 7])
    assert t.propose(1, 2, 3) == [1]  # "6 7": most recent earlier at 5..6 -> 1
    t = NgramTokens([5, 6, 7, 8, 0, 6, 7, 1, 5, 6, 7])
    assert t.propose(1, 2, 3) == [8]  # "5 6 7" occurred at 0..2 -> 8
    grow = NgramTokens([])
    grow.extend(range(300))  # past its first buffer
    assert len(grow) == 300 and grow.propose(2, 1, 2) == []


def test_proposer_is_fast_at_a_few_thousand_tokens():
    rng = random.Random(1)
    for vocab in (50_000, 40):  # sparse and dense matches of the last token
        t = NgramTokens([rng.randrange(vocab) for _ in range(2000)])
        t0 = time.perf_counter()
        for _ in range(200):
            t.propose(5, 2, 5)
        per = (time.perf_counter() - t0) / 200
        assert per < 1e-3, f"{per * 1e6:.0f} us per proposal (vocab {vocab})"


# ---------------------------------------------------------------------------------- cost
# SmolLM2's forward on 2 Zen 4 cores, ms: the linears turn compute-bound at 5 rows, then flat
SMOL = {1: 13.6, 2: 14.0, 3: 15.6, 4: 15.7, 5: 17.6, 6: 17.8, 8: 18.1, 10: 18.3, 16: 20.0,
        32: 30.0, 64: 50.0}  # fmt: skip


def test_step_cost_runs_through_the_rungs_and_never_falls():
    c = cost.StepCost({1: 1.0, 4: 2.0, 8: 2.0, 16: 6.0, 12: 1.5})  # 12 timed in a quiet moment
    assert c(1) == 1.0 and c(0) == 1.0
    assert c(2) == pytest.approx(1.0 + 1 / 3) and c(4) == 2.0
    assert c(12) == 2.0  # not below the rung under it
    assert c(14) == pytest.approx(4.0)  # halfway from 12 (2.0) to 16 (6.0)
    assert c(20) == pytest.approx(10.0)  # beyond the top: the last slope
    flat = cost.StepCost.flat(6)
    assert flat(1) == flat(6) == 1.0 and flat(7) == float("inf")
    with pytest.raises(ValueError):
        cost.StepCost({})


def test_served_steps_correct_the_table_where_they_ran():
    """Served steps (other processes on the cores) take longer than the start's forwards, more
    so at more rows: each band of rows is corrected by what its steps took; a band no step ran
    in takes the nearest one's correction."""
    c = cost.StepCost(SMOL)
    assert c(28) == pytest.approx(27.5)
    c.observe(16, 26.0)  # 1.3x the table at 16 rows
    assert c(16) == pytest.approx(26.0) and c(28) == pytest.approx(27.5 * 1.3)
    for _ in range(30):
        c.observe(28, 27.5 * 1.5)  # steps with drafts: 1.5x
    assert c(28) == pytest.approx(27.5 * 1.5, rel=1e-3)
    assert c(16) == pytest.approx(26.0)  # its own band's
    assert c(4) == pytest.approx(15.7 * 1.3)  # the nearest observed band below: none; above
    flat = cost.StepCost.flat(8)
    flat.observe(4, 5.0)
    assert flat(4) == 1.0  # --spec-max-rows: not timed, not corrected


def test_measure_times_every_rung_in_interleaved_rounds(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: now[0])
    ran = []
    busy = {(1, 8)}  # (round, rows) timed while another process had the cores

    def run(rows: int) -> None:
        ran.append(rows)
        rnd = (len(ran) - 1) // 3 - 1  # the warm-up pass is round -1
        now[0] += 0.01 * max(1.0, rows / 4) * (3 if (rnd, rows) in busy else 1)

    times = cost.measure(run, (1, 4, 8), rounds=2)
    assert ran == [1, 4, 8] * 3  # a warm-up pass, then the rounds, each up the ladder
    assert times == pytest.approx({1: 0.01, 4: 0.01, 8: 0.02})  # the busy rung's other round


# ---------------------------------------------------------------------------------- plan
def req(rid, tokens, max_tokens=100, table_blocks=8, out=3, ngram=True, prior=0) -> RequestState:
    prompt, outs = tokens[:-out], tokens[-out:]
    r = RequestState(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        list(range(table_blocks)),
        len(tokens) - 1,
        0,
        frozenset(),
        prior,
        out=list(outs),
    )
    r.ngram = NgramTokens(tokens) if ngram else None
    return r


CFG = SpecConfig("ngram", 4, 3, 1)
LOOP = [1, 2, 3, 4, 5, 6] * 4  # 24 tokens: drafts always found


FREE = cost.StepCost.flat(64)  # any step of up to 64 rows drafts as much as it can


def test_plan_caps_drafts_by_room_outputs_length_and_rows():
    plan = plan_drafts([req("a", LOOP)], 1, CFG, 100, FREE, 16, 1000)
    assert plan.drafts == {"a": [1, 2, 3, 4]} and plan.off is None
    # block room: a table of 2 blocks (32 slots), computed 23: positions up to 31
    assert plan_drafts([req("a", LOOP, table_blocks=2)], 1, CFG, 100, FREE, 16, 1000).drafts == {
        "a": [1, 2, 3, 4]
    }
    roomy = req("a", LOOP + [1, 2, 3, 4, 5, 6], table_blocks=2)  # computed 29: room for 2
    assert plan_drafts([roomy], 1, CFG, 100, FREE, 16, 1000).drafts == {"a": [1, 2]}
    # outputs left: max_tokens 5 with 3 out -> 2 left -> 1 draft
    assert plan_drafts([req("a", LOOP, max_tokens=5)], 1, CFG, 100, FREE, 16, 1000).drafts == {
        "a": [1]
    }
    # max_model_len 26 with 24 tokens -> one more output after a draft
    assert plan_drafts([req("a", LOOP)], 1, CFG, 100, FREE, 16, 26).drafts == {"a": [1]}
    # the step's rows: 3 decodes, steps of up to 6 rows draft -> 3 draft rows, each request's
    # first (a first draft is likelier kept than a second)
    three = [req(x, LOOP) for x in "abc"]
    assert plan_drafts(three, 3, CFG, 100, cost.StepCost.flat(6), 16, 1000).drafts == {
        "a": [1],
        "b": [1],
        "c": [1],
    }
    # and the step budget: 3 decodes + 2 prefill tokens, budget 7 -> 2 draft rows
    assert plan_drafts(three, 5, CFG, 7, FREE, 16, 1000).drafts == {"a": [1], "b": [1]}


@pytest.mark.parametrize(
    ("reqs", "rows", "budget", "off"),
    [
        ([], 10, 100, "no_decodes"),
        ([req("a", LOOP)], 64, 100, "cost"),
        ([req("a", LOOP)], 5, 5, "budget"),
        ([req("a", LOOP, max_tokens=4)], 1, 100, "room"),
        ([req("a", list(range(30)))], 1, 100, "no_match"),
        ([req("a", list(range(30))), req("b", LOOP, ngram=False), req("c", LOOP)], 3, 100, None),
    ],
)  # fmt: skip
def test_plan_says_why_no_decode_speculates(reqs, rows, budget, off):
    plan = plan_drafts(reqs, rows, CFG, budget, FREE, 16, 1000)
    assert plan.off == off
    assert bool(plan.drafts) == (off is None)


def test_accepted_counts_the_confirmed_prefix():
    assert accepted([5, 6, 7], [5, 6, 7]) == 3
    assert accepted([5, 9, 7], [5, 6, 7]) == 1
    assert accepted([1], [2]) == 0
    assert accepted([], []) == 0


# ---------------------------------------------------------------------------------- publish
class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event, **kw):
        self.events.append((event, kw))

    debug = warning = error = info


def test_several_tokens_of_a_request_in_one_step_publish_in_order_one_growth():
    table = RequestTable(StepBudget(), 4, 100, 1000)
    r = req("a", list(range(10)), table_blocks=3, out=1)
    table.add(r)
    flight = {"a": Flight(1, r.prompt)}
    outs = [TokenOutput("a", t, None, None, None, False, 9, n) for n, t in ((2, 7), (3, 8), (4, 9))]
    msgs = step_messages(
        StepResult(outs, 0, 1, 1, [], 0.0, 0.0), flight, table, 4, False, Log(), lambda: 0.0
    )
    grows = [m for _, m in msgs if isinstance(m, Grow)]
    assert [g.total_tokens for g in grows] == [9 + 4 + 4]  # from the last: 13 tokens + lookahead
    (batch,) = [m for _, m in msgs if isinstance(m, TokenBatch)]
    assert [e.token_id for e in batch.events] == [7, 8, 9]
    assert flight["a"].outputs == [7, 8, 9]
    # an end inside the step: the request leaves the ledger, no growth for it
    outs[1].finish_reason = "stop"
    flight = {"a": Flight(1, r.prompt)}
    msgs = step_messages(
        StepResult(outs[:2], 0, 1, 1, [], 0.0, 0.0), flight, table, 4, False, Log(), lambda: 0.0
    )
    assert not [m for _, m in msgs if isinstance(m, Grow)] and "a" not in flight


def test_step_event_carries_the_speculation_fields():
    log = Log()

    class Runner:
        requests = RequestTable(StepBudget(), 16, 10, 100)

        def start(self, run, grammar):
            pass

    core = ExecutorCore(Runner(), 16, 0.0, log)
    stats = SpecStats(off=None)
    stats.add("a", 4, 3)
    stats.add("b", 2, 0)
    core.stepped(StepResult([], 0, 2, 2, [], 0.0, 0.0, spec=stats), 0.01, 0.0)
    (step,) = [kw for ev, kw in log.events if ev == "executor.step"]
    assert step["spec_k"] == 4 and step["spec_drafts"] == 2
    assert step["spec_draft_tokens"] == 6 and step["spec_accepted"] == 3
    assert step["spec"] == [["a", 4, 3], ["b", 2, 0]] and step["spec_off"] is None
    core.stepped(StepResult([], 0, 1, 1, [], 0.0, 0.0), 0.01, 0.0)  # speculation off: no fields
    assert "spec_k" not in log.events[-1][1]


def test_acceptance_is_the_kept_fraction_of_trials_latest_first():
    t = NgramTokens([1, 2, 3])
    assert t.accept == pytest.approx(1 / 3)  # a fresh request: a third
    for _ in range(20):
        t.settle(4, 4)  # copying: every draft kept
    copying = t.accept
    assert copying > 0.95
    t.settle(4, 0)
    t.settle(4, 0)
    assert t.accept < copying - 0.05  # two rejections weigh at once
    for _ in range(40):
        t.settle(2, 0)
    assert t.accept < 0.1  # the copying forgotten


def test_plan_drafts_as_far_as_the_step_cost_table_pays():
    """On SmolLM2's CPU curve a copying request drafts long (rows 5 to 10 cost about what 5
    do), an unsure one drafts less, none when every row is arithmetic; the surest first."""
    smol = cost.StepCost(SMOL)
    cfg = SpecConfig("ngram", 9, 3, 1)
    copy = list(range(100, 120)) * 2  # the last tokens repeat 20 tokens back: 9 drafts found
    sure = req("a", copy)
    sure.ngram.propose(9, 1, 3)  # its proposals match 3 tokens: the estimates below are theirs
    for _ in range(10):
        sure.ngram.settle(5, 5)
    assert len(plan_drafts([sure], 1, cfg, 100, smol, 16, 1000).drafts["a"]) == 9
    unsure = req("b", copy)
    unsure.ngram.propose(9, 1, 3)
    for _ in range(10):
        unsure.ngram.settle(2, 0)
    # a second row costs 3%: one draft kept 5% of the time pays by a hair, a second never
    assert len(plan_drafts([unsure], 1, cfg, 100, smol, 16, 1000).drafts.get("b", [])) <= 1
    # past 16 rows a row costs 0.625 ms on the table, priced at 1.5 times that: at 16 decodes
    # (a token per 1.25 ms) only drafts kept more often than 0.75 pay, at 32 (a token per
    # 0.94 ms) none; nothing is proposed when none could pay
    big = [req(f"r{i}", copy) for i in range(32)]
    assert plan_drafts(big[:16], 16, cfg, 100, smol, 16, 1000).off == "cost"
    big[5] = sure
    plan = plan_drafts(big[:16], 16, cfg, 100, smol, 16, 1000)
    assert set(plan.drafts) == {"a"} and len(plan.drafts["a"]) >= 3
    assert plan_drafts(big, 32, cfg, 100, smol, 16, 1000).off == "cost"
    # served steps: 16 decodes as the table says, 20 and 30 rows twice it (the drafts' rows
    # cost ~3.5 ms each): no draft pays at 16 decodes now
    busy = cost.StepCost(SMOL)
    assert plan_drafts(big[:16], 16, cfg, 100, busy, 16, 1000).drafts
    busy.observe(16, 20.0)
    busy.observe(20, 2 * smol(20))
    busy.observe(30, 2 * smol(30))
    assert plan_drafts(big[:16], 16, cfg, 100, busy, 16, 1000).off == "cost"
    # a step with a 200-token prompt chunk: its rows price the drafts (~0.6 ms a row there),
    # the decodes' own rate is the bar: a lone decode (14 ms a token) drafts, 16 decodes
    # (0.8 tokens a ms) do not for drafts kept 40% of the time (which would raise the whole
    # step's tokens per second: 16 tokens in 145 ms)
    assert len(plan_drafts([sure], 1 + 200, cfg, 1000, smol, 16, 1000).drafts["a"]) == 9
    so_so = [req(f"s{i}", copy) for i in range(16)]
    for r in so_so:
        r.ngram.propose(9, 1, 3)
        for _ in range(4):  # 2 kept of 5 trials a round
            r.ngram.settle(5, 1)
            r.ngram.settle(5, 1)
            r.ngram.settle(5, 0)
        assert 0.3 < r.ngram.accept < 0.5
    assert plan_drafts(so_so, 16 + 200, cfg, 1000, smol, 16, 1000).off == "cost"
    # two requests, 4 rows of room: the surer one's drafts come first
    half = req("c", copy)
    plan = plan_drafts([half, sure], 2, cfg, 100, cost.StepCost.flat(6), 16, 1000)
    assert {r: len(d) for r, d in plan.drafts.items()} == {"a": 4}


# ------------------------------------------------------------------------------ exploration
# a table timed while another process started: rows 2 to 5 priced 1.3 to 2 times one row
SLOW_START = {1: 20.0, 2: 26.0, 3: 30.0, 4: 34.0, 5: 40.0, 8: 41.0, 16: 44.0, 32: 60.0}
K4 = SpecConfig("ngram", 4, 4, 1)  # vLLM's documented example


def _serve(reqs, steps, table, allowance):
    """``steps`` batch-1-style steps of ``reqs`` (all decodes): each verifies what the plan
    gives it, every draft kept (the requests copy); the table learns each step's rows at the
    true cost (rows 5 cost 1.2 times one). Returns the plans."""
    plans = []
    for _ in range(steps):
        plan = plan_drafts(reqs, len(reqs), K4, 100, table, 16, 10_000, allowance)
        for r in reqs:
            d = plan.drafts.get(r.rid, [])
            if d:
                r.ngram.settle(len(d), len(d))
        rows = len(reqs) + sum(len(d) for d in plan.drafts.values())
        table.observe(rows, 20.0 * len(reqs) ** 0.5 * (1 + 0.05 * (rows - len(reqs))))
        plans.append(plan)
    return plans


def test_the_planner_explores_what_its_estimates_rule_out_and_learns_it():
    """A lone copying request under a table that overprices draft rows (timed while another
    server started): at the prior acceptance (a third) no draft pays, so a planner that only
    trusts its estimates never verifies one and never learns. Exploring, the fresh request
    verifies its whole proposal at once, its acceptance and the band of rows it ran are
    measured, and from then on it drafts on its own."""
    copy = list(range(100, 140)) * 3
    assert plan_drafts([req("a", copy)], 1, K4, 100, cost.StepCost(SLOW_START), 16, 10_000).off == (
        "cost"
    )  # without an allowance: the estimates alone
    a = req("a", copy)
    plans = _serve([a], 40, cost.StepCost(SLOW_START), Allowance())
    assert plans[0].explored == ["a"] and plans[0].drafts == {"a": copy[:4]}
    assert plans[0].explore_s > 0 and plans[0].why == {}
    drafted = [p for p in plans if p.drafts and not p.explored]
    assert len(drafted) >= 35, "after exploring once, drafting pays on its own"
    assert a.ngram.accept > 0.8


def test_exploration_costs_a_bounded_share_when_drafts_do_not_pay():
    """Requests whose drafts are all rejected: each explores again once stale, and all the
    explorations together take at most the allowance's share of the steps' priced time."""
    table = cost.StepCost(SMOL)
    reqs = [req(f"r{i}", list(range(100, 140)) * 3) for i in range(8)]
    spent = priced = 0.0
    explored = 0
    allowance = Allowance()
    for _ in range(400):
        plan = plan_drafts(reqs, len(reqs), K4, 100, table, 16, 10_000, allowance)
        for r in reqs:
            if d := plan.drafts.get(r.rid):
                r.ngram.settle(len(d), 0)
        spent += plan.explore_s + plan.price_s
        priced += table(len(reqs))
        explored += len(plan.explored)
        # a burst of fresh requests is not explored all at once
        assert len(plan.explored) <= 1 or plan.explore_s <= explore.STEP_SHARE * table(len(reqs))
        if plan.explored:
            assert plan.why["cost"] == len(reqs) - len(plan.drafts)
    assert explored >= 8  # every request measured at least once
    assert spent <= (explore.SHARE + 0.01) * priced + explore.HOLD_STEPS * explore.SHARE * (
        table(len(reqs))
    )  # the share, plus what the allowance held at the start
    assert all(r.ngram.accept < 0.15 for r in reqs)


def test_step_event_says_why_and_what_explored():
    plan = plan_drafts([req("a", list(range(30))), req("b", LOOP)], 2, CFG, 100, FREE, 16, 1000)
    stats = plan.stats()
    stats.add("b", 4, 4, explored=True)
    ev = spec_fields(stats)
    assert ev["spec_why"] == {"no_match": 1} and ev["spec_explore"] == ["b"]
    assert ev["spec_gain"] > 0 and ev["spec_price_ms"] == 0.0  # a flat table: rows are free
    assert ev["spec_rate"] > 0 and "spec_turned_down" in ev


def test_explorations_check_every_band_a_proposal_reaches():
    """A lone request whose drafts are all rejected: no draft ever pays, yet its explorations
    run in each band of rows from 2 to 5 in turn, so the table is checked (and corrected) where
    the planner would never go on its own."""
    table = cost.StepCost(SLOW_START)
    a = req("a", list(range(100, 140)) * 3)
    allowance = Allowance()
    lengths = []
    for _ in range(200):
        plan = plan_drafts([a], 1, K4, 100, table, 16, 10_000, allowance)
        if d := plan.drafts.get("a"):
            if plan.explored:
                lengths.append(len(d))
            a.ngram.settle(len(d), 0)
        table.observe(1 + len(d or []), 21.0 + len(d or []))
    assert lengths[0] == 4 and set(lengths) == {1, 2, 3, 4}
    assert all(table.checked[table._band(r)] >= 0 for r in range(1, 6))
    assert table(5) < 0.8 * SLOW_START[5]  # the start's overprice corrected where it was


def test_no_exploring_where_even_copying_would_not_pay():
    """SmolLM2's table as a server timed it (float32, 2 Zen 4 cores): rows 33 and up read every
    weight block twice, so at 32 decodes even a request keeping 80% of its drafts would not pay
    for them, and nothing explores there (it cost that batch 6%); at 4 decodes they verify."""
    served = cost.StepCost({1: 21.3, 2: 23.6, 3: 26.2, 4: 27.6, 5: 32.3, 16: 32.3, 20: 49.5,
                            24: 52.5, 32: 53.7, 48: 98.5, 64: 104.8})  # fmt: skip
    copy = list(range(100, 140)) * 3
    many = [req(f"r{i}", copy) for i in range(32)]
    plan = plan_drafts(many, 32, K4, 1000, served, 16, 10_000, Allowance())
    assert not plan.drafts and plan.why == {"cost": 32}
    few = [req(f"r{i}", copy) for i in range(4)]
    assert plan_drafts(few, 4, K4, 1000, served, 16, 10_000, Allowance()).drafts


def test_acceptance_is_kept_per_suffix_length():
    """A reply that copies its prompt (drafts found by 4 matching tokens, all kept) and also
    meets chance single-token matches (none kept): the chance matches do not turn its copies
    off, as one estimate for both did."""
    t = NgramTokens(list(range(100, 140)) * 2 + [7, 8, 9, 7])  # ends on a 1-token match
    assert t.propose(4, 1, 4) == [8, 9, 7] and t.matched == 1
    for _ in range(6):
        t.settle(3, 0)
    assert t.accept < 0.1
    t.extend(list(range(100, 104)))  # now its last 4 tokens occurred before
    assert t.propose(4, 1, 4) == [104, 105, 106, 107] and t.matched == 4
    assert t.accept == pytest.approx(1 / 3)  # a fresh estimate for 4-token matches
    for _ in range(6):
        t.settle(4, 4)
    assert t.accept > 0.8 and t.best == t.accept


def test_corrected_prices_never_fall_with_more_rows():
    """Served steps at 32 rows ran 1.6 times the table, steps of 36 only 1.1 times: the draft
    rows that cross into the second band are still priced at least nothing, never below."""
    c = cost.StepCost({16: 40.0, 32: 65.0, 48: 113.0})
    c.observe(32, 1.6 * 65.0)
    c.observe(36, 1.1 * c.table(36))
    prices = [c(r) for r in range(1, 70)]
    assert prices == sorted(prices)
    assert c(36) >= c(32) == pytest.approx(104.0)
