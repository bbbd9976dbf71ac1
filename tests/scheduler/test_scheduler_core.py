"""Scheduler policy as a pure state machine: no sockets, no model."""

from __future__ import annotations

from structlog.testing import capture_logs

from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.core import SchedulerCore
from messages import executor as xm
from messages import kv as km
from messages import tokenizer as tm
from messages.common import SamplingParams
from messages.scheduler import AdmitResult, BlocksFreed, GrowthShortage, RequestDone, Submit


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def make(max_waiting=100, max_batch=8, mode="on_demand", max_preemptions=3):
    import structlog

    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(
            max_waiting=max_waiting, max_batch_size=max_batch, max_preemptions=max_preemptions
        ),
        KVConfig(mode=mode, block_size=4, lookahead_blocks=1),
        structlog.get_logger(),
        clock,
    )
    return core, clock


def submit(core, rid, n=6, max_tokens=8):
    core.submit(
        Submit(
            request_id=rid,
            prompt_ids=list(range(1, n + 1)),
            params=SamplingParams(max_tokens=max_tokens),
            arrival=0.0,
        )
    )


def sent(core, peer=None, kind=None):
    return [
        m
        for p, m in core.take_outbox()
        if (peer is None or p == peer) and (kind is None or isinstance(m, kind))
    ]


def admit_ok(core, rid, attempt=1, table=(0, 1, 2)):
    core.admit_result(
        AdmitResult(request_id=rid, attempt=attempt, ok=True, block_table=list(table))
    )


def test_fcfs_admits_one_at_a_time_in_arrival_order():
    core, _ = make()
    submit(core, "a")
    submit(core, "b")
    [ask] = sent(core, "kv_manager", km.Admit)
    assert ask.request_id == "a" and ask.reserve_tokens == 6 + 4  # prompt + one lookahead block
    admit_ok(core, "a")
    out = core.take_outbox()
    run = [m for p, m in out if isinstance(m, xm.Run)]
    asks = [m for p, m in out if isinstance(m, km.Admit)]
    assert run[0].request_id == "a" and run[0].block_table == [0, 1, 2]
    assert asks[0].request_id == "b"


def test_a_run_says_more_while_the_next_admission_is_already_out():
    """A burst: each run but the last tells the executor another one follows (x_run.more), so
    an idle executor can take them all into its first step."""
    core, _ = make()
    for rid in "abc":
        submit(core, rid)
    core.take_outbox()
    more = {}
    for rid in "abc":
        admit_ok(core, rid)
        (run,) = sent(core, "executor", xm.Run)
        more[rid] = run.more
    assert more == {"a": True, "b": True, "c": False}
    submit(core, "d")  # alone: its run says no more
    core.take_outbox()
    admit_ok(core, "d")
    assert [r.more for r in sent(core, "executor", xm.Run)] == [False]


def test_a_run_says_more_when_the_burst_arrived_before_it_left():
    """The first request of a burst is granted before the rest reach the queue, but they are
    submitted before its run leaves (the actor handles what is waiting first): the run says
    more, so the executor does not step that request alone."""
    core, _ = make()
    submit(core, "a")
    core.take_outbox()
    admit_ok(core, "a")  # nothing else queued yet
    submit(core, "b")  # waiting in the inbox behind the grant
    out = core.take_outbox()
    [run] = [m for _, m in out if isinstance(m, xm.Run)]
    [ask] = [m for _, m in out if isinstance(m, km.Admit)]
    assert run.request_id == "a" and run.more and ask.request_id == "b"
    admit_ok(core, "b")  # the last of the burst
    assert [r.more for r in sent(core, "executor", xm.Run)] == [False]


def test_full_mode_reserves_prompt_plus_max_tokens_but_the_last():
    core, _ = make(mode="full")
    submit(core, "a", n=6, max_tokens=8)
    [ask] = sent(core, "kv_manager", km.Admit)
    assert ask.reserve_tokens == 13  # the last generated token is never fed back: no K/V


def test_refusal_waits_for_freed_blocks_then_retries():
    core, _ = make()
    submit(core, "a")
    sent(core)
    admit_ok(core, "a")
    sent(core)  # admit for nothing else
    submit(core, "b")
    sent(core)
    with capture_logs() as logs:
        core.admit_result(
            AdmitResult(
                request_id="b",
                attempt=1,
                ok=False,
                reason="short",
                blocks_needed=3,
                blocks_free=1,
                blocks_evictable=0,
            )
        )
    refused = [e for e in logs if e["event"] == "admission.refused"]
    assert refused and refused[0]["blocks_needed"] == 3 and refused[0]["blocks_free"] == 1
    assert not sent(core, "kv_manager", km.Admit)  # parked, no busy loop
    core.blocks_freed(BlocksFreed(free=5, evictable=0))
    [ask] = sent(core, "kv_manager", km.Admit)
    assert ask.request_id == "b" and ask.attempt == 2


