"""DiskTier: the KV manager's index and policy for the prefix cache's second tier, on disk.

The executor holds the bytes (``gpu/disk/store.py``: one file per block, named by its key); this
is what the KV manager knows of them: which keys exist, least recently used first, the byte
bound, and the saves in flight. Keys are ``blockhash.disk_keys``: a chain over a block's tokens
seeded with the model's fingerprint and the request's ``cache_salt``.

- ``hits(keys, start)``: how many blocks from ``start`` on are on disk, consecutively (an
  admission loads them instead of computing them); they and the pool's part before them become
  the most recently used.
- ``plan_save(keys)``: of a cached chain, the keys to write now, and the least recently used
  files to delete first so that the tier never holds more than its bound (files written plus
  files being written). Keys of the chain itself are never deleted for its own sake.
- ``started(save_id, ...)``/``saved(save_id, ...)``: a save in flight and its answer; the
  caller pins the saved blocks in the pool until then (they must not be overwritten while the
  executor reads them).
- ``dropped(keys)``: files the executor found missing or corrupt.

Pure bookkeeping, no I/O; the KV core turns its answers into messages and events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Saving:
    keys: list[str]
    pin: Any  # what the caller pinned (a radix node), released on the answer


@dataclass
class DiskTier:
    capacity: int  # bytes, at most, of block files (written or being written)
    fingerprint: str
    block_bytes: int
    files: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    saving: dict[int, Saving] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # keys being written
    next_save: int = 1
    hit_tokens: int = 0  # prompt tokens served from disk (admissions)

    @classmethod
    def found(
        cls, capacity: int, fingerprint: str, block_bytes: int, keys: Sequence[str]
    ) -> tuple[DiskTier, list[str]]:
        """The tier as the executor found it on disk (``keys`` LRU first), and the least
        recently used keys to delete if it holds more than ``capacity`` (a smaller bound)."""
        tier = cls(capacity, fingerprint, max(1, block_bytes))
        tier.files.update(dict.fromkeys(keys))
        return tier, tier._make_room(0, ())

    @property
    def bytes(self) -> int:
        return (len(self.files) + len(self.pending)) * self.block_bytes

    def __contains__(self, key: str) -> bool:
        return key in self.files or key in self.pending

    def hits(self, keys: Sequence[str], start: int) -> int:
        """Blocks ``keys[start:]`` on disk, consecutively from ``start``; every key of
        ``keys[: start + hits]`` on disk becomes the most recently used."""
        files = self.files
        n = 0
        while start + n < len(keys) and keys[start + n] in files:
            n += 1
        self.touch(keys[: start + n])
        return n

    def peek(self, keys: Sequence[str], start: int) -> int:
        """``hits`` without touching anything."""
        n = 0
        while start + n < len(keys) and keys[start + n] in self.files:
            n += 1
        return n

    def touch(self, keys: Sequence[str]) -> None:
        files = self.files
        for k in keys:
            if k in files:
                files.move_to_end(k)

    def plan_save(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """(keys to delete first, keys to write) for a chain of cached blocks, ``keys`` in
        chain order: the ones neither on disk nor being written, as many of the first of them
        as fit once least recently used files outside the chain are deleted."""
        self.touch(keys)
        new = [k for k in dict.fromkeys(keys) if k not in self]
        if not new:
            return [], []
        drop = self._make_room(len(new), keys)
        room = (self.capacity - self.bytes) // self.block_bytes
        return drop, new[: max(0, room)]

    def _make_room(self, blocks: int, keep: Sequence[str]) -> list[str]:
        files, keep_set = self.files, set(keep)
        drop: list[str] = []
        while files and self.bytes + blocks * self.block_bytes > self.capacity:
            key = next(iter(files))
            if key in keep_set:
                break  # the chain itself is the least recently used: write less of it
            del files[key]
            drop.append(key)
        return drop

    def started(self, keys: list[str], pin: Any) -> int:
        """Record a save in flight; returns its id."""
        save_id, self.next_save = self.next_save, self.next_save + 1
        self.saving[save_id] = Saving(keys, pin)
        self.pending.update(keys)
        return save_id

    def saved(self, save_id: int, failed: Sequence[str]) -> Saving | None:
        """The answer to save ``save_id``: its keys are files now (but ``failed``). Returns the
        save (its pin to release), or None for an unknown id."""
        sv = self.saving.pop(save_id, None)
        if sv is None:
            return None
        bad = set(failed)
        for k in sv.keys:
            self.pending.discard(k)
            if k not in bad:
                self.files[k] = None
                self.files.move_to_end(k)
        return sv

    def dropped(self, keys: Sequence[str]) -> int:
        """Files the executor found missing or corrupt; returns how many were indexed."""
        n = 0
        for k in keys:
            if self.files.pop(k, 0) is None:
                n += 1
        return n
