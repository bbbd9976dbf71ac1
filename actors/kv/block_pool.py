"""A fixed pool of KV blocks with reference counts.

A block is *free* (ref 0, on the free list) or *held* (ref >= 1). Each holder (a running
request's block table, or the prefix cache) owns exactly one ref. ``allocate`` hands out free
blocks with ref 1, ``share`` adds a ref to a held block, ``free`` drops one and puts the block
back on the free list when the count reaches zero. Misuse raises ``KVError`` before any change.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.shared.errors import KVError, KVInvariantError


class BlockPool:
    """``num_blocks`` blocks with ids ``0 .. num_blocks-1``.

    The free list is a LIFO stack, so recently freed blocks are reused first (warm pages).
    """

    __slots__ = ("_free", "_refs", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise KVError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs: list[int] = [0] * num_blocks
        # Reversed so that the first allocations hand out 0, 1, 2, ... (readable logs and tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Number of blocks on the free list."""
        return len(self._free)

    def ref(self, block: int) -> int:
        """Current reference count of ``block``. Raises ``KVError`` for an unknown id."""
        self._known(block)
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with ref 1, and return them.

        Raises ``KVError`` (and takes nothing) when fewer than ``n`` are free or ``n < 0``.
        """
        free = self._free
        if n < 0 or n > len(free):
            raise KVError(f"cannot allocate {n} blocks: {len(free)} free")
        if n == 0:
            return []
        blocks = free[-n:]
        del free[-n:]
        blocks.reverse()
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def share(self, block: int) -> int:
        """Add one ref to a held block and return the new count.

        Raises ``KVError`` if ``block`` is unknown or free (sharing a free block is a bug: its KV
        content is garbage).
        """
        self._known(block)
        refs = self._refs
        if refs[block] == 0:
            raise KVError(f"cannot share block {block}: it is free")
        refs[block] += 1
        return refs[block]

    def share_many(self, blocks: Iterable[int]) -> None:
        """``share`` each block; validates all first, so on error nothing changed."""
        blocks = list(blocks)
        for b in blocks:
            self._known(b)
            if self._refs[b] == 0:
                raise KVError(f"cannot share block {b}: it is free")
        refs = self._refs
        for b in blocks:
            refs[b] += 1

    def free(self, block: int) -> int:
        """Drop one ref of ``block`` and return the remaining count (0: back on the free list).

        Raises ``KVError`` on an unknown block or a double free (ref already 0).
        """
        self._known(block)
        refs = self._refs
        r = refs[block]
        if r == 0:
            raise KVError(f"double free of block {block}")
        refs[block] = r - 1
        if r == 1:
            self._free.append(block)
        return r - 1

    def free_many(self, blocks: Iterable[int]) -> list[int]:
        """Drop one ref of each block (a block listed twice loses two refs).

        Validates everything first, so a double free or unknown id raises ``KVError`` with no
        change. Returns the blocks that reached zero and went back to the free list, in order.
        """
        blocks = list(blocks)
        refs = self._refs
        num = self.num_blocks
        if len(set(blocks)) != len(blocks) or not all(0 <= b < num and refs[b] for b in blocks):
            pending: dict[int, int] = {}  # slow path: find the offending block
            for b in blocks:
                self._known(b)
                pending[b] = pending.get(b, 0) + 1
                if pending[b] > refs[b]:
                    raise KVError(f"double free of block {b}")
        freed: list[int] = []
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r == 0:
                freed.append(b)
        self._free.extend(freed)
        return freed

    def adopt(self, refs: dict[int, int]) -> None:
        """Start from held blocks (a pool rebuilt from its holders): ``refs`` maps a block to
        its number of holders. Only on a pool that holds nothing; ``KVError``, no change, on an
        unknown block or a count below 1."""
        if any(self._refs):
            raise KVError("adopt needs a pool that holds nothing")
        for b, n in refs.items():
            self._known(b)
            if n < 1:
                raise KVError(f"block {b}: {n} holders")
        for b, n in refs.items():
            self._refs[b] = n
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if not self._refs[b]]

    def _known(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise KVError(f"unknown block {block} (pool has {self.num_blocks})")

    def check(self) -> None:
        """Verify the free list holds exactly the ref-0 blocks, once each.

        Raises ``KVInvariantError`` describing the first problem found.
        """
        seen: set[int] = set()
        for b in self._free:
            if not 0 <= b < self.num_blocks:
                raise KVInvariantError(f"free list holds unknown block {b}")
            if b in seen:
                raise KVInvariantError(f"block {b} is on the free list twice")
            if self._refs[b] != 0:
                raise KVInvariantError(f"block {b} is on the free list with ref {self._refs[b]}")
            seen.add(b)
        for b, r in enumerate(self._refs):
            if r < 0:
                raise KVInvariantError(f"block {b} has negative ref {r}")
            if r == 0 and b not in seen:
                raise KVInvariantError(f"block {b} has ref 0 but is not on the free list")

    def refs_snapshot(self) -> list[int]:
        """A copy of every block's ref count (for checks and tests)."""
        return list(self._refs)
