"""The KV-manager actor: wraps ``actors.kv.KVManager`` and owns all block bookkeeping.

Admission answers go to the scheduler; decode-time growth is granted straight to the executor
(ahead of need: the executor asks a block early), and a shortage is reported to the scheduler,
which decides preemption. Requests whose growth was refused are retried, oldest first, whenever
blocks are freed. Every decision is an event: prefix.matched, kv.allocated, kv.evicted,
kv.extended, kv.shortage, kv.released, admission.refused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from actors.kv import Extended, KVError, KVManager, Refused, Shortage
from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from messages import kv as km
from messages.executor import Extend
from messages.scheduler import AdmitResult, BlocksFreed, GrowthShortage


def _numbers(res: Refused | Shortage) -> dict[str, int]:
    """The block counts behind a refusal or a shortage, as events and messages name them."""
    return {
        "blocks_needed": res.blocks_needed,
        "blocks_free": res.blocks_free,
        "blocks_evictable": res.blocks_evictable,
    }


class KVManagerActor(Actor):
    name = "kv_manager"
    inbound = km.KVInbound

    def __init__(self, cfg: RuntimeConfig, num_blocks: int) -> None:
        super().__init__(cfg)
        self.kv = KVManager(
            num_blocks,
            cfg.kv.block_size,
            mode=cfg.kv.mode,
            lookahead_blocks=cfg.kv.lookahead_blocks,
        )
        self.attempts: dict[str, int] = {}
        self.pending_growth: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.log.info(
            "kv.config",
            num_blocks=num_blocks,
            block_size=cfg.kv.block_size,
            mode=cfg.kv.mode,
            lookahead_blocks=cfg.kv.lookahead_blocks,
        )

    def on_peer_dead(self, name: str, reason: str) -> None:
        """Drop every request's blocks; if the executor died its KV tensors died with it, so the
        prefix cache is emptied too."""
        if name == "executor":
            self.kv = KVManager(
                self.kv.pool.num_blocks,
                self.cfg.kv.block_size,
                mode=self.cfg.kv.mode,
                lookahead_blocks=self.cfg.kv.lookahead_blocks,
            )
        else:
            for rid in list(self.kv.requests):
                self.kv.release(rid, preempted=False)
        self.attempts.clear()
        self.pending_growth.clear()
        s = self.kv.stats()
        self.log.warning(
            "kv.reset",
            reason=reason,
            cache_cleared=name == "executor",
            free=s.free,
            cached=s.cached,
        )

    def _current(self, rid: str, attempt: int) -> bool:
        return self.attempts.get(rid) == attempt and rid in self.kv

    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, km.Admit):
            self._admit(msg)
        elif isinstance(msg, km.Grow):
            if self._current(msg.request_id, msg.attempt):
                self._grow(msg.request_id, msg.attempt, msg.total_tokens)
        elif isinstance(msg, km.CachePrefix):
            if self._current(msg.request_id, msg.attempt):
                try:
                    n = self.kv.cache_prefix(msg.request_id, msg.token_ids)
                    self.log.debug("kv.cached", request_id=msg.request_id, new_blocks=n)
                except KVError as e:
                    self.log.error("kv.cache_error", request_id=msg.request_id, reason=str(e))
        elif isinstance(msg, (km.Finish, km.Release)):
            self._leave(msg)
        elif isinstance(msg, km.MatchQuery):
            self.reply(
                ident, km.MatchReply(cached_tokens=[self.kv.peek_match(t) for t in msg.token_lists])
            )
        elif isinstance(msg, km.StatsQuery):
            self.reply(ident, self.stats_reply(msg.check))

    def _leave(self, msg: km.Finish | km.Release) -> None:
        """Finish (cache, then drop) or release (drop) a request's blocks. Always answered with
        ``BlocksFreed`` (also for a stale attempt), so the scheduler can count frees in flight."""
        rid = msg.request_id
        if self._current(rid, msg.attempt):
            try:
                if isinstance(msg, km.Finish):
                    freed, reason = self.kv.finish(rid, msg.token_ids), "finished"
                else:
                    freed = self.kv.release(rid, preempted=msg.reason == "preempted")
                    reason = msg.reason
            except KVError as e:  # bad token ids for the cache: still free the blocks
                self.log.error("kv.finish_error", request_id=rid, reason=str(e))
                freed, reason = self.kv.release(rid, preempted=False), "finish_error"
            self._after_free(rid, reason, freed)
        s = self.kv.stats()
        self.send(
            "scheduler",
            BlocksFreed(
                free=s.free, evictable=s.evictable, in_use=s.in_use, num_blocks=s.num_blocks
            ),
        )

    def stats_reply(self, check: bool) -> km.Stats:
        s = self.kv.stats()
        ok, err = True, ""
        if check:
            try:
                self.kv.check()
            except AssertionError as e:
                ok, err = False, str(e)
        return km.Stats(
            num_blocks=s.num_blocks,
            free=s.free,
            cached_only=s.cached_only,
            in_use=s.in_use,
            running=s.running,
            hit_tokens=s.hit_tokens,
            queried_tokens=s.queried_tokens,
            evictions=s.evictions,
            preemptions=s.preemptions,
            check_ok=ok,
            check_error=err,
        )

    def _admit(self, msg: km.Admit) -> None:
        rid = msg.request_id
        if rid in self.kv:  # a previous attempt was never released: release it now
            self.log.warning("kv.stale_request", request_id=rid, attempt=self.attempts.get(rid))
            self.kv.release(rid, preempted=False)
        try:
            res = self.kv.admit(rid, msg.token_ids, max(msg.reserve_tokens, len(msg.token_ids)))
        except KVError as e:
            res = Refused(str(e), 0, self.kv.pool.num_free, 0, fatal=True)
        if isinstance(res, Refused):
            nums = _numbers(res)
            self.log.info(
                "admission.refused", request_id=rid, reason=res.reason, fatal=res.fatal, **nums
            )
            self.send(
                "scheduler",
                AdmitResult(
                    request_id=rid,
                    attempt=msg.attempt,
                    ok=False,
                    reason=res.reason,
                    fatal=res.fatal,
                    blocks_needed=res.blocks_needed,
                    blocks_free=res.blocks_free,
                    blocks_evictable=res.blocks_evictable,
                ),
            )
            return
        self.attempts[rid] = msg.attempt
        if res.cached_tokens:
            self.log.info(
                "prefix.matched",
                request_id=rid,
                cached_tokens=res.cached_tokens,
                prompt_tokens=len(msg.token_ids),
            )
        if res.evicted_blocks:
            self.log.info("kv.evicted", request_id=rid, blocks=res.evicted_blocks)
        self.log.info(
            "kv.allocated",
            request_id=rid,
            new_blocks=len(res.new_blocks),
            reused_blocks=len(res.block_table) - len(res.new_blocks),
            free=self.kv.pool.num_free,
        )
        self.send(
            "scheduler",
            AdmitResult(
                request_id=rid,
                attempt=msg.attempt,
                ok=True,
                block_table=res.block_table,
                cached_tokens=res.cached_tokens,
                evicted=res.evicted_blocks,
                in_use=self.kv.stats().in_use,
                num_blocks=self.kv.pool.num_blocks,
            ),
        )

    def _grow(self, rid: str, attempt: int, total: int) -> bool:
        """Grant blocks for ``total`` tokens, or record the shortage and report it (the scheduler
        decides whether to preempt). True if granted."""
        res = self.kv.extend(rid, total)
        if isinstance(res, Extended):
            self.pending_growth.pop(rid, None)
            if res.evicted_blocks:
                self.log.info("kv.evicted", request_id=rid, blocks=res.evicted_blocks)
            if res.new_blocks:
                self.log.info(
                    "kv.extended", request_id=rid, blocks=res.new_blocks, total_tokens=total
                )
                self.send(
                    "executor", Extend(request_id=rid, attempt=attempt, blocks=res.new_blocks)
                )
            return True
        self.pending_growth[rid] = (attempt, total)
        self.log.info("kv.shortage", request_id=rid, **_numbers(res))
        self.send("scheduler", GrowthShortage(request_id=rid, attempt=attempt, **_numbers(res)))
        return False

    def _after_free(self, rid: str, reason: str, freed: list[int]) -> None:
        self.attempts.pop(rid, None)
        self.pending_growth.pop(rid, None)
        self.log.info(
            "kv.released",
            request_id=rid,
            reason=reason,
            freed=len(freed),
            free=self.kv.pool.num_free,
        )
        for other, (attempt, total) in list(self.pending_growth.items()):
            if not self._current(other, attempt):
                self.pending_growth.pop(other, None)
            elif not self._grow(other, attempt, total):
                break  # oldest first: the rest wait for the next free
