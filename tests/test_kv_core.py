"""KVCore: the KV-manager actor's decisions driven with protocol messages, no sockets."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from actors.kv.core import KVCore
from actors.runtime.config import KVConfig
from messages import kv as km
from messages.executor import Extend
from messages.scheduler import AdmitResult, BlocksFreed, GrowthShortage

BS = 4


def make(num_blocks: int = 6, mode: str = "on_demand") -> KVCore:
    cfg = KVConfig(block_size=BS, mode=mode, lookahead_blocks=0)  # type: ignore[arg-type]
    return KVCore(num_blocks, cfg, structlog.get_logger())


def admit(core: KVCore, rid: str, tokens: list[int], reserve: int, attempt: int = 1) -> None:
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
    core.peer_dead("scheduler", "scheduler died")
    s = core.stats(check=True)
    assert s.check_ok and s.running == 0 and s.in_use == 0
    assert core.match(km.MatchQuery(token_lists=[list(range(9))])).cached_tokens == [8]
    core.peer_dead("executor", "executor died")
    assert core.match(km.MatchQuery(token_lists=[list(range(9))])).cached_tokens == [0]
    assert core.stats(check=True).free == 6
