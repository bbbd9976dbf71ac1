"""BlockManager: admission, refusal with rollback, growth, preemption, completion, accounting."""

from __future__ import annotations

import pytest

from actors.kv import Admitted, BlockManager, Extended, KVError, KVInvariantError, Refused, Shortage

BS = 16


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def admitted(result: Admitted | Refused) -> Admitted:
    assert isinstance(result, Admitted), result
    return result


def snapshot(m: BlockManager) -> tuple[object, ...]:
    nodes = []
    stack = [m.cache.root]
    while stack:
        n = stack.pop()
        nodes.append((n.block, n.lock, n.last_access, n.queued_at))
        stack.extend(n.children.values())
    reqs = {rid: (list(r.blocks), r.lock) for rid, r in m.requests.items()}
    return (m.pool.refs_snapshot(), list(m.pool._free), sorted(nodes), reqs, m.stats())


def test_exact_repeat_reuses_all_full_blocks() -> None:
    m = BlockManager(64, BS)
    prompt = toks(0, 40)
    a = admitted(m.admit("a", prompt, 40))
    assert a.cached_tokens == 0 and len(a.block_table) == 3 and a.new_blocks == a.block_table
    m.finish("a", prompt)
    b = admitted(m.admit("b", prompt, 40))
    assert b.cached_tokens == 32
    assert b.block_table[:2] == a.block_table[:2]
    assert len(b.new_blocks) == 1 and b.new_blocks[0] not in a.block_table[:2]
    m.check()
    s = m.stats()
    assert (s.hit_tokens, s.queried_tokens) == (32, 80)
    assert s.hit_rate == pytest.approx(0.4)


def test_shared_prefix_of_20_tokens_reuses_one_block() -> None:
    m = BlockManager(64, BS)
    base = toks(500, 20)
    a = admitted(m.admit("a", [*base, *toks(0, 30)], 50))
    m.cache_prefix("a", [*base, *toks(0, 30)])  # after prefill, still running
    b = admitted(m.admit("b", [*base, *toks(100, 7)], 27))
    assert b.cached_tokens == 16 and b.block_table[0] == a.block_table[0]
    assert m.pool.ref(a.block_table[0]) == 3  # cache + a + b
    m.check()


def test_divergence_inside_block_is_not_shared() -> None:
    m = BlockManager(64, BS)
    p = toks(0, 33)
    admitted(m.admit("a", p, 33))
    m.finish("a", p)
    q = list(p)
    q[17] = 1000
    b = admitted(m.admit("b", q, 33))
    assert b.cached_tokens == 16
    m.check()


def test_whole_prompt_hit_leaves_one_token_to_compute() -> None:
    m = BlockManager(64, BS)
    p = toks(0, 32)
    admitted(m.admit("a", p, 32))
    m.finish("a", p)
    assert m.peek_match(p) == 16
    b = admitted(m.admit("b", p, 32))
    assert b.cached_tokens == 16 and len(b.new_blocks) == 1


def test_multi_turn_follow_up_hits_generated_tokens() -> None:
    m = BlockManager(64, BS)
    prompt = toks(0, 20)
    admitted(m.admit("a", prompt, m.reserve_for(20, 30)))
    m.extend("a", 50)
    history = prompt + toks(900, 29)  # KV written for 49 tokens (the last output has none)
    m.finish("a", history)
    follow = history + [7, 7, 7, 8, 9]
    assert m.peek_match(follow) == 48
    b = admitted(m.admit("b", follow, 60))
    assert b.cached_tokens == 48
    m.check()


def test_refusal_carries_numbers_and_changes_nothing() -> None:
    m = BlockManager(8, 4)
    p = toks(0, 12)
    admitted(m.admit("a", p, 12))
    m.finish("a", p)  # 3 cached blocks, 5 free
    admitted(m.admit("hold", toks(100, 8), 8))  # 2 in use, 3 free
    before = snapshot(m)
    # reuses 2 cached blocks, needs 6 more; 3 free + 1 evictable (its own prefix is protected)
    r = m.admit("b", [*toks(0, 8), *toks(50, 4)], 32)
    assert isinstance(r, Refused)
    assert (r.blocks_needed, r.blocks_free, r.blocks_evictable) == (6, 3, 1)
    assert not r.fatal
    for number in ("6", "3 free", "1 evictable"):
        assert number in r.reason
    assert snapshot(m) == before
    assert "b" not in m
    m.check()
    assert not m.can_admit([*toks(0, 8), *toks(50, 4)], 32)
    assert m.can_admit([*toks(0, 8), *toks(50, 4)], 20)


