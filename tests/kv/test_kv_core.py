"""KVManagerCore: the KV-manager actor's decisions driven with protocol messages, no sockets."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from actors.kv.core import KVManagerCore
from actors.runtime.config import KVConfig
from messages import kv as km
from messages.common import Reconcile
from messages.executor import Extend
from messages.scheduler import AdmitResult, BlocksFreed, GrowthShortage, KVHeld, KVRebuilt

BS = 4


def make(num_blocks: int = 6, mode: str = "on_demand") -> KVManagerCore:
    cfg = KVConfig(block_size=BS, mode=mode, lookahead_blocks=0)  # type: ignore[arg-type]
    return KVManagerCore(num_blocks, cfg, structlog.get_logger())


def admit(core: KVManagerCore, rid: str, tokens: list[int], reserve: int, attempt: int = 1) -> None:
    core.admit(km.Admit(request_id=rid, attempt=attempt, token_ids=tokens, reserve_tokens=reserve))


def test_refusal_names_the_numbers_and_changes_nothing():
    core = make(num_blocks=4)
    admit(core, "a", list(range(8)), 8)  # 2 blocks
    core.take_outbox()
    with capture_logs() as logs:
        admit(core, "b", list(range(100, 112)), 12)  # 3 blocks, 2 free
    [(peer, res)] = core.take_outbox()
    assert peer == "scheduler" and isinstance(res, AdmitResult) and not res.ok
    assert (res.blocks_needed, res.blocks_free, res.blocks_evictable, res.fatal) == (3, 2, 0, False)
    [ev] = [e for e in logs if e["event"] == "kv.refused"]
    assert ev["blocks_needed"] == 3 and ev["request_id"] == "b"
    assert "b" not in core.mgr and core.mgr.stats().free == 2
    admit(core, "huge", list(range(40)), 40)  # 10 blocks > the whole pool
    [(_, res)] = core.take_outbox()
    assert not res.ok and res.fatal


def test_shortage_is_reported_then_growth_is_granted_when_blocks_come_back():
    core = make(num_blocks=4)
    admit(core, "a", list(range(8)), 8)
    admit(core, "b", list(range(50, 58)), 8)
    core.take_outbox()
    core.grow(km.Grow(request_id="a", attempt=1, total_tokens=9))  # needs a third block
    [(peer, short)] = core.take_outbox()
    assert peer == "scheduler" and isinstance(short, GrowthShortage)
    assert (short.request_id, short.blocks_needed, short.blocks_free) == ("a", 1, 0)
    core.leave(km.Release(request_id="b", attempt=1, reason="preempted"))
    out = core.take_outbox()
    grants = [m for p, m in out if p == "executor" and isinstance(m, Extend)]
    assert [(g.request_id, g.attempt, len(g.blocks)) for g in grants] == [("a", 1, 1)]
    assert isinstance(out[-1][1], BlocksFreed) and out[-1][0] == "scheduler"
    assert core.mgr.stats().preemptions == 1
    core.mgr.check()


def test_stale_attempts_are_ignored_but_every_leave_is_answered():
    core = make()
    admit(core, "a", list(range(8)), 8, attempt=2)
    core.take_outbox()
    core.grow(km.Grow(request_id="a", attempt=1, total_tokens=20))
    core.leave(km.Release(request_id="a", attempt=1))
    out = core.take_outbox()
    assert [type(m) for _, m in out] == [BlocksFreed]  # answered, nothing grown or freed
    assert core.mgr.block_table("a") and core.mgr.stats().in_use == 2
    core.leave(km.Finish(request_id="a", attempt=2, token_ids=list(range(8))))
    [(_, freed)] = core.take_outbox()
    assert isinstance(freed, BlocksFreed) and freed.in_use == 0
    assert core.match(km.MatchQuery(token_lists=[list(range(9))])).cached_tokens == [8]


def test_executor_death_empties_the_cache_other_deaths_keep_it():
    core = make()
    admit(core, "a", list(range(8)), 8)
    core.leave(km.Finish(request_id="a", attempt=1, token_ids=list(range(8))))
    admit(core, "b", list(range(100, 104)), 4)
    core.peer_dead("scheduler", "scheduler died")  # kept for its successor's reconciliation
    held = core.handle(Reconcile())
    assert isinstance(held, KVHeld)
    assert [(h.request_id, h.attempt) for h in held.allocations] == [("b", 1)]
    core.peer_dead("tokenizer", "tokenizer died")  # the scheduler fails every request
    s = core.stats(check=True)
    assert s.check_ok and s.running == 0 and s.in_use == 0
    assert core.match(km.MatchQuery(token_lists=[list(range(9))])).cached_tokens == [8]
    core.peer_dead("executor", "executor died")
    assert core.match(km.MatchQuery(token_lists=[list(range(9))])).cached_tokens == [0]
    assert core.stats(check=True).free == 6


def _prefix_shared_pool() -> tuple[KVManagerCore, list[int], list[int]]:
    """'a' finished and cached 2 prompt blocks; 'b' and 'c' run on them, 'b' grew one block."""
    core = make(num_blocks=12)
    prompt = list(range(8))
    admit(core, "a", prompt, 8)
    core.leave(km.Finish(request_id="a", attempt=1, token_ids=prompt))
    admit(core, "b", prompt + [50, 51], 10)
    admit(core, "c", prompt + [60], 9, attempt=2)
    core.grow(km.Grow(request_id="b", attempt=1, total_tokens=13))
    core.take_outbox()
    return core, core.mgr.block_table("b"), core.mgr.block_table("c")


def test_a_restarted_kv_manager_rebuilds_the_running_requests_blocks_from_its_peers():
    _, b_table, c_table = _prefix_shared_pool()
    assert b_table[:2] == c_table[:2]  # the shared cached prefix
    new = make(num_blocks=12)  # the successor: empty
    with capture_logs() as logs:
        # the executor reports first (b grown, c asking for one more block) ...
        held = [
            km.HeldBlocks("b", 1, b_table),
            km.HeldBlocks("c", 2, c_table, want_tokens=13),
            km.HeldBlocks("gone", 1, [11]),  # ended at the scheduler meanwhile: not rebuilt
        ]
        new.handle(km.Holding(requests=held))
        assert new.rebuilding is not None and not new.take_outbox()
        new.handle(km.Finish(request_id="b", attempt=1, token_ids=list(range(8)) + [50, 51]))
        assert "b" not in new.mgr  # waits for the rebuild
        # ... then the scheduler: b and c hold blocks (b with the table it was admitted with)
        admitted_b = km.HeldBlocks("b", 1, b_table[:3])
        new.handle(km.Rebuild(running=[admitted_b, km.HeldBlocks("c", 2, c_table)]))
    out = new.take_outbox()
    rebuilt = [m for p, m in out if isinstance(m, KVRebuilt)]
    assert len(rebuilt) == 1 and rebuilt[0].ok and rebuilt[0].requests == 2
    [ev] = [e for e in logs if e["event"] == "kv.rebuilt"]
    assert ev["from_executor"] == 2 and ev["cache_dropped"] and ev["deferred"] == 1
    # c's growth, asked of the dead KV manager, was granted by its successor
    grants = [m for p, m in out if p == "executor" and isinstance(m, Extend)]
    assert [(g.request_id, g.attempt, len(g.blocks)) for g in grants] == [("c", 2, 1)]
    assert not set(grants[0].blocks) & set(b_table + c_table)
    # the deferred finish of b ran after the rebuild: only c holds blocks; b shared its prefix
    # with c, so it cached nothing (the cache holds a request's blocks only along its lock)
    assert "b" not in new.mgr and new.mgr.block_table("c") == c_table + grants[0].blocks
    assert new.mgr.pool.ref(c_table[0]) == 1 and new.mgr.stats().cached == 0
    assert new.mgr.stats().in_use == len(c_table) + 1
    new.mgr.check()
    new.leave(km.Release(request_id="c", attempt=2))
    s = new.mgr.stats()
    assert s.in_use == 0 and s.free + s.cached_only == 12
    new.mgr.check()


def test_a_rebuild_that_cannot_fit_or_loses_a_peer_tells_the_scheduler():
    core = make(num_blocks=4)
    core.handle(km.Rebuild(running=[km.HeldBlocks("x", 1, [2, 9])], executor_alive=False))
    [(peer, msg)] = core.take_outbox()
    assert peer == "scheduler" and isinstance(msg, KVRebuilt) and not msg.ok
    assert "unknown block 9" in msg.reason and "x" not in core.mgr
    core.handle(km.Rebuild(running=[km.HeldBlocks("x", 1, [2])]))  # waits for the executor
    assert not core.take_outbox()
    core.peer_dead("executor", "executor died")
    [(peer, msg)] = core.take_outbox()
    assert isinstance(msg, KVRebuilt) and not msg.ok and "executor died" in msg.reason
    assert core.rebuilding is None and core.mgr.stats().in_use == 0


def test_a_rebuilt_request_of_its_own_blocks_fills_the_new_cache_when_it_finishes():
    core = make(num_blocks=8)
    core.handle(km.Rebuild(running=[km.HeldBlocks("x", 3, [5, 2, 7])], executor_alive=False))
    assert core.take_outbox()[0][1].ok
    core.handle(km.Finish(request_id="x", attempt=3, token_ids=list(range(10))))
    assert core.mgr.stats().cached == 2  # its two full blocks
    core.mgr.check()
    admit(core, "y", list(range(8)) + [99], 9)
    [(_, res)] = core.take_outbox()[-1:]
    assert res.ok and res.cached_tokens == 8 and res.block_table[:2] == [5, 2]
