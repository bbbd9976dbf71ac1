"""The full invariant check of a BlockManager (O(blocks + nodes + heap)); raises KVInvariantError.

Every block is exactly one of: free (ref 0, on the free list), cached only (ref 1, in the
tree), or used by requests (ref = cached + number of tables holding it). The tree's links,
depths, keys, block ownership, lock counts, evictable count and LRU heap are consistent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from actors.kv.radix_cache import RadixCache, RadixNode
from actors.shared.errors import KVInvariantError

if TYPE_CHECKING:
    from actors.kv.block_pool import BlockPool


def _fail(msg: str) -> None:
    raise KVInvariantError(msg)


def check_tree(cache: RadixCache, lock_nodes: list[RadixNode]) -> list[RadixNode]:
    """Check the radix tree against ``lock_nodes`` (one entry per lock holder); returns its
    nodes (root excluded)."""
    bs = cache.block_size
    expected_lock: dict[int, int] = {}
    for node in lock_nodes:
        cur: RadixNode | None = node
        while cur is not None and cur is not cache.root:
            expected_lock[id(cur)] = expected_lock.get(id(cur), 0) + 1
            cur = cur.parent
        if cur is None:
            _fail(f"a lock is held on detached node of block {node.block}")
    live = {(s, nid) for s, nid, n in cache._heap if n.queued_at == s and n.parent is not None}
    refs = cache.pool._refs
    nodes: list[RadixNode] = []
    seen_blocks: set[int] = set()
    stack = [cache.root]
    while stack:
        parent = stack.pop()
        for key, node in parent.children.items():
            b = node.block
            where = f"node of block {b} at depth {node.depth}"
            if node.parent is not parent or node.key != key:
                _fail(f"{where}: parent/child link broken")
            if len(key) != bs:
                _fail(f"{where}: key has {len(key)} tokens, block size is {bs}")
            if node.depth != parent.depth + 1:
                _fail(f"{where}: depth {node.depth} under parent depth {parent.depth}")
            if b in seen_blocks:
                _fail(f"block {b} is cached twice")
            seen_blocks.add(b)
            if cache.node_of(b) is not node:
                _fail(f"{where}: block index does not point at it")
            if refs[b] < 1:
                _fail(f"{where}: cached block has ref {refs[b]}")
            if node.lock != expected_lock.get(id(node), 0):
                _fail(f"{where}: lock {node.lock}, expected {expected_lock.get(id(node), 0)}")
            if node.lock == 0 and refs[b] != 1:
                _fail(f"{where}: unlocked but ref {refs[b]} (a request uses it)")
            if parent is not cache.root and node.last_access > parent.last_access:
                _fail(f"{where}: used more recently than its parent")
            if (
                not node.children
                and node.lock == 0
                and (node.queued_at != node.last_access or (node.queued_at, node.nid) not in live)
            ):
                _fail(f"{where}: evictable leaf missing from the LRU heap")
            nodes.append(node)
            stack.append(node)
    if len(nodes) != cache.num_cached:
        _fail(f"num_cached {cache.num_cached}, tree has {len(nodes)}")
    indexed = sum(1 for n in cache._node_of if n is not None)
    if indexed != len(nodes):
        _fail(f"block index has {indexed} entries, tree has {len(nodes)} nodes")
    unlocked = sum(1 for n in nodes if n.lock == 0)
    if unlocked != cache.evictable:
        _fail(f"evictable {cache.evictable}, tree has {unlocked} unlocked nodes")
    return nodes


class Holder(Protocol):
    """A request's hold on blocks, as the manager keeps it."""

    blocks: list[int]
    cached_tokens: int
    lock: RadixNode | None


def check_manager(
    pool: BlockPool, cache: RadixCache, bs: int, requests: Mapping[str, Holder], counted: int
) -> None:
    """Check pool, tree and request tables against each other (``counted``: the manager's count
    of blocks in use)."""
    pool.check()
    holders = [0] * pool.num_blocks
    locks: list[RadixNode] = []
    for rid, req in requests.items():
        if len(set(req.blocks)) != len(req.blocks):
            _fail(f"request {rid!r} holds a block twice: {req.blocks}")
        for pos, b in enumerate(req.blocks):
            holders[b] += 1
            node = cache.node_of(b)
            if node is not None and node.depth != pos + 1:
                _fail(
                    f"request {rid!r} holds cached block {b} at position {pos}, cached at depth {node.depth}"
                )
        if req.cached_tokens % bs or req.cached_tokens // bs > len(req.blocks):
            _fail(f"request {rid!r}: cached_tokens {req.cached_tokens} vs {len(req.blocks)} blocks")
        lock = req.lock
        if lock is not None:
            if lock.depth > len(req.blocks) or req.blocks[lock.depth - 1] != lock.block:
                _fail(f"request {rid!r} locks block {lock.block} that is not its own")
            locks.append(lock)
            # every cached block it holds must be on the locked path (so it is protected)
        for pos, b in enumerate(req.blocks):
            node = cache.node_of(b)
            if node is not None:
                anc = lock
                while anc is not None and anc.depth > pos + 1:
                    anc = anc.parent
                if anc is not node:
                    _fail(f"request {rid!r} holds cached block {b} outside its locked path")
    check_tree(cache, locks)
    refs = pool._refs
    in_use = 0
    for b in range(pool.num_blocks):
        cached = cache.contains(b)
        if refs[b] != holders[b] + cached:
            _fail(f"block {b}: ref {refs[b]}, but {holders[b]} requests + {int(cached)} cache")
        in_use += holders[b] > 0
    if in_use != counted:
        _fail(f"in_use counter {counted}, actual {in_use}")
