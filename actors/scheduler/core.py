"""Scheduler policy: a pure, synchronous state machine. Inputs are protocol messages; outputs are
messages to send (``outbox``) and events logged. No sockets, no clock but the one injected.

Who gets in: the queue's head is offered to the KV manager (one admission in flight at a time,
while running + admitting < max_batch_size). A refusal parks admission until blocks are freed.
Who moves on: the executor reports each request's end (finished / aborted / preempted / error);
the scheduler then tells the KV manager to cache (finish) or drop (release) its blocks.
Preemption: on a decode-time shortage the scheduler picks a victim, stops it in the executor and,
once stopped, releases its blocks and requeues it at the front with the tokens it generated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.prefix_defer import PrefixDeferral
from actors.scheduler.queue import LPMQueue, make_queue
from actors.scheduler.state import SchedRequest, Status
from messages import executor as xm
from messages import kv as km
from messages import tokenizer as tm
from messages.common import ErrorCode
from messages.scheduler import (
    AdmitResult,
    BlocksFreed,
    GrowthShortage,
    PrefillDone,
    RequestDone,
    Submit,
)

Outgoing = tuple[str, msgspec.Struct]


class SchedulerCore:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVConfig,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.log = log
        self.clock = clock
        self.queue = make_queue(cfg.policy, cfg.max_wait_s)
        self.matching = False  # lpm: a MatchQuery is out
        self.defer = PrefixDeferral(cfg.prefix_defer_tokens)
        self.requests: dict[str, SchedRequest] = {}
        self.running: dict[str, SchedRequest] = {}  # holds blocks (running/preempting/stopping)
        self.admitting: SchedRequest | None = None
        self.kv_blocked = False  # last admission refused: wait for BlocksFreed
        self.frees_in_flight = 0  # Finish/Release sent, BlocksFreed not yet back
        self.preempting: str | None = None
        self.outbox: list[Outgoing] = []
        self._seq = 0
        self._admit_seq = 0
        self.counters = {"admitted": 0, "refused": 0, "preemptions": 0, "finished": 0, "aborted": 0}

    # ---------------------------------------------------------------- helpers
    def _emit(self, peer: str, msg: msgspec.Struct) -> None:
        if isinstance(msg, (km.Finish, km.Release)):
            self.frees_in_flight += 1
        self.outbox.append((peer, msg))

    def take_outbox(self) -> list[Outgoing]:
        out, self.outbox = self.outbox, []
        return out

    def _fail(self, req: SchedRequest, code: str, message: str, field: str | None = None) -> None:
        self.log.info("request.failed", request_id=req.request_id, code=code, reason=message)
        self._emit(
            "tokenizer",
            tm.RequestFailed(request_id=req.request_id, code=code, message=message, field=field),
        )
        self._drop(req)

    def _drop(self, req: SchedRequest) -> None:
        req.status = Status.DONE
        self._release_prefix(req.request_id)
        self.requests.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        self.queue.remove(req.request_id)

    def _reserve(self, req: SchedRequest) -> int:
        n = len(req.tokens_now())
        full = self.kv.mode == "full" or req.preemptions > self.cfg.max_preemptions
        if full:
            return n + req.remaining_tokens()
        return n + self.kv.lookahead_blocks * self.kv.block_size

    # ----------------------------------------------------------------- inputs
    def submit(self, msg: Submit) -> None:
        rid = msg.request_id
        if rid in self.requests:
            self.log.warning("request.duplicate", request_id=rid)
            self._emit(
                "tokenizer",
                tm.RequestFailed(
                    request_id=rid,
                    code=ErrorCode.INVALID,
                    message="duplicate request_id",
                    field="request_id",
                ),
            )
            return
        if len(self.queue) >= self.cfg.max_waiting:
            self.log.info(
                "request.overloaded",
                request_id=rid,
                waiting=len(self.queue),
                max_waiting=self.cfg.max_waiting,
            )
            self._emit(
                "tokenizer",
                tm.RequestFailed(
                    request_id=rid,
                    code=ErrorCode.OVERLOADED,
                    message=f"waiting queue full ({len(self.queue)} >= max_waiting {self.cfg.max_waiting})",
                ),
            )
            return
        self._seq += 1
        req = SchedRequest(rid, msg.prompt_ids, msg.params, msg.arrival, self.clock(), self._seq)
        self.requests[rid] = req
        self.queue.push(req)
        self.log.info(
            "request.queued",
            request_id=rid,
            prompt_tokens=len(msg.prompt_ids),
            waiting=len(self.queue),
            running=len(self.running),
        )
        self.schedule()

    def abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        self.log.info("request.aborted", request_id=rid, reason=reason, status=req.status.value)
        self.counters["aborted"] += 1
        if req.status is Status.WAITING:
            self._drop(req)
        elif req.status is Status.RUNNING:
            req.status = Status.STOPPING
            self._emit("executor", xm.Stop(request_id=rid, attempt=req.attempt, reason=reason))
        else:  # admitting / preempting / stopping: act when the pending answer arrives
            req.abort_reason = reason

    def admit_result(self, msg: AdmitResult) -> None:
        req = self.admitting
        if req is None or req.request_id != msg.request_id or req.attempt != msg.attempt:
            self.log.warning("admission.stale", request_id=msg.request_id, attempt=msg.attempt)
            if msg.ok:  # blocks granted to something we no longer track: give them back
                self._emit(
                    "kv_manager",
                    km.Release(request_id=msg.request_id, attempt=msg.attempt, reason="stale"),
                )
            return
        self.admitting = None
        if not msg.ok:
            self.counters["refused"] += 1
            self.log.info(
                "admission.refused",
                request_id=req.request_id,
                reason=msg.reason,
                blocks_needed=msg.blocks_needed,
                blocks_free=msg.blocks_free,
                blocks_evictable=msg.blocks_evictable,
                running=len(self.running),
            )
            if req.abort_reason is not None:
                self._drop(req)
            elif msg.fatal or (not self.running and not self.frees_in_flight):
                self._fail(
                    req, ErrorCode.TOO_LONG, f"cannot fit in the KV pool: {msg.reason}", "prompt"
                )
            else:
                req.status = Status.WAITING
                self.kv_blocked = True
            self.schedule()
            return
        if req.abort_reason is not None:
            self._emit(
                "kv_manager",
                km.Release(request_id=req.request_id, attempt=req.attempt, reason=req.abort_reason),
            )
            self._drop(req)
            self.schedule()
            return
        self.queue.remove(req.request_id)
        self.defer.admitted(req, msg.cached_tokens)
        self._admit_seq += 1
        req.admitted_seq = self._admit_seq
        req.status = Status.RUNNING
        self.running[req.request_id] = req
        req.queue_s += max(0.0, self.clock() - req.enqueued)
        self.counters["admitted"] += 1
        self.log.info(
            "request.admitted",
            request_id=req.request_id,
            attempt=req.attempt,
            blocks=len(msg.block_table),
            cached_tokens=msg.cached_tokens,
            queue_s=round(req.queue_s, 6),
            running=len(self.running),
        )
        self._emit(
            "executor",
            xm.Run(
                request_id=req.request_id,
                attempt=req.attempt,
                prompt_ids=req.tokens_now(),
                params=req.params,  # the original max_tokens: the executor counts output_offset
                block_table=msg.block_table,
                cached_tokens=msg.cached_tokens,
                output_offset=len(req.output_ids),
            ),
        )
        self._emit(
            "tokenizer",
            tm.RequestAdmitted(
                request_id=req.request_id,
                cached_tokens=msg.cached_tokens,
                queue_s=req.queue_s,
                attempt=req.attempt,
            ),
        )
        self.schedule()

    def request_done(self, msg: RequestDone) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.attempt != msg.attempt or not req.status.holds_blocks:
            self.log.warning("request.done_stale", request_id=msg.request_id, status=msg.status)
            return
        rid = req.request_id
        if self.preempting == rid:
            self.preempting = None
        if msg.status == "finished":
            self.counters["finished"] += 1
            self._emit(
                "kv_manager",
                km.Finish(request_id=rid, attempt=req.attempt, token_ids=msg.kv_token_ids),
            )
            self.log.info(
                "request.finished",
                request_id=rid,
                finish_reason=msg.finish_reason,
                output_tokens=len(req.output_ids) + len(msg.output_ids),
                preemptions=req.preemptions,
            )
            self._drop(req)
        elif msg.status == "preempted" and req.abort_reason is None:
            self._emit(
                "kv_manager", km.Release(request_id=rid, attempt=req.attempt, reason="preempted")
            )
            self.running.pop(rid, None)
            self._release_prefix(rid)
            req.output_ids.extend(msg.output_ids)
            req.preemptions += 1
            req.status = Status.WAITING
            req.enqueued = self.clock()
            if req.yield_to_priority:  # preempted for a more important request: queue by policy
                req.yield_to_priority = False
                self.queue.push(req)
            else:
                self.queue.push_front(req)
            self.log.info(
                "request.requeued",
                request_id=rid,
                preemptions=req.preemptions,
                generated=len(req.output_ids),
                full_reservation_next=req.preemptions > self.cfg.max_preemptions,
            )
        else:
            self._emit(
                "kv_manager", km.Release(request_id=rid, attempt=req.attempt, reason=msg.status)
            )
            if msg.status == "error":
                self._fail(req, ErrorCode.INVALID, msg.message, msg.field)
            else:
                self._drop(req)
        self.schedule()

    def shortage(self, msg: GrowthShortage) -> None:
        req = self.running.get(msg.request_id)
        if req is None or req.attempt != msg.attempt or req.status is not Status.RUNNING:
            return
        if self.preempting is not None:
            return  # one preemption at a time; the KV manager reports again if still short
        victim = self.pick_victim()
        if victim is None:
            return
        self._preempt(
            victim,
            msg.request_id,
            self.kv.victim_policy,
            blocks_needed=msg.blocks_needed,
            blocks_free=msg.blocks_free,
        )

    def _preempt(self, victim: SchedRequest, for_request: str, policy: str, **why: Any) -> None:
        """Stop ``victim`` in the executor; it is requeued once the executor confirms."""
        self.preempting = victim.request_id
        victim.status = Status.PREEMPTING
        self.counters["preemptions"] += 1
        self.log.info(
            "request.preempted",
            request_id=victim.request_id,
            attempt=victim.attempt,
            for_request=for_request,
            policy=policy,
            **why,
        )
        self._emit("executor", xm.Preempt(request_id=victim.request_id, attempt=victim.attempt))

    def pick_victim(self) -> SchedRequest | None:
        """Newest admitted running request, or with ``priority`` the lowest priority (ties: newest)."""
        live = [r for r in self.running.values() if r.status is Status.RUNNING]
        if not live:
            return None
        if self.kv.victim_policy == "priority":
            return min(live, key=lambda r: (r.priority, -r.admitted_seq))
        return max(live, key=lambda r: r.admitted_seq)

    def blocks_freed(self, msg: BlocksFreed) -> None:
        self.frees_in_flight = max(0, self.frees_in_flight - 1)
        if self.kv_blocked:
            self.log.debug("admission.retry", free=msg.free, evictable=msg.evictable)
        self.kv_blocked = False
        self.schedule()

    def reset(self, reason: str) -> None:
        """An actor died: every request in flight is lost. Fail them all and start empty. Blocks
        held for them are released and the executor told to stop them (both ignore requests they
        no longer know, e.g. when they are the ones that restarted)."""
        for req in list(self.requests.values()):
            if req.status.holds_blocks or req.status is Status.ADMITTING:
                self._emit(
                    "executor",
                    xm.Stop(request_id=req.request_id, attempt=req.attempt, reason="reset"),
                )
                self._emit(
                    "kv_manager",
                    km.Release(request_id=req.request_id, attempt=req.attempt, reason="reset"),
                )
            self._fail(req, ErrorCode.ACTOR_DEAD, f"{reason}; request aborted")
        self.defer.clear()
        self.admitting = None
        self.preempting = None
        self.kv_blocked = False
        self.frees_in_flight = 0
        self.queue = make_queue(self.cfg.policy, self.cfg.max_wait_s)
        self.matching = False
        self.log.warning("scheduler.reset", reason=reason)

    # ------------------------------------------------------------- admission
    def schedule(self) -> None:
        """Offer the next request (by policy) to the KV manager if nothing blocks admission."""
        if self.admitting is not None or self.matching:
            return
        now = self.clock()
        if self.kv_blocked or len(self.running) >= self.cfg.max_batch_size:
            self._maybe_preempt_for_priority(now)
            return
        if isinstance(self.queue, LPMQueue):
            cands = self.queue.candidates()
            if cands and self.queue.scores_for != [r.request_id for r in cands]:
                self.matching = True
                self.queue.scores_for = [r.request_id for r in cands]
                self._emit("kv_manager", km.MatchQuery(token_lists=[r.tokens_now() for r in cands]))
                return
        req = self.queue.peek(now)
        held = 0
        while req is not None and held < 64 and (owner := self.defer.owner_for(req)) is not None:
            self.queue.remove(req.request_id)
            self.defer.hold(req)
            self.log.info(
                "request.deferred",
                request_id=req.request_id,
                prefix_of=owner,
                prefix_tokens=self.defer.tokens,
            )
            held += 1
            req = self.queue.peek(now)
        if req is None or held >= 64:
            return
        if self.queue.aged(req, now):
            self.log.info(
                "request.aged", request_id=req.request_id, waited_s=round(now - req.enqueued, 3)
            )
        req.status = Status.ADMITTING
        req.attempt += 1
        self.admitting = req
        tokens = req.tokens_now()
        self._emit(
            "kv_manager",
            km.Admit(
                request_id=req.request_id,
                attempt=req.attempt,
                token_ids=tokens,
                reserve_tokens=self._reserve(req),
            ),
        )

    def prefill_done(self, msg: PrefillDone) -> None:
        """Cache the prompt's full blocks, then readmit the requests that waited for them."""
        req = self.running.get(msg.request_id)
        if req is None or req.attempt != msg.attempt:
            return
        self._emit(
            "kv_manager",
            km.CachePrefix(
                request_id=req.request_id, attempt=req.attempt, token_ids=req.tokens_now()
            ),
        )
        self._release_prefix(req.request_id)
        self.schedule()

    def _release_prefix(self, rid: str) -> None:
        for r in reversed(self.defer.release(rid)):
            self.queue.push_front(r)

    def match_reply(self, msg: km.MatchReply) -> None:
        """lpm: cached prefix lengths of the candidates, in the order they were asked."""
        self.matching = False
        if isinstance(self.queue, LPMQueue):
            ids = self.queue.scores_for
            self.queue.set_scores(dict(zip(ids, msg.cached_tokens, strict=False)))
        self.schedule()
        if isinstance(self.queue, LPMQueue):
            self.queue.scores_for = []  # the cache changes with every admission: ask again next time

    def _maybe_preempt_for_priority(self, now: float) -> None:
        """With ``priority_preemption``, a waiting request that is more important (lower
        priority value) than a running one preempts it when admission is blocked."""
        if not self.cfg.priority_preemption or self.preempting is not None:
            return
        head = self.queue.peek(now)
        if head is None:
            return
        live = [r for r in self.running.values() if r.status is Status.RUNNING]
        if not live:
            return
        victim = max(live, key=lambda r: (r.priority, r.admitted_seq))
        if victim.priority <= head.priority:
            return
        victim.yield_to_priority = True
        self._preempt(
            victim,
            head.request_id,
            "priority",
            victim_priority=victim.priority,
            waiting_priority=head.priority,
        )
