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
from gpu.executor import Executor
from gpu.publish import step_messages
from gpu.recovery import Flight
from gpu.request_table import RequestTable
from gpu.requests import RequestState, StepResult, TokenOutput
from gpu.spec import cost
from gpu.spec.config import SpecConfig, parse
from gpu.spec.ngram import NgramTokens, propose
from gpu.spec.plan import plan_drafts
from gpu.spec.verify import SpecStats, accepted
from gpu.step_plan import StepBudget
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
        Executor(
            tmp_path / "no-model-here",
            speculative={"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 0},
        )


def test_runtime_flag_reaches_the_executor_config():
    from actors.cli import build_parser, config_from_args

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
def test_cheap_rows_is_the_last_rung_within_the_slowdown():
    assert cost.cheap_rows({1: 1.0, 2: 1.0, 4: 1.2, 8: 1.5, 16: 2.0, 32: 1.1}, 1.5) == 8
    assert cost.cheap_rows({1: 1.0, 2: 1.6}, 1.5) == 1
    assert cost.cheap_rows({1: 1.0, 2: 1.0, 4: 1.0}) == 4
    assert cost.cheap_rows({1: 1.0, 2: 1.9, 4: 2.5}) == 2  # the default: 2x the one-row forward


def test_measure_climbs_until_rows_cost_real_compute(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: now[0])
    ran = []

    def run(rows: int) -> None:  # flat to 8 rows, then linear
        ran.append(rows)
        now[0] += 0.01 * max(1.0, rows / 8)

    times = cost.measure(run, slowdown=1.5)
    assert cost.cheap_rows(times, 1.5) == 8
    assert max(times) == 16 and 32 not in ran  # stopped past the slowdown


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


def test_plan_caps_drafts_by_room_outputs_length_and_rows():
    plan = plan_drafts([req("a", LOOP)], 1, CFG, 100, 64, 16, 1000)
    assert plan.drafts == {"a": [1, 2, 3, 4]} and plan.off is None
    # block room: a table of 2 blocks (32 slots), computed 23: positions up to 31
    assert plan_drafts([req("a", LOOP, table_blocks=2)], 1, CFG, 100, 64, 16, 1000).drafts == {
        "a": [1, 2, 3, 4]
    }
    roomy = req("a", LOOP + [1, 2, 3, 4, 5, 6], table_blocks=2)  # computed 29: room for 2
    assert plan_drafts([roomy], 1, CFG, 100, 64, 16, 1000).drafts == {"a": [1, 2]}
    # outputs left: max_tokens 5 with 3 out -> 2 left -> 1 draft
    assert plan_drafts([req("a", LOOP, max_tokens=5)], 1, CFG, 100, 64, 16, 1000).drafts == {
        "a": [1]
    }
    # max_model_len 26 with 24 tokens -> one more output after a draft
    assert plan_drafts([req("a", LOOP)], 1, CFG, 100, 64, 16, 26).drafts == {"a": [1]}
    # the step's rows: 3 decodes, cheap_rows 6 -> 3 draft rows, first come first served
    three = [req(x, LOOP) for x in "abc"]
    assert plan_drafts(three, 3, CFG, 100, 6, 16, 1000).drafts == {"a": [1, 2, 3]}
    # and the step budget: 3 decodes + 2 prefill tokens, budget 7 -> 2 draft rows
    assert plan_drafts(three, 5, CFG, 7, 64, 16, 1000).drafts == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("reqs", "rows", "budget", "cheap", "off"),
    [
        ([], 10, 100, 64, "no_decodes"),
        ([req("a", LOOP)], 64, 100, 64, "batch"),
        ([req("a", LOOP)], 5, 5, 64, "budget"),
        ([req("a", LOOP, ngram=False)], 1, 100, 64, "params"),
        ([req("a", LOOP, max_tokens=4)], 1, 100, 64, "room"),
        ([req("a", list(range(30)))], 1, 100, 64, "no_match"),
        ([req("a", list(range(30))), req("b", LOOP, ngram=False), req("c", LOOP)], 3, 100, 64,
         None),
    ],
)  # fmt: skip
def test_plan_says_why_no_decode_speculates(reqs, rows, budget, cheap, off):
    plan = plan_drafts(reqs, rows, CFG, budget, cheap, 16, 1000)
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


def test_draft_length_adapts_to_acceptance():
    """All accepted: the next draft is twice as long (up to the configured most); none: half;
    some: one more than were accepted."""
    from gpu.spec.ngram import NgramTokens

    t = NgramTokens([1, 2, 3])
    assert t.k == 0  # the configured number first
    # (drafted, accepted) in turn, with the most 8, and the next draft's length after each
    fates = [((2, 2), 4), ((4, 4), 8), ((8, 8), 8), ((8, 0), 4), ((4, 1), 2), ((1, 0), 1)]
    seen = []
    for (drafted, kept), _ in fates:
        t.settle(drafted, kept, 8)
        seen.append(t.k)
    assert seen == [k for _, k in fates]


def test_fitted_rows_reads_the_line_not_one_rung():
    """Rows on a line fitted to the rungs: a rung timed in a busy moment does not move the
    answer by a rung (the one-rung rule would stop at 2 here)."""
    line = {r: 20.0 + 2.5 * r for r in (1, 2, 4, 8, 16)}
    assert cost.fitted_rows(line, 2.0) == 10  # 20 + 2.5 r <= 2 x 22.5
    noisy = {**line, 2: 50.0}
    assert cost.cheap_rows(noisy, 2.0) == 1
    assert cost.fitted_rows(noisy, 2.0) == 10
    assert cost.fitted_rows({1: 1.0, 2: 1.0}) == 2  # too few rungs: the one-rung rule


def test_a_rejected_single_draft_rests_the_proposer():
    from gpu.spec.ngram import REST, NgramTokens

    t = NgramTokens([1, 2, 3, 1, 2, 3, 1, 2])
    assert t.propose(2, 1, 3) == [3, 1]
    t.settle(1, 0, 5)
    assert [t.propose(2, 1, 3) for _ in range(REST)] == [[]] * REST
    assert t.propose(2, 1, 3) == [3, 1]
