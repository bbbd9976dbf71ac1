"""What the KV manager accepts: admission and release (scheduler), growth (executor), state queries."""

from __future__ import annotations

import msgspec

from messages.common import Hello, Msg, Ping, Reconcile


class Admit(Msg, tag="kv_admit"):
    """Scheduler -> KV: match the longest cached prefix, then allocate blocks for
    ``reserve_tokens`` tokens in all. Answered with ``scheduler.AdmitResult``."""

    request_id: str
    attempt: int
    token_ids: list[int]
    reserve_tokens: int
    cache_salt: str = ""  # ``Submit.cache_salt``: cached KV is shared only within one salt


class Grow(Msg, tag="kv_grow"):
    """Executor -> KV: the request will soon hold ``total_tokens`` tokens; grant blocks ahead of
    need (``executor.Extend``), or report ``scheduler.GrowthShortage``."""

    request_id: str
    attempt: int
    total_tokens: int
    # the least it must hold (0: ``total_tokens``): room for speculative drafts is asked beyond
    # it, and granted only where blocks are free (a shortage shrinks the drafts, never preempts)
    needed_tokens: int = 0


class Finish(Msg, tag="kv_finish"):
    """Scheduler -> KV: the request finished; cache the full blocks of ``token_ids`` and drop its refs."""

    request_id: str
    attempt: int
    token_ids: list[int]


class CachePrefix(Msg, tag="kv_cache_prefix"):
    """Scheduler -> KV: the request's prompt KV is written, or is being written by the
    executor's step in flight (``prefill_done``); cache its full blocks so
    requests admitted while it runs can share them. Sent by the scheduler (not the executor) so it
    reaches the KV manager before the admissions that should hit it."""

    request_id: str
    attempt: int
    token_ids: list[int]


class Release(Msg, tag="kv_release"):
    """Scheduler -> KV: drop the request's blocks without caching them (abort, preemption, error)."""

    request_id: str
    attempt: int
    reason: str = "release"


class MatchQuery(Msg, tag="kv_match"):
    """Anyone -> KV (answered on the same connection with ``MatchReply``): cached prefix length of
    each token list, without allocating or touching LRU order."""

    token_lists: list[list[int]]
    salts: list[str] = []  # each list's cache_salt (none: unsalted)


class MatchReply(Msg, tag="kv_match_reply"):
    cached_tokens: list[int]


class StatsQuery(Msg, tag="kv_stats"):
    """Anyone -> KV: answered on the same connection with ``Stats``; ``check`` runs the invariant check."""

    check: bool = True


class Stats(Msg, tag="kv_stats_reply"):
    num_blocks: int
    free: int
    cached_only: int
    in_use: int
    running: int
    hit_tokens: int
    queried_tokens: int
    evictions: int
    preemptions: int
    check_ok: bool
    check_error: str = ""
    # the disk tier (``--kv-disk-dir``): blocks and bytes on disk, its bound, tokens it served
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity: int = 0
    disk_hit_tokens: int = 0


class HeldBlocks(msgspec.Struct, array_like=True, omit_defaults=True):
    """One running request's blocks, as a peer of a restarted KV manager holds them."""

    request_id: str
    attempt: int
    block_table: list[int]
    want_tokens: int = 0  # growth asked for (of the dead KV manager): tokens to make room for


class Rebuild(Msg, tag="kv_rebuild"):
    """Scheduler -> a restarted KV manager: every request that holds blocks now, with the block
    table it was admitted with. The pool is rebuilt from these (the executor's ``kv_holding``
    has the tables grown since); nothing else holds blocks. ``executor_alive``: wait for the
    executor's ``kv_holding`` first."""

    running: list[HeldBlocks]
    executor_alive: bool = True


class Holding(Msg, tag="kv_holding"):
    """Executor -> a restarted KV manager: the block table of every request it holds (their KV
    is intact) and the growth each still needs."""

    requests: list[HeldBlocks]


class DiskTier(Msg, tag="kv_disk_tier"):
    """Executor -> KV manager (at start, and to a restarted KV manager): the disk tier it keeps
    for this model (``fingerprint``: weights, KV dtype, block size, KV layout, compute dtype and
    device kind), the block files found there, least recently used first, each ``block_bytes``
    long (a whole file: header and KV)."""

    fingerprint: str
    block_bytes: int
    keys: list[str]


class DiskSaved(Msg, tag="kv_disk_saved"):
    """Executor -> KV: the blocks of ``executor.DiskSave`` ``save_id`` are written (``failed``:
    the keys that could not be)."""

    save_id: int
    keys: list[str]
    failed: list[str] = []


class DiskRates(Msg, tag="kv_disk_rates"):
    """Executor -> KV manager (after each load): what a block costs here, read from disk
    (``load_s``, the last load's seconds per block) against computed (``prefill_s``: seconds
    per prompt token of its recent prefill steps; 0 until it has one)."""

    load_s: float
    prefill_s: float = 0.0


class DiskDropped(Msg, tag="kv_disk_dropped"):
    """Executor -> KV: these block files were missing or failed their check at load (deleted;
    their tokens were recomputed)."""

    keys: list[str]
    reason: str


KVInbound = (
    Hello
    | Ping
    | Admit
    | Grow
    | CachePrefix
    | Finish
    | Release
    | MatchQuery
    | StatsQuery
    | Rebuild
    | Holding
    | DiskTier
    | DiskSaved
    | DiskDropped
    | DiskRates
    | Reconcile
)