def test_refusal_with_nothing_running_fails_the_request():
    core, _ = make()
    submit(core, "big")
    sent(core)
    core.admit_result(
        AdmitResult(request_id="big", attempt=1, ok=False, reason="pool too small", fatal=True)
    )
    [fail] = sent(core, "tokenizer", tm.RequestFailed)
    assert fail.code == "too_long" and "pool too small" in fail.message


def test_bounded_queue_answers_overloaded():
    core, _ = make(max_waiting=2)
    for rid in ("a", "b", "c"):
        submit(core, rid)
    fails = sent(core, "tokenizer", tm.RequestFailed)
    assert [f.request_id for f in fails] == ["c"] and fails[0].code == "overloaded"


def test_shortage_preempts_newest_and_requeues_it_first_with_its_tokens():
    core, _ = make()
    for rid in ("a", "b"):
        submit(core, rid)
    admit_ok(core, "a")
    admit_ok(core, "b")
    submit(core, "c")
    sent(core)
    core.shortage(
        GrowthShortage(
            request_id="a", attempt=1, blocks_needed=1, blocks_free=0, blocks_evictable=0
        )
    )
    [pre] = sent(core, "executor", xm.Preempt)
    assert pre.request_id == "b"  # newest admitted
    core.request_done(
        RequestDone(request_id="b", attempt=1, status="preempted", output_ids=[50, 51])
    )
    out = core.take_outbox()
    assert any(isinstance(m, km.Release) and m.request_id == "b" for _, m in out)
    assert not [m for _, m in out if isinstance(m, km.Admit)]  # c's admission is still out
    assert core.queue.peek().request_id == "b"
    assert core.requests["b"].tokens_now()[-2:] == [50, 51]
    submit(core, "d")  # newer than b's requeue
    # once c's admission resolves, b (requeued at the front) is offered before d, with its tokens
    admit_ok(core, "c")
    [ask] = sent(core, "kv_manager", km.Admit)
    assert ask.request_id == "b" and ask.attempt == 2
    assert ask.token_ids == [1, 2, 3, 4, 5, 6, 50, 51]


def test_abort_while_admitting_releases_the_granted_blocks():
    core, _ = make()
    submit(core, "a")
    sent(core)
    core.abort("a", "cancel")
    admit_ok(core, "a")
    out = core.take_outbox()
    assert [type(m) for _, m in out] == [km.Release]
    assert "a" not in core.requests


def test_finished_request_is_cached_by_the_kv_manager():
    core, _ = make()
    submit(core, "a")
    admit_ok(core, "a")
    sent(core)
    core.request_done(
        RequestDone(
            request_id="a",
            attempt=1,
            status="finished",
            kv_token_ids=[1, 2, 3],
            output_ids=[9],
            finish_reason="stop",
        )
    )
    [fin] = sent(core, "kv_manager", km.Finish)
    assert fin.token_ids == [1, 2, 3]
    assert not core.requests and not core.running


def test_repeatedly_preempted_request_gets_a_full_reservation():
    core, _ = make(max_preemptions=1)
    submit(core, "a", n=6, max_tokens=8)
    for attempt in (1, 2):
        admit_ok(core, "a", attempt=attempt)
        sent(core)
        core.shortage(
            GrowthShortage(
                request_id="a", attempt=attempt, blocks_needed=1, blocks_free=0, blocks_evictable=0
            )
        )
        core.request_done(
            RequestDone(request_id="a", attempt=attempt, status="preempted", output_ids=[7])
        )
    asks = sent(core, "kv_manager", km.Admit)
    assert asks[-1].attempt == 3
    # prompt+2 outputs, plus the 6 tokens still allowed but the last (never fed back)
    assert asks[-1].reserve_tokens == 8 + 5


def test_kv_manager_death_keeps_running_requests_and_rebuilds_its_successor():
    from messages.scheduler import KVRebuilt

    core, _ = make()
    for rid in ("a", "b", "c"):
        submit(core, rid)
    admit_ok(core, "a", table=(0, 1))
    admit_ok(core, "b", table=(2, 3))  # "c" is being admitted when the KV manager dies
    sent(core)
    with capture_logs() as logs:
        core.kv_lost("kv_manager died")
    [ev] = [e for e in logs if e["event"] == "scheduler.kv_lost"]
    assert ev["running"] == 2 and ev["requeued"] == "c"
    assert set(core.running) == {"a", "b"} and "c" in core.queue  # nobody failed
    # while it is down: nothing goes to the KV manager, nothing is admitted, ends still count
    core.request_done(
        RequestDone(request_id="a", attempt=1, status="finished", kv_token_ids=[1, 2, 3])
    )
    submit(core, "d")
    out = core.take_outbox()
    assert not [m for p, m in out if p == "kv_manager"] and not core.frees_in_flight
    assert [m.request_id for p, m in out if isinstance(m, xm.Run)] == []
    assert set(core.running) == {"b"}
    # its successor answers: the rebuild lists who holds blocks, as admitted
    core.kv_back(executor_alive=True)
    [rebuild] = sent(core, "kv_manager", km.Rebuild)
    assert [(h.request_id, h.attempt, h.block_table) for h in rebuild.running] == [("b", 1, [2, 3])]
    assert rebuild.executor_alive
    core.abort("b", "cancel")  # while it rebuilds: sent (the successor defers it), no admission
    out = core.take_outbox()
    assert [type(m) for p, m in out] == [xm.Stop] and not core.kv_serving
    core.kv_rebuilt(KVRebuilt(ok=True, requests=1, in_use=2, free=10, num_blocks=12))
    [ask] = sent(core, "kv_manager", km.Admit)
    assert ask.request_id == "c" and ask.attempt == 2  # the lost admission, first


