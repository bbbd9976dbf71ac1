"""SchedulerCore: the scheduler's policy as a pure, synchronous state machine (a request's life
cycle). Inputs are protocol messages; outputs are messages to send (``take_outbox``) and events
logged. No sockets, no clock but the one injected, so a replay can drive it on a virtual clock.

Life cycle: ``submit`` queues a request; ``schedule`` offers the queue's choice to the KV manager
(one admission in flight, while running + admitting < ``max_batch_size``; admission.py); the
answer runs it in the executor or parks admission until blocks are freed; the executor reports
its end (``request_done``: finished / aborted / preempted / error) and the scheduler tells the KV
manager to cache (``kv_finish``) or drop (``kv_release``) its blocks. A decode-time shortage
preempts a victim (preemption.py), which is requeued at the front with the tokens it generated.

Public API (stable; the actor, the metrics, benchmarks and replays use only this):

``SchedulerCore(cfg: SchedulerConfig, kv: KVConfig, log, clock=time.monotonic)``
    ``log``: a structlog-style logger (``info``/``debug``/``warning`` with an event name and
    fields); ``clock``: seconds, monotonic; read for queue times and aging, never slept on.
Inputs, each may append to the outbox and logs its events:
    ``submit(Submit)``, ``abort(request_id, reason)`` (from the tokenizer);
    ``admit_result(AdmitResult)``, ``shortage(GrowthShortage)``, ``blocks_freed(BlocksFreed)``,
    ``match_reply(MatchReply)`` (from the KV manager);
    ``request_done(RequestDone)``, ``prefill_done(PrefillDone)`` (from the executor);
    ``reset(reason)`` (an actor died: fail every request, start empty);
    ``reconcile(LiveRequests, ExecutorHeld, KVHeld)`` (a restarted scheduler rebuilds its state
    from its peers' answers; reconcile.py);
    ``kv_lost(reason)``, ``kv_back(executor_alive)``, ``kv_rebuilt(KVRebuilt)`` (the KV manager
    died and its successor rebuilds its pool: running requests go on; recovery.py);
    ``schedule()`` (offer the next request if nothing blocks; the inputs call it themselves).
Output: ``take_outbox() -> list[(peer, message)]``, peers ``"kv_manager"``, ``"executor"``,
    ``"tokenizer"``, in send order (``outbox`` is the same list, not emptied).
State, read-only for callers: ``queue`` (the waiting queue: ``len``, ``in``, iteration),
    ``requests`` (every live request by id), ``running`` (requests holding blocks, admission
    order), ``admission`` (``AdmissionState``), ``admitting``, ``preempting``,
    ``frees_in_flight``, ``counters`` (admitted, refused, preemptions, finished, aborted),
    ``pick_victim()`` (who a shortage would preempt now).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from actors.kv.blockhash import chain_hashes
from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.admission import AdmissionMixin
from actors.scheduler.base import AdmissionState
from actors.scheduler.preemption import PreemptionMixin
from actors.scheduler.queue import make_queue
from actors.scheduler.reconcile import ReconcileMixin
from actors.scheduler.recovery import RecoveryMixin
from actors.scheduler.state import SchedRequest, Status
from messages import executor as xm
from messages import kv as km
from messages import tokenizer as tm
from messages.common import ErrorCode
from messages.scheduler import (
    Abort,
    AdmitResult,
    BlocksFreed,
    GrowthShortage,
    KVRebuilt,
    PrefillDone,
    RequestDone,
    Submit,
)

__all__ = ["AdmissionState", "SchedulerCore"]


class SchedulerCore(RecoveryMixin, ReconcileMixin, AdmissionMixin, PreemptionMixin):
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVConfig,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cfg, kv, log, clock)

    # ----------------------------------------------------------------- arrival
    def submit(self, msg: Submit) -> None:
        rid = msg.request_id
        if rid in self.reconciled_ids and not msg.resume_reason:
            # its submit reached the dead scheduler's successor as well as its reconciliation
            self.reconciled_ids.discard(rid)
            self.log.info("request.submit_reconciled", request_id=rid)
            return
        if rid in self.requests:
            self.log.warning("request.duplicate", request_id=rid)
            dup = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.INVALID,
                message="duplicate request_id",
                field="request_id",
            )
            self._send("tokenizer", dup)
            return
        if len(msg.output_ids) >= msg.params.max_tokens:
            bad = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.INVALID,
                message=f"{len(msg.output_ids)} tokens already generated, max_tokens is "
                f"{msg.params.max_tokens}: nothing to resume",
                field="output_ids",
            )
            self._send("tokenizer", bad)
            return
        # A resumed request was accepted before its attempt died: never refused as overload.
        if not msg.resume_reason and len(self.queue) >= self.cfg.max_waiting:
            waiting, cap = len(self.queue), self.cfg.max_waiting
            self.log.info("request.overloaded", request_id=rid, waiting=waiting, max_waiting=cap)
            full = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.OVERLOADED,
                message=f"waiting queue full ({waiting} >= max_waiting {cap})",
            )
            self._send("tokenizer", full)
            return
        self._seq += 1
        req = SchedRequest(rid, msg.prompt_ids, msg.params, msg.arrival, self.clock(), self._seq)
        req.output_ids = list(msg.output_ids)
        self.requests[rid] = req
        if msg.resume_reason:
            self.log.info(
                "request.resumed",
                request_id=rid,
                reason=msg.resume_reason,
                resumes=msg.resumes,
                output_tokens=len(msg.output_ids),
                recomputed_tokens=len(req.tokens_now()),
            )
            self.queue.push_front(req)  # it was running or waiting before: ahead of new ones
        else:
            self.queue.push(req)
        self.log.info(
            "request.queued",
            request_id=rid,
            prompt_tokens=len(msg.prompt_ids),
            max_tokens=msg.params.max_tokens,
            priority=msg.params.priority,
            block_hashes=chain_hashes(msg.prompt_ids, self.kv.block_size),  # for replays
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
            self._send("executor", xm.Stop(request_id=rid, attempt=req.attempt, reason=reason))
        else:  # admitting / preempting / stopping: act when the pending answer arrives
            req.abort_reason = reason

    # --------------------------------------------------------------- admission
    def handle(self, msg: Any) -> bool:
        """Dispatch one message of the scheduling protocol (the scheduler's inbound messages and
        the KV manager's ``kv_match_reply``); False if it is not one of them."""
        if isinstance(msg, Submit):
            self.submit(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id, msg.reason)
        elif isinstance(msg, AdmitResult):
            self.admit_result(msg)
        elif isinstance(msg, RequestDone):
            self.request_done(msg)
        elif isinstance(msg, GrowthShortage):
            self.shortage(msg)
        elif isinstance(msg, BlocksFreed):
            self.blocks_freed(msg)
        elif isinstance(msg, PrefillDone):
            self.prefill_done(msg)
        elif isinstance(msg, km.MatchReply):
            self.match_reply(msg)
        elif isinstance(msg, KVRebuilt):
            self.kv_rebuilt(msg)
        else:
            return False
        return True

    def schedule(self) -> None:
        """Offer the next request (by policy) to the KV manager if nothing blocks admission;
        while it is blocked, a more important waiting request may preempt (priority)."""
        if self.admission in (AdmissionState.ADMITTING, AdmissionState.MATCHING):
            return
        if not self.kv_serving:
            return
        now = self.clock()
        if self.admission is AdmissionState.BLOCKED or len(self.running) >= self.cfg.max_batch_size:
            self._preempt_for_priority(now)
            return
        if self._ask_for_matches():
            return
        req = self._next_admissible(now)
        if req is not None:
            self._offer(req, now)

    # ------------------------------------------------------------------ endings
    def prefill_done(self, msg: PrefillDone) -> None:
        """Cache the prompt's full blocks, then readmit the requests that waited for them."""
        req = self.running.get(msg.request_id)
        if req is None or req.attempt != msg.attempt:
            return
        self._send(
            "kv_manager",
            km.CachePrefix(
                request_id=req.request_id, attempt=req.attempt, token_ids=req.tokens_now()
            ),
        )
        self._release_prefix(req.request_id)
        self.schedule()

    def request_done(self, msg: RequestDone) -> None:
        """The executor ended an attempt: finished, preempted, aborted or error."""
        req = self.requests.get(msg.request_id)
        if req is None or req.attempt != msg.attempt or not req.status.holds_blocks:
            self.log.warning("request.done_stale", request_id=msg.request_id, status=msg.status)
            return
        rid = req.request_id
        if self.preempting == rid:
            self.preempting = None
        if msg.status == "finished":
            self.counters["finished"] += 1
            self._free_blocks(
                km.Finish(request_id=rid, attempt=req.attempt, token_ids=msg.kv_token_ids)
            )
            self.log.info(
                "request.finished",
                request_id=rid,
                finish_reason=msg.finish_reason,
                output_tokens=len(req.output_ids) + len(msg.output_ids),
                preemptions=req.preemptions,
                kv_tail_hashes=chain_hashes(msg.kv_token_ids, self.kv.block_size)[
                    len(req.prompt_ids) // self.kv.block_size :
                ],  # the cached blocks past the prompt's (what a next turn reuses), for replays
            )
            self._drop(req)
        elif msg.status == "preempted" and req.abort_reason is None:
            self._requeue(req, msg)
        else:
            self._free_blocks(km.Release(request_id=rid, attempt=req.attempt, reason=msg.status))
            if msg.status == "error":
                self._fail(req, ErrorCode.INVALID, msg.message, msg.field)
            else:
                self._drop(req)
        self.schedule()

    def reset(self, reason: str) -> None:
        """An actor died: every attempt in flight is lost. Fail them all with ``actor_dead`` (the
        front door, which holds the tokens each one streamed, submits them again as resumed
        requests: ``tokenizer_svc/resume.py``) and start empty. Blocks held for them are released
        and the executor told to stop them (both ignore requests they no longer know, e.g. when
        they are the ones that restarted). These releases are not counted as frees in flight:
        the count starts again from zero."""
        for req in list(self.requests.values()):
            if req.status.holds_blocks or req.status is Status.ADMITTING:
                rid, attempt = req.request_id, req.attempt
                self._send("executor", xm.Stop(request_id=rid, attempt=attempt, reason="reset"))
                self._send(
                    "kv_manager", km.Release(request_id=rid, attempt=attempt, reason="reset")
                )
            self._fail(req, ErrorCode.ACTOR_DEAD, f"{reason}; request aborted")
        self.defer.clear()
        self.admission, self.admitting = AdmissionState.OPEN, None
        self.preempting = None
        self.frees_in_flight = 0
        self.queue = make_queue(self.cfg.policy, self.cfg.max_wait_s)
        self.log.warning("scheduler.reset", reason=reason)