def test_fatal_refusal_when_larger_than_pool() -> None:
    m = BlockManager(4, 4)
    r = m.admit("a", toks(0, 5), 17)
    assert isinstance(r, Refused) and r.fatal and "pool has 4" in r.reason
    m.check()


def test_admission_evicts_lru_but_not_its_own_prefix() -> None:
    m = BlockManager(6, 4)
    old, mid = toks(0, 8), toks(100, 8)
    for rid, p in (("old", old), ("mid", mid)):
        admitted(m.admit(rid, p, 8))
        m.finish(rid, p)  # 4 cached, 2 free
    # reuses old[0:4] (protected), needs 3 new: 2 free + evicts 1
    a = admitted(m.admit("x", [*old[:4], 9, 9, 9, 9, 9], 16))
    assert a.cached_tokens == 4
    evicted = a.evicted_blocks
    assert len(evicted) == 1
    assert evicted[0] not in a.block_table[:1]
    # LRU leaf is "old"'s second block (the prefix was just touched); "mid" is newer
    assert m.cache.peek([*old, 1]) == 4 and m.cache.peek([*mid, 1]) == 8
    assert m.stats().evictions == 1
    m.check()


def test_extend_grows_or_reports_shortage_without_change() -> None:
    m = BlockManager(6, 4, mode="on_demand", lookahead_blocks=1)
    assert m.reserve_for(5, 100) == 9
    assert m.reserve_for(5, 2) == 6  # the last of 2 new tokens is never fed back: no K/V
    a = admitted(m.admit("a", toks(0, 5), m.reserve_for(5, 100)))
    assert len(a.block_table) == 3
    assert m.extend("a", 12) == Extended([], [])
    e = m.extend("a", 20)
    assert isinstance(e, Extended) and len(e.new_blocks) == 2
    assert m.block_table("a") == a.block_table + e.new_blocks
    before = snapshot(m)
    s = m.extend("a", 40)
    assert s == Shortage(blocks_needed=5, blocks_free=1, blocks_evictable=0)
    assert "5" in s.reason
    assert snapshot(m) == before
    m.check()


def test_extend_evicts_cache_leaves() -> None:
    m = BlockManager(4, 4)
    admitted(m.admit("c", toks(50, 8), 8))
    m.finish("c", toks(50, 8))
    admitted(m.admit("a", toks(0, 4), 4))
    e = m.extend("a", 12)
    assert isinstance(e, Extended) and len(e.evicted_blocks) == 1 and len(e.new_blocks) == 2
    m.check()


def test_full_mode_reserves_everything() -> None:
    m = BlockManager(64, 16, mode="full")
    assert m.reserve_for(20, 30) == 49  # every token's K/V but the last one generated
    a = admitted(m.admit("a", toks(0, 20), m.reserve_for(20, 30)))
    assert m.capacity("a") == 64 and len(a.block_table) == 4


def test_pick_victim_policies() -> None:
    m = BlockManager(64, 4)
    for rid in ("a", "b", "c"):
        admitted(m.admit(rid, [ord(rid)] * 5, 5))
    assert m.pick_victim() == "c"
    assert m.pick_victim(exclude={"c"}) == "b"
    assert m.pick_victim("priority", {"a": 5, "b": 1, "c": 9}) == "b"
    assert m.pick_victim("priority", {"a": 1, "b": 1, "c": 9}) == "b"  # tie: newest
    assert m.pick_victim("priority", None) == "c"
    assert m.pick_victim("newest", exclude={"a", "b", "c"}) is None
    with pytest.raises(KVError):
        m.pick_victim("oldest")  # type: ignore[arg-type]


