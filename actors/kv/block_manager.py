"""BlockManager: every KV block decision for running requests, over a BlockPool and a RadixCache.

Synchronous and I/O-free. A request's life: ``admit`` (reuse the cached prefix, allocate the
rest, evicting LRU cache leaves if needed, or refuse with no change), optionally
``cache_prefix`` after prefill, ``extend`` during decode (or ``Shortage``: ``pick_victim`` +
``release`` to preempt), then ``finish`` (cache its full blocks, drop its refs) or ``release``.
Every method either completes or raises ``KVError`` before changing anything (at most the
LRU recency of a walked prefix is refreshed).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from actors.kv.block_pool import BlockPool
from actors.kv.checks import check_manager
from actors.kv.radix_cache import RadixCache, RadixNode
from actors.kv.results import Admitted, Extended, KVStats, Refused, Shortage
from actors.shared.blockhash import salted
from actors.shared.errors import KVError, KVInvariantError
from actors.shared.reservation import RESERVE_MODES, ReserveMode, reserve_tokens
from actors.shared.victim import VictimPolicy, pick_victim


@dataclass(slots=True)
class RequestState:
    """A running request: its block table (token order), the deepest cached node it holds
    (locked in the cache, or None), its admission sequence number and reused prefix length."""

    blocks: list[int]
    lock: RadixNode | None
    seq: int
    cached_tokens: int
    cacheable: bool = True  # False: rebuilt with blocks other requests share (adopt)
    salt: str = ""  # its cache_salt: the cache keys its tokens with it (blockhash.salted)


class BlockManager:
    """Block pool + prefix cache + per-request block tables.

    ``mode``: ``full`` reserves prompt + max_tokens at admission; ``on_demand`` reserves the
    prompt plus ``lookahead_blocks`` blocks and grows with ``extend`` (see ``reserve_for``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        mode: ReserveMode = "on_demand",
        lookahead_blocks: int = 1,
    ) -> None:
        if mode not in RESERVE_MODES:
            raise KVError(f"unknown reservation mode {mode!r}; known: {list(RESERVE_MODES)}")
        if lookahead_blocks < 0:
            raise KVError(f"lookahead_blocks must be >= 0, got {lookahead_blocks}")
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size)
        self.block_size = block_size
        self.mode: ReserveMode = mode
        self.lookahead_blocks = lookahead_blocks
        self.requests: dict[str, RequestState] = {}  # admission order: newest last
        self._seq = 0
        self._in_use = 0  # blocks held by >= 1 request
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evictions = 0
        self.preemptions = 0

    # ---- queries -------------------------------------------------------------------------

    def reserve_for(self, prompt_len: int, max_tokens: int) -> int:
        """Tokens to pass as ``reserve_tokens`` (admit) or ``new_total_tokens`` (extend), by
        this manager's mode (``actors.shared.reservation.reserve_tokens``). During decode call
        ``extend(rid, reserve_for(tokens_so_far, tokens_still_allowed))``."""
        return reserve_tokens(
            self.mode,
            prompt_len,
            max_tokens,
            lookahead_blocks=self.lookahead_blocks,
            block_size=self.block_size,
        )

    def peek_match(self, token_ids: Sequence[int], salt: str = "") -> int:
        """Cached token count ``admit`` would reuse; no allocation, no LRU touch."""
        return self.cache.peek(salted(token_ids, salt))

    def can_admit(self, token_ids: Sequence[int], reserve_tokens: int, salt: str = "") -> bool:
        """Whether ``admit`` would succeed now (same arithmetic, no change)."""
        return self._plan(salted(token_ids, salt), reserve_tokens)[1] is None

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table. Raises ``KVError`` if not running."""
        return list(self._get(request_id).blocks)

    def capacity(self, request_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self._get(request_id).blocks) * self.block_size

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests

    def stats(self) -> KVStats:
        """Counters and block-state snapshot; O(1)."""
        total = self.pool.num_blocks
        free = self.pool.num_free
        return KVStats(
            num_blocks=total,
            block_size=self.block_size,
            free=free,
            cached_only=total - free - self._in_use,
            in_use=self._in_use,
            cached=self.cache.num_cached,
            evictable=self.cache.evictable,
            running=len(self.requests),
            hit_tokens=self.hit_tokens,
            queried_tokens=self.queried_tokens,
            hit_rate=self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            evictions=self.evictions,
            preemptions=self.preemptions,
            utilization=self._in_use / total,
        )

    def check(self) -> None:
        """Verify all bookkeeping (O(blocks + nodes)); raises ``KVInvariantError``."""
        check_manager(self.pool, self.cache, self.block_size, self.requests, self._in_use)

    # ---- admission and growth --------------------------------------------------------------

    def _plan(
        self, token_ids: Sequence[int], reserve_tokens: int
    ) -> tuple[list[RadixNode], Refused | None, int]:
        """Prefix path, refusal (or None) and blocks to allocate for an admission. Pure."""
        n = len(token_ids)
        if n == 0:
            raise KVError("cannot admit an empty prompt")
        if reserve_tokens < n:
            raise KVError(f"reserve_tokens {reserve_tokens} < prompt length {n}")
        bs = self.block_size
        total = -(-reserve_tokens // bs)
        path = self.cache.walk(token_ids, self.cache.max_match_blocks(n))
        needed = total - len(path)
        free = self.pool.num_free
        if needed <= free:
            return path, None, needed
        protected = 0  # unlocked nodes of the prefix: we would lock them, so not evictable
        for node in reversed(path):
            if node.lock:
                break
            protected += 1
        evictable = self.cache.evictable - protected
        if needed <= free + evictable:
            return path, None, needed
        fatal = total > self.pool.num_blocks
        why = (
            f"needs {total} blocks, pool has {self.pool.num_blocks}"
            if fatal
            else f"need {needed} blocks ({reserve_tokens} tokens, {len(path) * bs} cached), "
            f"only {free} free + {evictable} evictable"
        )
        return path, Refused(why, needed, free, evictable, fatal), needed

    def admit(
        self, request_id: str, token_ids: Sequence[int], reserve_tokens: int, salt: str = ""
    ) -> Admitted | Refused:
        """Reserve blocks for ``reserve_tokens`` tokens (>= ``len(token_ids)``), reusing the
        longest cached prefix of ``token_ids`` (never the whole prompt).

        On success the request holds one ref on every block of its table and locks its cached
        prefix; LRU cache leaves are evicted if the free list is short. On ``Refused`` nothing
        changed. Raises ``KVError`` if the request is already running or the lengths are bad.
        ``salt``: the request's ``cache_salt``; it shares cached blocks only with its salt.
        """
        if request_id in self.requests:
            raise KVError(f"request {request_id!r} is already admitted")
        path, refused, needed = self._plan(salted(token_ids, salt), reserve_tokens)
        if refused is not None:
            return refused
        cache, pool = self.cache, self.pool
        refs = pool._refs
        matched = [node.block for node in path]
        for b in matched:
            if refs[b] == 1:
                self._in_use += 1
            refs[b] += 1
        if path:
            cache.touch(path)
            cache.lock(path[-1])
        evicted = self._evict(needed - pool.num_free) if needed > pool.num_free else []
        if needed > pool.num_free:
            raise KVInvariantError(f"evictable count lied: {pool.num_free} free after eviction")
        new = pool.allocate(needed)
        self._in_use += needed
        self._seq += 1
        cached = len(path) * self.block_size
        self.requests[request_id] = RequestState(
            matched + new, path[-1] if path else None, self._seq, cached, salt=salt
        )
        self.hit_tokens += cached
        self.queried_tokens += len(token_ids)
        return Admitted(matched + new, cached, evicted, new)

    def disk_hit(self, request_id: str, tokens: int) -> None:
        """``tokens`` more of the request's prompt are loaded from the disk tier (cached)."""
        self._get(request_id).cached_tokens += tokens
        self.hit_tokens += tokens

    def extend(self, request_id: str, new_total_tokens: int) -> Extended | Shortage:
        """Grow the table to hold ``new_total_tokens`` tokens (no-op if it already does),
        evicting LRU cache leaves if needed. On ``Shortage`` nothing changed."""
        req = self._get(request_id)
        needed = -(-new_total_tokens // self.block_size) - len(req.blocks)
        if needed <= 0:
            return Extended([], [])
        free = self.pool.num_free
        evictable = self.cache.evictable
        if needed > free + evictable:
            return Shortage(needed, free, evictable)
        evicted = self._evict(needed - free) if needed > free else []
        if needed > self.pool.num_free:
            raise KVInvariantError(
                f"evictable count lied: {self.pool.num_free} free after eviction"
            )
        new = self.pool.allocate(needed)
        self._in_use += needed
        req.blocks.extend(new)
        return Extended(new, evicted)

    def evict(self, n: int) -> list[int]:
        """Evict up to ``n`` unused cache blocks (LRU leaves first); returns their ids."""
        return self._evict(n)

    def _evict(self, n: int) -> list[int]:
        evicted = self.cache.evict(n)
        self.evictions += len(evicted)
        return evicted

    # ---- leaving -------------------------------------------------------------------------

    def cache_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Insert the full blocks of ``token_ids`` (tokens whose KV the request has written,
        e.g. its prompt after prefill) into the cache; the request keeps its refs. Returns the
        number of newly cached blocks. Raises ``KVError`` if the tokens exceed the table or do
        not extend the request's cached prefix."""
        return self._cache_tokens(self._get(request_id), token_ids)

    def _cache_tokens(self, req: RequestState, token_ids: Sequence[int]) -> int:
        if not req.cacheable:
            return 0
        cap = len(req.blocks) * self.block_size
        if len(token_ids) > cap:
            raise KVError(f"{len(token_ids)} tokens exceed the request's {cap}-token table")
        cache = self.cache
        keyed = salted(token_ids, req.salt)
        new, last, held = cache.insert_path(keyed, req.blocks, expect=req.lock)
        old = req.lock
        if held is not None and (old is None or held.depth > old.depth):
            cache.lock(held)
            if old is not None:
                cache.unlock(old)
            req.lock = held
        if last is not None:
            cache.settle(last)
        return new

    def finish(self, request_id: str, all_token_ids: Sequence[int]) -> list[int]:
        """Cache the full blocks of ``all_token_ids`` (the tokens whose KV was written: prompt
        + generated), then drop the request. Returns the blocks that went back to the free
        list (the request's duplicates of already-cached blocks, and unused tail blocks)."""
        req = self._get(request_id)
        self._cache_tokens(req, all_token_ids)
        return self._drop(request_id, req)

    def release(
        self,
        request_id: str,
        *,
        cache: bool = False,
        token_ids: Sequence[int] | None = None,
        preempted: bool = True,
    ) -> list[int]:
        """Drop the request's blocks; with ``cache=True`` first cache the full blocks of
        ``token_ids`` (required then). ``preempted`` counts it in ``stats().preemptions`` (pass
        False for aborts). Returns the blocks that went back to the free list."""
        req = self._get(request_id)
        if cache:
            if token_ids is None:
                raise KVError("release(cache=True) needs token_ids")
            self._cache_tokens(req, token_ids)
        if preempted:
            self.preemptions += 1
        return self._drop(request_id, req)

    def _drop(self, request_id: str, req: RequestState) -> list[int]:
        del self.requests[request_id]
        if req.lock is not None:
            self.cache.unlock(req.lock)
        freed = self.pool.free_many(req.blocks)
        refs = self.pool._refs
        node_of = self.cache._node_of
        gone = 0  # blocks no request holds any more: ref back to just the cache's (or zero)
        for b in req.blocks:
            if refs[b] == (node_of[b] is not None):
                gone += 1
        self._in_use -= gone
        return freed

    def adopt(self, tables: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Hold these block tables (request id, blocks; admission order) in a manager that holds
        nothing: a restarted KV manager rebuilt from its peers. Nothing is cached. ``KVError``,
        no change, on an unknown block, a block twice in one table, or a request twice."""
        if self.requests or len({rid for rid, _ in tables}) != len(tables):
            raise KVError("adopt needs an empty manager and each request once")
        refs: dict[int, int] = {}
        for rid, blocks in tables:
            if len(set(blocks)) != len(blocks):
                raise KVError(f"request {rid!r}: a block twice in its table")
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.adopt(refs)
        for rid, blocks in tables:
            self._seq += 1
            alone = all(refs[b] == 1 for b in blocks)
            self.requests[rid] = RequestState(list(blocks), None, self._seq, 0, cacheable=alone)
        self._in_use = len(refs)

    def pick_victim(
        self,
        policy: VictimPolicy = "newest",
        priorities: dict[str, int] | None = None,
        exclude: Collection[str] = (),
    ) -> str | None:
        """Name the running request to preempt, or None if none is eligible. Pure: see
        ``actors.shared.victim.pick_victim`` (``priority``: the lowest value goes first)."""
        seqs = {rid: req.seq for rid, req in self.requests.items()}
        return pick_victim(seqs, policy, priorities, exclude)

    def _get(self, request_id: str) -> RequestState:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KVError(f"unknown request {request_id!r}") from None


__all__ = ["BlockManager", "RequestState", "ReserveMode"]
