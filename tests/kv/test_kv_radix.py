"""RadixCache: block-aligned prefix matching, insertion, locking and LRU eviction."""

from __future__ import annotations

import pytest

from actors.kv import BlockPool, KVError, RadixCache
from actors.kv.checks import check_tree

BS = 16


def make(num_blocks: int = 64, bs: int = BS) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, bs)


def cache_prompt(pool: BlockPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Allocate blocks as a request would, cache the full ones, drop the request's refs."""
    blocks = pool.allocate(-(-len(tokens) // cache.block_size))
    cache.insert(tokens, blocks)
    pool.free_many(blocks)
    return blocks


def test_exact_repeat_hits_all_full_blocks() -> None:
    pool, cache = make()
    tokens = list(range(40))  # 2 full blocks + 8 tokens
    blocks = cache_prompt(pool, cache, tokens)
    m = cache.match(tokens)
    assert m.blocks == blocks[:2]
    assert m.tokens == 32
    check_tree(cache, [])


def test_shared_prefix_of_20_tokens_reuses_one_block() -> None:
    pool, cache = make()
    base = list(range(100, 120))  # 20 shared tokens
    blocks = cache_prompt(pool, cache, [*base, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    m = cache.match([*base, 50, 51, 52, 53, 54])
    assert m.tokens == 16
    assert m.blocks == [blocks[0]]


def test_divergence_inside_a_block_does_not_share_it() -> None:
    pool, cache = make()
    a = list(range(48))
    blocks = cache_prompt(pool, cache, a)
    b = list(a)
    b[20] = 999  # differs inside block 1
    m = cache.match([*b, 7])
    assert m.blocks == [blocks[0]]
    assert m.tokens == 16
    c = list(a)
    c[0] = 999  # differs in block 0: nothing shared
    assert cache.match(c).tokens == 0


def test_whole_prompt_hit_leaves_one_token_to_compute() -> None:
    pool, cache = make()
    tokens = list(range(32))  # block aligned, fully cached
    blocks = cache_prompt(pool, cache, tokens)
    m = cache.match(tokens)
    assert m.tokens == 16 and m.blocks == [blocks[0]]
    assert cache.peek(tokens) == 16
    assert cache.match(tokens[:17]).tokens == 16
    assert cache.match(tokens[:16]).tokens == 0  # one block prompt: compute it all
    assert cache.match(tokens[:1]).tokens == 0
    assert cache.match([]).tokens == 0
    assert cache.peek([*tokens, 5]) == 32


def test_partial_block_is_never_cached() -> None:
    pool, cache = make()
    blocks = pool.allocate(2)
    assert cache.insert(list(range(20)), blocks) == 1
    assert cache.contains(blocks[0]) and not cache.contains(blocks[1])
    assert pool.ref(blocks[0]) == 2 and pool.ref(blocks[1]) == 1


def test_duplicate_insert_keeps_cached_block() -> None:
    pool, cache = make()
    tokens = list(range(32))
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert cache.insert(tokens, first) == 2
    assert cache.insert(tokens, second) == 0
    assert pool.ref(second[0]) == 1  # untouched: its holder frees it
    assert pool.free_many(second) == second
    assert cache.match([*tokens, 1]).blocks == first
    pool.free_many(first)
    check_tree(cache, [])


def test_insert_under_cached_duplicate_prefix() -> None:
    """A request whose block 0 duplicates a cached one still caches its block 1 under it."""
    pool, cache = make()
    first = pool.allocate(1)
    cache.insert(list(range(16)), first)
    second = pool.allocate(2)
    assert cache.insert(list(range(32)), second) == 1
    assert cache.match([*range(32), 0]).blocks == [first[0], second[1]]


def test_insert_rejects_free_block_and_block_cached_elsewhere() -> None:
    pool, cache = make()
    with pytest.raises(KVError, match="free"):
        cache.insert(list(range(16)), [3])
    assert cache.num_cached == 0
    (b,) = pool.allocate(1)
    cache.insert(list(range(16)), [b])
    c = pool.allocate(1)
    with pytest.raises(KVError, match="another position"):
        cache.insert([*range(100, 116), *range(16)], [c[0], b])
    # the first new node was rolled back
    assert cache.num_cached == 1 and pool.ref(c[0]) == 1
    pool.free_many([b, c[0]])
    check_tree(cache, [])


def test_eviction_is_lru_among_unused_leaves() -> None:
    pool, cache = make()
    a = cache_prompt(pool, cache, [1] * 16)
    b = cache_prompt(pool, cache, [2] * 16)
    c = cache_prompt(pool, cache, [3] * 16)
    cache.match([1] * 17)  # touch a: now most recent
    cache.peek([2] * 17)  # peek does not touch b
    assert cache.evict(1) == b
    assert cache.evict(5) == c + a
    assert cache.num_cached == 0 and pool.num_free == pool.num_blocks
    check_tree(cache, [])


def test_leaf_in_use_is_never_evicted() -> None:
    pool, cache = make()
    a = cache_prompt(pool, cache, [1] * 16)
    b = cache_prompt(pool, cache, [2] * 16)
    node = cache.node_of(a[0])
    assert node is not None
    pool.share(a[0])  # a request uses it
    cache.lock(node)
    assert cache.evictable == 1
    assert cache.evict(10) == b
    assert cache.contains(a[0])
    check_tree(cache, [node])
    cache.unlock(node)
    pool.free(a[0])
    assert cache.evict(10) == a


def test_internal_node_becomes_evictable_once_children_are_gone() -> None:
    pool, cache = make()
    parent = cache_prompt(pool, cache, list(range(32)))  # blocks p0 -> p1
    other = cache_prompt(pool, cache, [*range(16), *range(50, 66)])  # p0 -> o1 (dup p0 freed)
    leaf_b = cache.node_of(other[1])
    assert leaf_b is not None
    assert cache.num_cached == 3 and cache.evictable == 3
    # p0 is internal: its leaves go first (p1 is the oldest), p0 only once both are gone
    assert cache.evict(1) == [parent[1]]
    assert cache.contains(parent[0])
    assert cache.evict(1) == [other[1]]
    assert cache.evict(1) == [parent[0]]
    check_tree(cache, [])


def test_internal_node_with_locked_child_is_not_evictable() -> None:
    pool, cache = make()
    blocks = cache_prompt(pool, cache, list(range(32)))
    leaf = cache.node_of(blocks[1])
    assert leaf is not None
    pool.share(blocks[1])
    cache.lock(leaf)  # locks the parent too
    assert cache.evictable == 0
    assert cache.evict(5) == []
    cache.unlock(leaf)
    pool.free(blocks[1])
    assert cache.evictable == 2
    assert cache.evict(5) == [blocks[1], blocks[0]]


def test_unlock_of_unlocked_node_raises() -> None:
    pool, cache = make()
    blocks = cache_prompt(pool, cache, list(range(16)))
    node = cache.node_of(blocks[0])
    assert node is not None
    with pytest.raises(KVError):
        cache.unlock(node)


def test_heap_stays_bounded_under_repeated_touches() -> None:
    pool, cache = make(num_blocks=8)
    cache_prompt(pool, cache, [1] * 16)
    for _ in range(5000):
        cache.match([1] * 17)
    assert len(cache._heap) <= 2 * cache.num_cached + 1025
    check_tree(cache, [])