def test_release_frees_without_caching_and_counts_preemption() -> None:
    m = BlockManager(16, 4)
    p = toks(0, 9)
    a = admitted(m.admit("a", p, 12))
    freed = m.release("a")
    assert sorted(freed) == sorted(a.block_table)
    assert m.peek_match([*p, 1]) == 0
    assert m.stats().preemptions == 1 and m.pool.num_free == 16
    admitted(m.admit("b", p, 12))
    m.release("b", preempted=False)
    assert m.stats().preemptions == 1
    c = admitted(m.admit("c", p, 12))
    freed = m.release("c", cache=True, token_ids=p)
    assert sorted(freed) == [c.block_table[2]]
    assert m.peek_match([*p, 1]) == 8
    with pytest.raises(KVError):
        m.release("nope")
    m.check()


def test_finish_frees_duplicates_of_cached_blocks() -> None:
    m = BlockManager(16, 4)
    p = toks(0, 9)
    a = admitted(m.admit("a", p, 9))
    b = admitted(m.admit("b", p, 9))  # concurrent: nothing cached yet
    assert b.cached_tokens == 0
    assert m.finish("a", p) == [a.block_table[2]]
    freed = m.finish("b", p)
    assert sorted(freed) == sorted(b.block_table)  # all duplicates or partial
    assert m.cache.num_cached == 2
    s = m.stats()
    assert (s.free, s.cached_only, s.in_use) == (14, 2, 0)
    m.check()


def test_stats_utilization_and_block_states() -> None:
    m = BlockManager(10, 4)
    admitted(m.admit("a", toks(0, 8), 8))
    m.finish("a", toks(0, 8))
    admitted(m.admit("b", toks(0, 9), 12))  # reuses 2 cached blocks, 1 new
    s = m.stats()
    assert (s.free, s.cached_only, s.in_use, s.running) == (7, 0, 3, 1)
    assert s.utilization == pytest.approx(0.3)


def test_contract_errors_raise_without_change() -> None:
    m = BlockManager(16, 4)
    admitted(m.admit("a", toks(0, 9), 12))
    before = snapshot(m)
    with pytest.raises(KVError, match="already admitted"):
        m.admit("a", toks(0, 9), 12)
    with pytest.raises(KVError, match="reserve_tokens"):
        m.admit("b", toks(0, 9), 8)
    with pytest.raises(KVError, match="empty"):
        m.admit("b", [], 4)
    with pytest.raises(KVError, match="exceed"):
        m.finish("a", toks(0, 13))
    with pytest.raises(KVError, match="unknown request"):
        m.extend("zz", 4)
    assert snapshot(m) == before
    with pytest.raises(KVError):
        BlockManager(4, 4, mode="lazy")  # type: ignore[arg-type]


def test_cache_prefix_rejects_tokens_off_the_reused_prefix() -> None:
    m = BlockManager(16, 4)
    admitted(m.admit("a", toks(0, 9), 9))
    m.finish("a", toks(0, 9))
    admitted(m.admit("b", toks(0, 9), 9))  # reuses 2 blocks
    with pytest.raises(KVError, match="do not extend"):
        m.cache_prefix("b", [*toks(0, 4), 7, 7, 7, 7, 1])
    with pytest.raises(KVError, match="do not extend"):
        m.cache_prefix("b", [9, 9, 9, 9])
    m.check()
    assert m.cache_prefix("b", toks(0, 9)) == 0


def test_check_detects_a_leaked_ref() -> None:
    m = BlockManager(8, 4)
    a = admitted(m.admit("a", toks(0, 8), 8))
    m.pool._refs[a.block_table[0]] += 1
    with pytest.raises(KVInvariantError, match="ref 2"):
        m.check()


def test_check_detects_wrong_lock_count() -> None:
    m = BlockManager(8, 4)
    admitted(m.admit("a", toks(0, 8), 8))
    m.finish("a", toks(0, 8))
    node = next(iter(m.cache.root.children.values()))
    node.lock = 1
    with pytest.raises(KVInvariantError, match="lock"):
        m.check()
