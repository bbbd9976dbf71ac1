"""Block-aligned radix prefix cache with LRU eviction of unused leaves.

Every edge is one *full* block: a tuple of ``block_size`` token ids, mapping to the node that
holds the block id whose KV was computed for exactly that prefix. A partial block is never
cached. The cache owns one pool ref per node; running requests add their own refs.

Requests that use cached blocks *lock* a node: the lock count is added to the node and all
its ancestors, so ``node.lock`` = number of lock holders in its subtree. A node with
``lock == 0`` has no user in its subtree and will become evictable once it is a leaf.
``evictable`` counts those nodes in O(1). Eviction pops a heap of ``(last_access, id, node)``
entries with lazy invalidation: an entry is live only if the node still records that stamp in
``queued_at``; stale entries are skipped on pop and the heap is compacted when it grows past
twice the tree. Each eviction is O(log n), whatever the tree size.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from actors.kv.block_pool import BlockPool
from actors.shared.errors import KVError


class RadixNode:
    """One cached block. ``parent is None`` means detached (evicted) unless it is the root."""

    __slots__ = (
        "block",
        "children",
        "depth",
        "key",
        "last_access",
        "lock",
        "nid",
        "parent",
        "queued_at",
    )

    def __init__(self, key: tuple[int, ...], block: int, parent: RadixNode | None, nid: int):
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.lock = 0
        self.last_access = 0
        self.queued_at = -1  # stamp of this node's live heap entry, -1 when none
        self.nid = nid


class PrefixMatch(NamedTuple):
    """Result of ``RadixCache.match``: reused blocks in order and the tokens they cover."""

    blocks: list[int]
    tokens: int


class RadixCache:
    """The prefix tree over full blocks of ``pool``.

    Mutating methods: ``match`` (LRU touch), ``insert`` (adds nodes, takes a pool ref per new
    node), ``lock``/``unlock``, ``evict`` (drops nodes, frees their pool refs).
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size <= 0:
            raise KVError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode((), -1, None, 0)
        self._node_of: list[RadixNode | None] = [None] * pool.num_blocks
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._clock = 0
        self._next_nid = 1
        self.num_cached = 0
        self.evictable = 0  # cached nodes with lock == 0 (all can be freed by repeated eviction)

    # ---- lookups -------------------------------------------------------------------------

    def contains(self, block: int) -> bool:
        """Whether ``block`` is held by the cache."""
        return 0 <= block < len(self._node_of) and self._node_of[block] is not None

    def node_of(self, block: int) -> RadixNode | None:
        """The node holding ``block``, or None."""
        return self._node_of[block]

    def max_match_blocks(self, num_tokens: int) -> int:
        """Most blocks a prompt of ``num_tokens`` may reuse: at least one token stays to compute."""
        return max(0, (num_tokens - 1) // self.block_size)

    def walk(self, token_ids: Sequence[int], max_blocks: int) -> list[RadixNode]:
        """Nodes of the longest cached prefix of ``token_ids`` (at most ``max_blocks``). Pure."""
        bs = self.block_size
        node = self.root
        path: list[RadixNode] = []
        for start in range(0, min(max_blocks, len(token_ids) // bs) * bs, bs):
            child = node.children.get(tuple(token_ids[start : start + bs]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def peek(self, token_ids: Sequence[int]) -> int:
        """Cached token count ``match`` would return; no allocation, no LRU touch."""
        return len(self.walk(token_ids, self.max_match_blocks(len(token_ids)))) * self.block_size

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix, leaving at least one token to compute; touches it (LRU).

        Takes no refs: a caller that keeps the blocks must ``pool.share`` them and ``lock`` the
        deepest node (``BlockManager.admit`` does both).
        """
        path = self.walk(token_ids, self.max_match_blocks(len(token_ids)))
        self.touch(path)
        return PrefixMatch([n.block for n in path], len(path) * self.block_size)

    # ---- mutation ------------------------------------------------------------------------

    def touch(self, path: Sequence[RadixNode]) -> None:
        """Mark a root path as used now (one stamp for all); requeue its end if evictable."""
        if not path:
            return
        self._clock += 1
        clock = self._clock
        for node in path:
            node.last_access = clock
        self.settle(path[-1])

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache the full blocks of ``token_ids`` (``blocks[i]`` holds block ``i``'s KV).

        Where a block's prefix is already cached, the cached block is kept and ``blocks[i]`` is
        left alone (its holder frees it later). Each new node takes one pool ref. The path is
        touched. Returns the number of newly cached blocks. Raises ``KVError`` with no change if
        a block to insert is free, or already cached at another position.
        """
        new, last, _ = self.insert_path(token_ids, blocks)
        if last is not None:
            self.settle(last)
        return new

    def insert_path(
        self,
        token_ids: Sequence[int],
        blocks: Sequence[int],
        expect: RadixNode | None = None,
    ) -> tuple[int, RadixNode | None, RadixNode | None]:
        """``insert`` without requeueing the end; for the manager.

        ``expect``: a node the walk must pass through (the caller's current lock, or its
        ancestor at the walk's depth); raises ``KVError`` before any change if the tokens lead
        elsewhere. Returns (new node count, last node walked, deepest node holding the caller's
        own block at its position).
        """
        bs = self.block_size
        n = min(len(token_ids) // bs, len(blocks))
        if expect is not None and expect.depth > n:
            while expect.depth > n:
                assert expect.parent is not None
                expect = expect.parent
        refs = self.pool._refs
        num_blocks = len(refs)
        for b in blocks[:n]:
            if not 0 <= b < num_blocks or refs[b] == 0:
                self.pool._known(b)
                raise KVError(f"cannot cache block {b}: it is free")
        self._clock += 1
        clock = self._clock
        node_of = self._node_of
        node = self.root
        new = 0
        held: RadixNode | None = None
        try:
            for i in range(n):
                key = tuple(token_ids[i * bs : (i + 1) * bs])
                b = blocks[i]
                child = node.children.get(key)
                if child is None:
                    if expect is not None and i < expect.depth:
                        raise KVError("token_ids do not extend the request's cached prefix")
                    if node_of[b] is not None:
                        node = self._rollback(node, new)
                        new = 0
                        raise KVError(f"block {b} is already cached at another position")
                    child = RadixNode(key, b, node, self._next_nid)
                    self._next_nid += 1
                    node.children[key] = child
                    node_of[b] = child
                    refs[b] += 1
                    new += 1
                elif expect is not None and i == expect.depth - 1 and child is not expect:
                    raise KVError("token_ids do not extend the request's cached prefix")
                if child.block == b:
                    held = child
                child.last_access = clock
                node = child
        except KVError:
            if node is not self.root:
                self.settle(node)  # it was touched; keep the LRU queue in step
            raise
        self.num_cached += new
        self.evictable += new
        return new, (None if node is self.root else node), held

    def _rollback(self, node: RadixNode, count: int) -> RadixNode:
        """Undo the last ``count`` nodes created by ``insert_path`` (a chain ending at ``node``);
        returns the deepest surviving node."""
        for _ in range(count):
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            self._node_of[node.block] = None
            self.pool._refs[node.block] -= 1
            node = parent
        return node

    def lock(self, node: RadixNode) -> None:
        """Add one lock to ``node`` and every ancestor (they stop being evictable)."""
        root = self.root
        while node is not root:
            if node.lock == 0:
                self.evictable -= 1
            node.lock += 1
            parent = node.parent
            assert parent is not None, "lock on an evicted node"
            node = parent

    def unlock(self, node: RadixNode) -> None:
        """Remove one lock from ``node`` and its ancestors; requeue nodes that become evictable."""
        root = self.root
        while node is not root:
            if node.lock <= 0:
                raise KVError(f"unlock of unlocked node holding block {node.block}")
            node.lock -= 1
            if node.lock == 0:
                self.evictable += 1
                if not node.children:
                    self.settle(node)
            parent = node.parent
            assert parent is not None, "unlock on an evicted node"
            node = parent

    def settle(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it is an unlocked leaf not already queued at its stamp."""
        if node.children or node.lock or node.queued_at == node.last_access:
            return
        node.queued_at = node.last_access
        heap = self._heap
        heapq.heappush(heap, (node.last_access, node.nid, node))
        if len(heap) > 2 * self.num_cached + 1024:
            self._heap = [e for e in heap if e[2].queued_at == e[0] and e[2].parent is not None]
            heapq.heapify(self._heap)

    def evict(self, n: int) -> list[int]:
        """Evict up to ``n`` unlocked leaves, least recently used first; parents whose last
        child goes become candidates. Frees the cache's pool ref (the block returns to the free
        list) and returns the freed block ids in eviction order."""
        freed: list[int] = []
        heap = self._heap
        root = self.root
        node_of = self._node_of
        free_block = self.pool.free
        while len(freed) < n and heap:
            stamp, _, node = heapq.heappop(heap)
            if node.queued_at != stamp:
                continue  # stale: touched, requeued or evicted since
            node.queued_at = -1
            if node.children or node.lock:
                continue  # not evictable now; requeued when that changes
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            node_of[node.block] = None
            self.num_cached -= 1
            self.evictable -= 1
            if free_block(node.block) != 0:
                raise KVError(f"evicted block {node.block} still had users")
            freed.append(node.block)
            if parent is not root and not parent.children and parent.lock == 0:
                self.settle(parent)
        return freed
