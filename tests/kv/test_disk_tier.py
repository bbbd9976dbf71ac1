"""The disk tier's parts, driven directly: the KV manager's index and decisions (what an
admission loads, what is written behind and pinned, what the byte bound deletes, salts apart)
and the executor's block files (checked on read; one live instance per directory)."""

from __future__ import annotations

import pytest
import structlog
from structlog.testing import capture_logs

from actors.kv.core import KVManagerCore
from actors.kv.disk_tier import DiskTier
from actors.runtime.config import KVConfig
from gpu.disk.store import BadBlock, DiskStore, DiskTierInUse
from messages import executor as xm
from messages import kv as km
from messages.scheduler import AdmitResult, BlocksFreed

BS = 4
BB = 100  # bytes a block file


def _core(num_blocks: int = 32, capacity: int = 10**6) -> KVManagerCore:
    core = KVManagerCore(
        num_blocks, KVConfig(block_size=BS, disk_bytes=capacity), structlog.get_logger()
    )
    core.handle(km.DiskTier(fingerprint="fp", block_bytes=BB, keys=[]))
    return core


def _out(core: KVManagerCore, kind: type) -> list:
    return [m for _, m in core.take_outbox() if isinstance(m, kind)]


def _admit(core: KVManagerCore, rid: str, tokens: list[int], salt: str = "") -> AdmitResult:
    core.handle(km.Admit(rid, 1, tokens, len(tokens) + 4, cache_salt=salt))
    [res] = [m for _, m in core.take_outbox() if isinstance(m, AdmitResult)]
    return res


def _on_disk(core: KVManagerCore, prompt: list[int], salt: str = "") -> xm.DiskSave:
    """``prompt`` served and finished, its blocks written behind (the executor's answer given):
    the save the KV manager asked for."""
    _admit(core, "a", prompt, salt)
    core.handle(km.Finish("a", 1, prompt))
    [save] = _out(core, xm.DiskSave)
    core.handle(km.DiskSaved(save.save_id, save.keys))
    core.take_outbox()
    return save


def test_finished_blocks_are_written_behind_pinned_and_loaded_back():
    core = _core()
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    _admit(core, "a", prompt)
    core.handle(km.Finish("a", 1, prompt))
    [save] = _out(core, xm.DiskSave)
    assert len(save.keys) == 3
    # pinned until written: the cached blocks cannot be evicted
    assert core.mgr.cache.evictable == 0
    core.handle(km.DiskSaved(save.save_id, save.keys))
    assert core.mgr.cache.evictable == 3
    [freed] = _out(core, BlocksFreed)
    assert not freed.answer  # an unpin, not the answer to a release
    # the pool forgets them (as a restart would): the same prompt now loads them from disk
    core.mgr.evict(3)
    res = _admit(core, "b", prompt)
    assert res.cached_tokens == 12 and res.load_keys == save.keys
    assert res.load_blocks == res.block_table[:3]
    assert core.stats(check=True).disk_hit_tokens == 12


def test_the_pool_prefix_comes_first_then_disk_continues_it():
    core = _core()
    prompt = list(range(1, 18))
    save = _on_disk(core, prompt)
    core.mgr.evict(2)  # the two deepest blocks leave the pool; the first two stay
    res = _admit(core, "b", prompt)
    assert res.cached_tokens == 16
    assert res.load_keys == save.keys[2:4]  # after the two blocks the pool kept


def test_a_salt_shares_nothing_with_another_in_either_tier():
    core = _core()
    prompt = list(range(1, 14))
    _on_disk(core, prompt, "alice")
    assert _admit(core, "b", prompt, salt="bob").cached_tokens == 0
    assert _admit(core, "c", prompt).cached_tokens == 0
    assert _admit(core, "d", prompt, salt="alice").cached_tokens == 12
    # the queries a policy makes (lpm) see each request's own salt's cache
    ask = km.MatchQuery(token_lists=[prompt] * 3, salts=["alice", "bob", ""])
    assert core.handle(ask).cached_tokens == [12, 0, 0]


