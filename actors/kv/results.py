"""Immutable results of the KV manager's operations (plain data, no behaviour)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admitted:
    """``admit`` succeeded.

    ``block_table``: every block of the request, in token order (cached prefix, then new blocks).
    ``cached_tokens``: tokens whose KV is already in the reused prefix blocks (a multiple of
    the block size, always < the prompt length). ``evicted_blocks``: cache blocks evicted to make
    room (for logging). ``new_blocks``: the freshly allocated tail of ``block_table``.
    """

    block_table: list[int]
    cached_tokens: int
    evicted_blocks: list[int]
    new_blocks: list[int]


@dataclass(frozen=True, slots=True)
class Refused:
    """``admit`` could not reserve the blocks; nothing was changed.

    ``blocks_needed`` counts blocks beyond the reusable prefix; ``blocks_evictable`` counts cache
    blocks that eviction could free (excluding the prefix this request would have reused).
    ``fatal``: the request can never fit, even in an empty pool.
    """

    reason: str
    blocks_needed: int
    blocks_free: int
    blocks_evictable: int
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class Extended:
    """``extend`` succeeded: ``new_blocks`` were appended to the request's block table."""

    new_blocks: list[int]
    evicted_blocks: list[int]


@dataclass(frozen=True, slots=True)
class Shortage:
    """``extend`` could not grow the table; nothing was changed (preempt someone and retry)."""

    blocks_needed: int
    blocks_free: int
    blocks_evictable: int

    @property
    def reason(self) -> str:
        return (
            f"need {self.blocks_needed} more blocks, only {self.blocks_free} free "
            f"+ {self.blocks_evictable} evictable"
        )


@dataclass(frozen=True, slots=True)
class KVStats:
    """Counters and a snapshot of block states (``free + cached_only + in_use == num_blocks``).

    ``in_use``: blocks held by at least one running request (cached or not); ``cached_only``:
    blocks held by the prefix cache alone; ``utilization`` = in_use / num_blocks;
    ``hit_rate`` = hit_tokens / queried_tokens over admitted requests (0.0 before any).
    ``evictions`` counts evicted blocks, ``preemptions`` released-as-preempted requests.
    """

    num_blocks: int
    block_size: int
    free: int
    cached_only: int
    in_use: int
    cached: int
    evictable: int
    running: int
    hit_tokens: int
    queried_tokens: int
    hit_rate: float
    evictions: int
    preemptions: int
    utilization: float
