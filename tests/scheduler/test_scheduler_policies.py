"""Admission policies on constructed queues: order, aging, lpm, priority preemption."""

from __future__ import annotations

import structlog

from actors.runtime.config import QUEUE_POLICIES, KVConfig, SchedulerConfig
from actors.scheduler.core import SchedulerCore
from actors.scheduler.queue import (
    POLICIES,
    LPMQueue,
    PriorityQueue,
    SJFQueue,
    WaitingQueue,
    make_queue,
)
from actors.scheduler.state import SchedRequest
from messages import executor as xm
from messages import kv as km
from messages.common import SamplingParams
from messages.scheduler import AdmitResult, GrowthShortage, PrefillDone, RequestDone, Submit


def req(rid: str, n: int = 4, priority: int = 0, seq: int = 0, t: float = 0.0) -> SchedRequest:
    return SchedRequest(rid, list(range(n)), SamplingParams(priority=priority), 0.0, t, seq)


def drain(q: WaitingQueue, now: float = 0.0) -> list[str]:
    out = []
    while (r := q.peek(now)) is not None:
        out.append(r.request_id)
        q.remove(r.request_id)
    return out


def fill(q: WaitingQueue, specs):
    for i, (rid, n, prio) in enumerate(specs):
        q.push(req(rid, n, prio, seq=i, t=float(i)))
    return q


SPECS = [("a", 50, 2), ("b", 10, 1), ("c", 30, 0), ("d", 10, 0)]


def test_fcfs_order_is_arrival():
    assert drain(fill(WaitingQueue(), SPECS)) == ["a", "b", "c", "d"]


def test_priority_order_lower_value_first_ties_by_arrival():
    assert drain(fill(PriorityQueue(), SPECS)) == ["c", "d", "b", "a"]


def test_sjf_order_shortest_prompt_first_ties_by_arrival():
    assert drain(fill(SJFQueue(), SPECS)) == ["b", "d", "c", "a"]


def test_preempted_request_goes_first_under_every_policy():
    for name in ("fcfs", "priority", "sjf", "lpm"):
        q = fill(make_queue(name), SPECS)
        q.push_front(req("victim", 500, 9, seq=99, t=50.0))
        assert q.peek(0.0).request_id == "victim", name


def test_aging_rescues_a_starved_long_request_under_sjf():
    q = SJFQueue(max_wait_s=10.0)
    q.push(req("long", 2000, seq=0, t=0.0))
    for i in range(1, 50):  # a stream of short requests keeps arriving
        q.push(req(f"s{i}", 10, seq=i, t=float(i) * 0.1))
    assert q.peek(now=5.0).request_id != "long"  # sjf alone would starve it
    assert q.peek(now=10.5).request_id == "long"  # waited > max_wait_s: it goes first


def test_lpm_picks_the_request_with_the_longest_cached_prefix():
    q = fill(LPMQueue(), SPECS)
    assert [r.request_id for r in q.candidates()] == ["a", "b", "c", "d"]
    q.set_scores({"a": 0, "b": 16, "c": 48, "d": 16})
    assert q.peek(0.0).request_id == "c"


def test_lpm_falls_back_to_fcfs_on_a_long_queue():
    q = LPMQueue(window=4, fallback=8)
    for i in range(10):
        q.push(req(f"r{i}", seq=i, t=float(i)))
    assert q.candidates() == []
    q.set_scores({"r5": 64})
    assert q.peek(0.0).request_id == "r0"


def _core(policy="fcfs", **kw):
    cfg = SchedulerConfig(policy=policy, max_batch_size=kw.pop("max_batch", 8), **kw)
    return SchedulerCore(cfg, KVConfig(block_size=4), structlog.get_logger(), lambda: 0.0)


def _submit(core, rid, n=4, priority=0):
    core.submit(
        Submit(
            request_id=rid,
            prompt_ids=list(range(1, n + 1)),
            params=SamplingParams(priority=priority),
            arrival=0.0,
        )
    )


def _admits(out):
    return [m for _, m in out if isinstance(m, km.Admit)]


def test_lpm_core_asks_kv_for_matches_then_admits_the_cached_request():
    core = _core("lpm")
    _submit(core, "a")  # alone in the queue: offered at once (no choice to make)
    assert [m.request_id for m in _admits(core.take_outbox())] == ["a"]
    _submit(core, "b", n=4)  # these wait: one admission in flight at a time
    _submit(core, "c", n=5)
    assert core.take_outbox() == []
    core.admit_result(AdmitResult(request_id="a", attempt=1, ok=True, block_table=[0]))
    out = core.take_outbox()
    [q] = [m for _, m in out if isinstance(m, km.MatchQuery)]
    assert q.token_lists == [[1, 2, 3, 4], [1, 2, 3, 4, 5]]  # b, c: oldest first
    assert not _admits(out)  # the policy waits for the match lengths
    core.match_reply(km.MatchReply(cached_tokens=[0, 4]))
    [ask] = _admits(core.take_outbox())
    assert ask.request_id == "c"