def test_a_failed_kv_rebuild_resumes_every_request():
    from messages.scheduler import KVRebuilt

    core, _ = make()
    submit(core, "a")
    admit_ok(core, "a")
    core.kv_lost("kv_manager died")
    core.kv_back(executor_alive=True)
    sent(core)
    core.kv_rebuilt(KVRebuilt(ok=False, reason="unknown block 99"))
    failed = sent(core, "tokenizer", tm.RequestFailed)
    assert [(f.request_id, f.code) for f in failed] == [("a", "actor_dead")]
    assert "could not rebuild" in failed[0].message and not core.requests and core.kv_serving


def test_a_restarted_scheduler_reconciles_from_its_peers_nothing_twice_nothing_forgotten():
    from messages.scheduler import ExecutorHeld, KVHeld, LiveRequests, RunningAttempt

    core, _ = make()

    def live(rid, out=()):
        p = SamplingParams(max_tokens=8)
        return Submit(
            request_id=rid, prompt_ids=[1, 2, 3], params=p, arrival=0.0, output_ids=list(out)
        )

    front = LiveRequests(
        requests=[live("a", [7, 8, 9]), live("b", [5]), live("c"), live("d", [4] * 8)]
    )
    ex = ExecutorHeld(
        running=[RunningAttempt("a", 2, 2), RunningAttempt("x", 1, 0)],  # x: cancelled since
        ended=[
            RequestDone(request_id="b", attempt=1, status="preempted", output_ids=[5]),
            RequestDone(request_id="d", attempt=1, status="finished", kv_token_ids=[1, 2, 3, 4]),
        ],
    )
    kv = KVHeld(
        allocations=[
            km.HeldBlocks("a", 2, [0, 1, 2]),
            km.HeldBlocks("b", 1, [3]),
            km.HeldBlocks("d", 1, [4, 5]),
            km.HeldBlocks("x", 1, [6]),
            km.HeldBlocks("z", 3, [7]),  # admitted by the dead scheduler, its x_run lost
        ]
    )
    with capture_logs() as logs:
        core.reconcile(front, ex, kv)
    [ev] = [e for e in logs if e["event"] == "scheduler.reconciled"]
    assert ev == {
        **ev,
        **dict(running=1, queued=2, resumed=1, stopped=1, freed=3, ended=1),
    }
    out = core.take_outbox()
    to_kv = [(type(m).__name__, m.request_id, m.attempt) for p, m in out if p == "kv_manager"]
    assert ("Release", "b", 1) in to_kv and ("Finish", "d", 1) in to_kv
    assert ("Release", "z", 3) in to_kv
    assert not any(r == "a" for _, r, _ in to_kv)  # a runs on, untouched
    assert [(m.request_id, m.attempt) for p, m in out if isinstance(m, xm.Stop)] == [("x", 1)]
    a = core.running["a"]
    assert a.status.holds_blocks and a.attempt == 2 and a.output_ids == [7, 8]
    assert a.block_table == [0, 1, 2] and "d" not in core.requests
    assert [r.request_id for r in core.queue] == ["b", "c"]
    assert core.requests["b"].output_ids == [5]
    assert ("Admit", "b", 2) in to_kv  # offered again, past the attempt that ran
    # x's stop is answered: its blocks go back, nothing else changes
    core.request_done(RequestDone(request_id="x", attempt=1, status="aborted"))
    assert ("kv_manager", "x") in [(p, m.request_id) for p, m in core.take_outbox()]
    assert "x" not in core.requests
    # a finishing normally is a normal end: its blocks are cached
    core.request_done(
        RequestDone(request_id="a", attempt=2, status="finished", kv_token_ids=[1, 2, 3, 7, 8])
    )
    finish = [m for p, m in core.take_outbox() if isinstance(m, km.Finish)]
    assert [m.request_id for m in finish] == ["a"]


def test_a_submit_delivered_after_its_reconciliation_is_not_a_second_request():
    from messages.scheduler import ExecutorHeld, KVHeld, LiveRequests

    core, _ = make()
    sub = Submit(request_id="r", prompt_ids=[1, 2], params=SamplingParams(max_tokens=4), arrival=0)
    core.reconcile(
        LiveRequests(requests=[sub]), ExecutorHeld(running=[], ended=[]), KVHeld(allocations=[])
    )
    sent(core)
    core.submit(sub)  # the copy that went to the dead scheduler, delivered to its successor
    assert not sent(core, "tokenizer") and list(core.requests) == ["r"]
    core.submit(Submit(request_id="s", prompt_ids=[3], params=SamplingParams(), arrival=0))
    assert "s" in core.requests