def test_the_byte_bound_deletes_least_recently_used_files_first():
    tier, drop = DiskTier.found(5 * BB, "fp", BB, ["k1", "k2", "k3", "k4", "k5", "k6"])
    assert drop == ["k1"]  # a smaller bound than what was found
    assert tier.hits(["k2", "x"], 0) == 1  # k2 is now the most recent
    drop, save = tier.plan_save(["k3", "n1", "n2"])
    assert drop == ["k4", "k5"] and save == ["n1", "n2"]  # k2, k3 (touched) and k6 stay
    tier.started(save, pin=None)
    assert tier.bytes == 5 * BB
    # a chain longer than the bound writes only its first blocks, never deleting its own
    tier2 = DiskTier(2 * BB, "fp", BB)
    assert tier2.plan_save(["a", "b", "c"]) == ([], ["a", "b"])


def test_refused_while_blocks_are_pinned_is_told_to_wait():
    core = _core(num_blocks=5)
    prompt = list(range(1, 14))  # 3 full blocks cached, of the 5 it held
    _admit(core, "a", prompt)
    core.handle(km.Finish("a", 1, prompt))
    [save] = _out(core, xm.DiskSave)
    core.handle(km.Admit("b", 1, [7] * 13, 17))  # 5 blocks: 2 free, 3 pinned
    [refusal] = [m for _, m in core.take_outbox() if isinstance(m, AdmitResult)]
    assert not refusal.ok and refusal.pinned
    core.handle(km.DiskSaved(save.save_id, save.keys))
    assert _admit(core, "b", [7] * 13).ok


def test_block_files_are_checked(tmp_path):
    store = DiskStore.open(tmp_path, "ab" * 16)
    key = "cd" * 16
    payload = bytes(range(256)) * 4
    store.write(key, payload)
    assert store.read(key, len(payload)) == payload
    with pytest.raises(BadBlock, match="length"):
        store.read(key, len(payload) + 4)  # another layout's size
    store.write(key, payload)
    path = store.path(key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BadBlock, match="checksum"):
        store.read(key, len(payload))
    assert not path.exists()  # dropped
    store.write(key, payload)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(BadBlock, match="length"):
        store.read(key, len(payload))
    with pytest.raises(BadBlock, match="missing"):
        store.read(key, len(payload))
    store.close()


def test_another_models_file_is_refused(tmp_path):
    mine = DiskStore.open(tmp_path, "01" * 16)
    theirs = DiskStore.open(tmp_path, "02" * 16)
    key = "ee" * 16
    theirs.write(key, b"x" * 64)
    mine.path(key).write_bytes(theirs.path(key).read_bytes())
    with pytest.raises(BadBlock, match="another model"):
        mine.read(key, 64)
    mine.close()
    theirs.close()


def test_one_live_instance_per_directory(tmp_path):
    first = DiskStore.open(tmp_path, "ab" * 16)
    with pytest.raises(DiskTierInUse, match="in use by another minirt instance"):
        DiskStore.open(tmp_path, "ab" * 16)
    first.close()
    DiskStore.open(tmp_path, "ab" * 16).close()  # released with its holder


def test_a_load_that_costs_more_than_computing_is_computed():
    core = _core()
    prompt = list(range(1, 15))
    save = _on_disk(core, prompt)
    core.mgr.evict(3)
    ask = km.MatchQuery(token_lists=[prompt])
    assert core.handle(ask).cached_tokens == [12]  # unmeasured: a hit counts in full
    # reading a block costs a quarter of computing its 4 tokens: a hit saves 3/4 of them
    core.handle(km.DiskRates(load_s=0.001, prefill_s=0.001))
    assert core.handle(ask).cached_tokens == [12]  # one load is no rate yet
    core.handle(km.DiskRates(load_s=0.001, prefill_s=0.001))
    assert core.handle(ask).cached_tokens == [9]
    assert _admit(core, "b", prompt).load_keys == save.keys
    core.handle(km.Release("b", 1))
    core.take_outbox()
    # a disk slower than the compute: the prefix is computed, and the queries count nothing
    for _ in range(6):  # (a moving average: one slow read does not decide)
        core.handle(km.DiskRates(load_s=0.01, prefill_s=0.001))
    assert core.handle(ask).cached_tokens == [0]
    with capture_logs() as logs:
        res = _admit(core, "c", prompt)
    assert res.cached_tokens == 0 and not res.load_keys
    assert [e["blocks"] for e in logs if e["event"] == "kv.disk_skipped"] == [3]