def test_priority_victim_policy_preempts_the_least_important_on_a_shortage():
    cfg = SchedulerConfig(policy="priority", max_batch_size=8)
    kv = KVConfig(block_size=4, victim_policy="priority")
    core = SchedulerCore(cfg, kv, structlog.get_logger(), lambda: 0.0)
    for rid, prio in (("low", 7), ("high", 0), ("mid", 3)):
        _submit(core, rid, priority=prio)
        assert [m.request_id for m in _admits(core.take_outbox())] == [rid]
        core.admit_result(AdmitResult(request_id=rid, attempt=1, ok=True, block_table=[0]))
    core.take_outbox()
    core.shortage(
        GrowthShortage(
            request_id="high", attempt=1, blocks_needed=1, blocks_free=0, blocks_evictable=0
        )
    )
    [pre] = [m for _, m in core.take_outbox() if isinstance(m, xm.Preempt)]
    assert pre.request_id == "low"  # largest priority value: least important, though not newest


def test_priority_preemption_only_when_configured():
    for enabled in (False, True):
        core = _core("priority", max_batch=1, priority_preemption=enabled)
        _submit(core, "low", priority=5)
        core.admit_result(AdmitResult(request_id="low", attempt=1, ok=True, block_table=[0]))
        core.take_outbox()
        _submit(core, "urgent", priority=0)
        pre = [m for _, m in core.take_outbox() if isinstance(m, xm.Preempt)]
        assert [p.request_id for p in pre] == (["low"] if enabled else [])
        if enabled:
            core.request_done(
                RequestDone(request_id="low", attempt=1, status="preempted", output_ids=[9])
            )
            asks = [m for _, m in core.take_outbox() if isinstance(m, km.Admit)]
            assert asks and asks[0].request_id == "urgent"  # then "low" again, first of the rest


def test_scheduler_bench_keeps_batch_and_queue_sizes():
    from benchmarks.scheduler import measure

    for policy in ("fcfs", "lpm"):
        m = measure(policy, waiting=300, running=32, decisions=20)
        assert m.seconds_per_decision > 0
        assert m.admitted == 20, (policy, m)  # each decision admitted the next request
        assert (m.running, m.waiting) == (32, 300), (policy, m)  # batch full, queue kept


def test_requests_sharing_a_prefix_wait_for_its_prefill_then_hit_the_cache():
    core = _core("fcfs", prefix_defer_tokens=8)
    shared = list(range(100, 108))

    def sub(rid, tail):
        core.submit(
            Submit(request_id=rid, prompt_ids=shared + tail, params=SamplingParams(), arrival=0.0)
        )

    sub("a", [1, 2])
    core.admit_result(AdmitResult(request_id="a", attempt=1, ok=True, block_table=[0, 1, 2]))
    core.take_outbox()
    sub("b", [3])
    core.submit(
        Submit(request_id="other", prompt_ids=[9] * 12, params=SamplingParams(), arrival=0.0)
    )
    out = core.take_outbox()
    asks = [m.request_id for _, m in out if isinstance(m, km.Admit)]
    assert asks == ["other"]
    core.admit_result(AdmitResult(request_id="other", attempt=1, ok=True, block_table=[5, 6]))
    core.take_outbox()
    core.prefill_done(PrefillDone(request_id="a", attempt=1))
    out = core.take_outbox()
    kinds = [(type(m).__name__, getattr(m, "request_id", "")) for _, m in out]
    # the prefix is cached first, then the held request is admitted (same connection, in order)
    assert kinds[:2] == [("CachePrefix", "a"), ("Admit", "b")]


def test_a_held_request_that_is_aborted_is_not_readmitted():
    core = _core("fcfs", prefix_defer_tokens=8)
    p = list(range(50, 60))
    core.submit(Submit(request_id="a", prompt_ids=p, params=SamplingParams(), arrival=0.0))
    core.admit_result(AdmitResult(request_id="a", attempt=1, ok=True, block_table=[0]))
    core.submit(Submit(request_id="b", prompt_ids=p + [1], params=SamplingParams(), arrival=0.0))
    core.abort("b", "cancel")
    core.take_outbox()
    core.prefill_done(PrefillDone(request_id="a", attempt=1))
    assert not [m for _, m in core.take_outbox() if isinstance(m, km.Admit)]


def test_every_policy_the_config_offers_is_a_queue_and_no_other():
    assert sorted(POLICIES) == sorted(QUEUE_POLICIES)
    for name in QUEUE_POLICIES:
        assert isinstance(make_queue(name), POLICIES[name])
