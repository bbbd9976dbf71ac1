"""KVManagerCore: the KV-manager actor's decisions, as a pure state machine over ``BlockManager``.

Inputs are protocol messages; outputs are messages to send (``take_outbox``: ``(peer, msg)``
pairs), replies returned to the caller, and events logged. No sockets, no clock.

- ``admit(Admit)``: reuse the cached prefix and allocate, or refuse with the numbers; answered
  with ``AdmitResult`` to the scheduler. A request still held by an earlier attempt is released
  first (its Release was lost with a restarted scheduler).
- ``grow(Grow)``: decode-time growth, granted straight to the executor (``Extend``). A shortage
  is reported to the scheduler (``GrowthShortage``), which decides preemption, and the growth is
  retried, oldest first, whenever blocks are freed.
- ``cache_prefix(CachePrefix)``: cache the prompt's full blocks after prefill.
- ``leave(Finish | Release)``: cache then drop, or drop; always answered with ``BlocksFreed``
  (also for a stale attempt) so the scheduler can count frees in flight.
- ``match(MatchQuery)``/``stats(check)``: the replies to queries.
- ``peer_dead(name, reason)``: every request's blocks are dropped; if the executor died its KV
  tensors died with it, so the prefix cache is emptied too.
- ``report(Rebuild | Holding)``: this KV manager is a restarted one; once the scheduler's and
  the executor's reports are in, the pool holds the running requests' blocks again (rebuild.py)
  and the scheduler hears ``KVRebuilt``. What arrives in between waits.

Messages for an attempt the core does not hold (stale after a preemption or a restart) are
ignored. Events (all ``kv.*`` / ``prefix.*``): kv.config, kv.refused, prefix.matched,
kv.evicted, kv.allocated, kv.extended, kv.shortage, kv.released, kv.cached, kv.cache_error,
kv.finish_error, kv.stale_request, kv.reset, kv.rebuilt, kv.rebuild_failed; the disk tier's
(``disk_control.py``: kv.disk_*) when the executor keeps one (``--kv-disk-dir``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from actors.kv.block_manager import BlockManager
from actors.kv.disk_control import DiskControl
from actors.kv.rebuild import Rebuild, Rebuilding
from actors.kv.results import Extended, Refused, Shortage
from actors.kv.state import CoreState, Outgoing
from actors.runtime.config import KVConfig
from actors.shared.errors import KVError
from messages import kv as km
from messages.common import Reconcile
from messages.executor import Extend
from messages.scheduler import AdmitResult, BlocksFreed, GrowthShortage, KVHeld, KVRebuilt


def _numbers(res: Refused | Shortage) -> dict[str, int]:
    """The block counts behind a refusal or a shortage, as events and messages name them."""
    return {
        "blocks_needed": res.blocks_needed,
        "blocks_free": res.blocks_free,
        "blocks_evictable": res.blocks_evictable,
    }


class KVManagerCore:
    def __init__(self, num_blocks: int, cfg: KVConfig, log: Any) -> None:
        self.cfg = cfg
        self.log = log
        self.state = CoreState(self._new_manager(num_blocks), log)
        self.rebuild = Rebuild(self.state, self._new_manager, self._grow, self.handle)
        self.disk = DiskControl(cfg.disk_bytes, log, self.state.send)  # inert until announced
        self.log.info(
            "kv.config",
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            mode=cfg.mode,
            lookahead_blocks=cfg.lookahead_blocks,
        )

    def _new_manager(self, num_blocks: int) -> BlockManager:
        c = self.cfg
        return BlockManager(
            num_blocks, c.block_size, mode=c.mode, lookahead_blocks=c.lookahead_blocks
        )

    # the state the parts share, under the names the core's code reads
    @property
    def mgr(self) -> BlockManager:
        return self.state.mgr

    @mgr.setter
    def mgr(self, mgr: BlockManager) -> None:
        self.state.mgr = mgr

    @property
    def attempts(self) -> dict[str, int]:
        return self.state.attempts

    @property
    def pending_growth(self) -> OrderedDict[str, tuple[int, int]]:
        return self.state.pending_growth

    @property
    def outbox(self) -> list[Outgoing]:
        return self.state.outbox

    @property
    def rebuilding(self) -> Rebuilding | None:
        """The reports of a restarted KV manager so far, while it waits for the rest."""
        return self.rebuild.rebuilding

    def _send(self, peer: str, msg: msgspec.Struct) -> None:
        self.state.send(peer, msg)

    def take_outbox(self) -> list[Outgoing]:
        out, self.state.outbox = self.state.outbox, []
        return out

    def _current(self, rid: str, attempt: int) -> bool:
        return self.attempts.get(rid) == attempt and rid in self.mgr

    # ---------------------------------------------------------------- requests
    def admit(self, msg: km.Admit) -> None:
        rid, mgr = msg.request_id, self.mgr
        if rid in mgr:  # a previous attempt was never released: release it now
            self.log.warning("kv.stale_request", request_id=rid, attempt=self.attempts.get(rid))
            mgr.release(rid, preempted=False)
        try:
            reserve = max(msg.reserve_tokens, len(msg.token_ids))
            res = mgr.admit(rid, msg.token_ids, reserve, msg.cache_salt)
        except KVError as e:
            res = Refused(str(e), 0, mgr.pool.num_free, 0, fatal=True)
        if isinstance(res, Refused):
            nums = _numbers(res)
            self.log.info("kv.refused", request_id=rid, reason=res.reason, fatal=res.fatal, **nums)
            refusal = AdmitResult(
                request_id=rid,
                attempt=msg.attempt,
                ok=False,
                reason=res.reason,
                fatal=res.fatal,
                blocks_needed=res.blocks_needed,
                blocks_free=res.blocks_free,
                blocks_evictable=res.blocks_evictable,
                pinned=self.disk.pinning(),
            )
            self._send("scheduler", refusal)
            return
        self.attempts[rid] = msg.attempt
        loads, keys = self.disk.admitted(mgr, rid, msg.token_ids, msg.cache_salt, res.cached_tokens)
        cached = res.cached_tokens + len(loads) * mgr.block_size
        if cached:
            self.log.info(
                "prefix.matched",
                request_id=rid,
                cached_tokens=cached,
                disk_tokens=cached - res.cached_tokens,
                prompt_tokens=len(msg.token_ids),
            )
        if res.evicted_blocks:
            self.log.info("kv.evicted", request_id=rid, blocks=res.evicted_blocks)
        self.log.info(
            "kv.allocated",
            request_id=rid,
            new_blocks=len(res.new_blocks),
            reused_blocks=len(res.block_table) - len(res.new_blocks),
            free=mgr.pool.num_free,
            in_use=mgr.stats().in_use,  # the rest of the pool is cached-only (the dashboard)
        )
        result = AdmitResult(
            request_id=rid,
            attempt=msg.attempt,
            ok=True,
            block_table=res.block_table,
            cached_tokens=cached,
            evicted=res.evicted_blocks,
            in_use=mgr.stats().in_use,
            num_blocks=mgr.pool.num_blocks,
            load_blocks=loads,
            load_keys=keys,
        )
        self._send("scheduler", result)

    def grow(self, msg: km.Grow) -> None:
        if self._current(msg.request_id, msg.attempt):
            self._grow(msg.request_id, msg.attempt, msg.total_tokens, msg.needed_tokens)

    def _grow(self, rid: str, attempt: int, total: int, needed: int = 0) -> bool:
        """Grant blocks for ``total`` tokens (else, when ``needed`` is less, for ``needed``), or
        record the shortage and report it (the scheduler decides whether to preempt). True if
        granted."""
        res = self.mgr.extend(rid, total)
        if not isinstance(res, Extended) and 0 < needed < total:
            total = needed  # the drafts' room is not worth a preemption
            res = self.mgr.extend(rid, total)
        if isinstance(res, Extended):
            self.pending_growth.pop(rid, None)
            if res.evicted_blocks:
                self.log.info("kv.evicted", request_id=rid, blocks=res.evicted_blocks)
            if res.new_blocks:
                self.log.info(
                    "kv.extended",
                    request_id=rid,
                    blocks=res.new_blocks,
                    total_tokens=total,
                    free=self.mgr.pool.num_free,
                    in_use=self.mgr.stats().in_use,
                )
                ext = Extend(request_id=rid, attempt=attempt, blocks=res.new_blocks)
                self._send("executor", ext)
            return True
        self.pending_growth[rid] = (attempt, total)
        nums = _numbers(res)
        self.log.info("kv.shortage", request_id=rid, **nums)
        self._send("scheduler", GrowthShortage(request_id=rid, attempt=attempt, **nums))
        return False

    def cache_prefix(self, msg: km.CachePrefix) -> None:
        if not self._current(msg.request_id, msg.attempt):
            return
        try:
            n = self.mgr.cache_prefix(msg.request_id, msg.token_ids)
            self.log.debug("kv.cached", request_id=msg.request_id, new_blocks=n)
            self.disk.cached(self.mgr, msg.token_ids, self.mgr.requests[msg.request_id].salt)
        except KVError as e:
            self.log.error("kv.cache_error", request_id=msg.request_id, reason=str(e))

    def leave(self, msg: km.Finish | km.Release) -> None:
        """Finish (cache, then drop) or release (drop) a request's blocks; then ``BlocksFreed``."""
        rid, mgr = msg.request_id, self.mgr
        if self._current(rid, msg.attempt):
            try:
                if isinstance(msg, km.Finish):
                    salt = mgr.requests[rid].salt
                    freed, reason = mgr.finish(rid, msg.token_ids), "finished"
                    self.disk.cached(mgr, msg.token_ids, salt)
                else:
                    freed = mgr.release(rid, preempted=msg.reason == "preempted")
                    reason = msg.reason
            except KVError as e:  # bad token ids for the cache: still free the blocks
                self.log.error("kv.finish_error", request_id=rid, reason=str(e))
                freed, reason = mgr.release(rid, preempted=False), "finish_error"
            self._after_free(rid, reason, freed)
        self._freed()

    def _freed(self, answer: bool = True) -> None:
        s = self.mgr.stats()
        freed_msg = BlocksFreed(
            free=s.free,
            evictable=s.evictable,
            in_use=s.in_use,
            num_blocks=s.num_blocks,
            answer=answer,
            disk_bytes=tier.bytes if (tier := self.disk.tier) is not None else 0,
        )
        self._send("scheduler", freed_msg)

    def _unpinned(self) -> None:
        """Blocks a disk write pinned are evictable again: growth and admission retry."""
        self._retry_growth()
        self._freed(answer=False)

    def _after_free(self, rid: str, reason: str, freed: list[int]) -> None:
        self.attempts.pop(rid, None)
        self.pending_growth.pop(rid, None)
        self.log.info(
            "kv.released",
            request_id=rid,
            reason=reason,
            freed=len(freed),
            free=self.mgr.pool.num_free,
            in_use=self.mgr.stats().in_use,
        )
        self._retry_growth()

    def _retry_growth(self) -> None:
        for other, (attempt, total) in list(self.pending_growth.items()):
            if not self._current(other, attempt):
                self.pending_growth.pop(other, None)
            elif not self._grow(other, attempt, total):
                break  # oldest first: the rest wait for the next free

    # ----------------------------------------------------------------- queries
    def handle(self, msg: km.KVInbound) -> km.MatchReply | km.Stats | KVHeld | None:
        """Dispatch one inbound message; returns the answer to a query (``kv_match``,
        ``kv_stats``) for the sender's connection, else None (what to send is in the outbox)."""
        if isinstance(msg, (km.Rebuild, km.Holding)):
            self.rebuild.report(msg)
        elif isinstance(msg, Reconcile):
            return self.held()
        elif isinstance(msg, km.DiskTier):
            self.disk.announce(msg)
        elif isinstance(msg, km.DiskSaved):
            if self.disk.saved(self.mgr, msg):
                self._unpinned()
        elif isinstance(msg, km.DiskDropped):
            self.disk.dropped(msg)
        elif isinstance(msg, km.DiskRates):
            self.disk.rates(msg)
        elif self.rebuilding is not None and not isinstance(msg, (km.MatchQuery, km.StatsQuery)):
            self.rebuilding.deferred.append(msg)  # after the rebuild
        elif isinstance(msg, km.Admit):
            self.admit(msg)
        elif isinstance(msg, km.Grow):
            self.grow(msg)
        elif isinstance(msg, km.CachePrefix):
            self.cache_prefix(msg)
        elif isinstance(msg, (km.Finish, km.Release)):
            self.leave(msg)
        elif isinstance(msg, km.MatchQuery):
            return self.match(msg)
        elif isinstance(msg, km.StatsQuery):
            return self.stats(msg.check)
        return None

    def held(self) -> KVHeld:
        """Every request that holds blocks: the answer to a (re)started scheduler's
        ``reconcile``. Growth still waiting for blocks is reported again (a shortage sent to the
        dead scheduler may never have been read)."""
        allocations = [
            km.HeldBlocks(rid, self.attempts.get(rid, 0), list(st.blocks))
            for rid, st in self.mgr.requests.items()
        ]
        for rid, (attempt, total) in list(self.pending_growth.items()):
            if self._current(rid, attempt):
                self._grow(rid, attempt, total)
        self.log.info("kv.reconcile_answered", requests=len(allocations))
        return KVHeld(allocations=allocations)

    def match(self, msg: km.MatchQuery) -> km.MatchReply:
        salts = msg.salts or [""] * len(msg.token_lists)
        mgr, out = self.mgr, []
        for t, s in zip(msg.token_lists, salts, strict=False):
            pool = mgr.peek_match(t, s)
            out.append(pool + self.disk.peek(mgr, t, s, pool))
        return km.MatchReply(cached_tokens=out)

    def stats(self, check: bool) -> km.Stats:
        s = self.mgr.stats()
        ok, err = True, ""
        if check:
            try:
                self.mgr.check()
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
            **self.disk.stats(),
        )

    # --------------------------------------------------------------- failures
    def peer_dead(self, name: str, reason: str) -> None:
        """The scheduler died: keep every block (its successor reconciles from ``held``). The
        executor died: its KV died with it, start empty. The front door died: drop every
        request's blocks (the scheduler fails them all). A rebuild waiting for the dead peer's
        report goes on without the scheduler's, or is given up (the scheduler is told)."""
        if name == "scheduler":
            if self.rebuilding is not None:
                self.rebuilding.scheduler_gone = True  # the executor's tables are the truth
                if self.rebuilding.ready:
                    self.rebuild.rebuild(self.rebuilding)
            self.log.warning("kv.scheduler_lost", reason=reason, running=len(self.mgr.requests))
            return
        if self.rebuilding is not None:
            waited, self.rebuild.rebuilding = self.rebuilding, None
            if waited.running is not None:
                why = f"{name} died during the rebuild: {reason}"
                self.log.error("kv.rebuild_failed", reason=why, requests=len(waited.running))
                self._send("scheduler", KVRebuilt(ok=False, reason=why))
        if name == "executor":
            self.mgr = self._new_manager(self.mgr.pool.num_blocks)
            self.disk.reset()
        else:
            for rid in list(self.mgr.requests):
                self.mgr.release(rid, preempted=False)
        self.attempts.clear()
        self.pending_growth.clear()
        s = self.mgr.stats()
        self.log.warning(
            "kv.reset",
            reason=reason,
            cache_cleared=name == "executor",
            free=s.free,
            cached=s.cached,
        )
