"""SchedulerCore: the scheduler's policy as a pure, synchronous state machine (a request's life
cycle). Inputs are protocol messages; outputs are messages to send (``take_outbox``) and events
logged. No sockets, no clock but the one injected, so a replay can drive it on a virtual clock.

Life cycle: ``submit`` queues a request (intake.py); ``schedule`` offers the queue's choice to
the KV manager (one admission in flight, while running + admitting < ``max_batch_size``;
admission.py); the answer runs it in the executor or parks admission until blocks are freed; the
executor reports its end (``request_done``: finished / aborted / preempted / error) and the
scheduler tells the KV manager to cache (``kv_finish``) or drop (``kv_release``) its blocks. A
decode-time shortage preempts a victim (preemption.py), which is requeued at the front with the
tokens it generated.

Composition: the core holds the state its parts share (``state``, a ``CoreState``: requests,
running, queue, outbox, counters, log, clock, config; base.py) and five managers built on it,
each a plain class in its own file that gets the state and the managers it calls:
``intake_manager`` (``Intake``: a request's arrival and cancellation; intake.py),
``admission_manager`` (``Admission``: who is offered next and what the answer does;
admission.py), ``preemption_manager`` (``Preemption``: who makes room; preemption.py),
``reconcile_manager`` (``Reconcile``: a restarted scheduler's rebuild; reconcile.py) and
``recovery_manager`` (``Recovery``: a peer's death; recovery.py). This file keeps a request's
endings (``prefill_done``, ``request_done``) and the public API, which delegates to them.

Public API (stable; the actor, the metrics, benchmarks and replays use only this):

``SchedulerCore(cfg: SchedulerConfig, kv: KVConfig, log, clock=time.monotonic)``
    ``log``: a structlog-style logger (``info``/``debug``/``warning`` with an event name and
    fields); ``clock``: seconds, monotonic; read for queue times and aging, never slept on.
Inputs, each may append to the outbox and logs its events:
    ``submit(Submit)``, ``abort(request_id, reason)`` (from the tokenizer);
    ``admit_result(AdmitResult)``, ``shortage(GrowthShortage)``, ``blocks_freed(BlocksFreed)``,
    ``match_reply(MatchReply)`` (from the KV manager);
    ``request_done(RequestDone)``, ``prefill_done(PrefillDone)`` (from the executor);
    ``reset(reason)`` (an actor died: fail every request, start empty; recovery.py);
    ``reconcile(LiveRequests, ExecutorHeld, KVHeld)`` (a restarted scheduler rebuilds its state
    from its peers' answers; reconcile.py);
    ``kv_lost(reason)``, ``kv_back(executor_alive)``, ``kv_rebuilt(KVRebuilt)`` (the KV manager
    died and its successor rebuilds its pool: running requests go on; recovery.py);
    ``schedule()`` (offer the next request if nothing blocks; the inputs call it themselves);
    ``handle(msg) -> bool`` (dispatch one protocol message to the input above that takes it).
Output: ``take_outbox() -> list[(peer, message)]``, peers ``"kv_manager"``, ``"executor"``,
    ``"tokenizer"``, in send order (``outbox`` is the same list, not emptied).
State, read-only for callers: ``queue`` (the waiting queue: ``len``, ``in``, iteration),
    ``requests`` (every live request by id), ``running`` (requests holding blocks, admission
    order), ``admission`` (``AdmissionState``), ``admitting``, ``preempting``,
    ``frees_in_flight``, ``counters`` (admitted, refused, preemptions, finished, aborted),
    ``kv_serving`` (the KV manager takes admissions), ``reconciled_ids`` (requests a restart
    rebuilt: a second submit of theirs is dropped), ``pick_victim()`` (who a shortage would
    preempt now).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.admission import Admission
from actors.scheduler.base import AdmissionState, CoreState, Outgoing
from actors.scheduler.intake import Intake
from actors.scheduler.preemption import Preemption
from actors.scheduler.queue import WaitingQueue
from actors.scheduler.reconcile import Reconcile
from actors.scheduler.recovery import Recovery
from actors.scheduler.state import SchedRequest
from actors.shared.blockhash import chain_hashes
from messages import kv as km
from messages.common import ErrorCode
from messages.scheduler import (
    Abort,
    AdmitResult,
    BlocksFreed,
    ExecutorHeld,
    GrowthShortage,
    KVHeld,
    KVRebuilt,
    LiveRequests,
    PrefillDone,
    RequestDone,
    Submit,
)

__all__ = ["AdmissionState", "SchedulerCore"]


class SchedulerCore:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVConfig,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = CoreState(cfg, kv, log, clock)
        self.preemption_manager = Preemption(self.state)
        self.admission_manager = Admission(self.state, self.preemption_manager)
        self.reconcile_manager = Reconcile(self.state, self.admission_manager)
        self.intake_manager = Intake(self.state, self.admission_manager, self.reconcile_manager)
        self.recovery_manager = Recovery(
            self.state, self.admission_manager, self.preemption_manager
        )

    # ------------------------------------------------------------------- state
    @property
    def queue(self) -> WaitingQueue:
        return self.state.queue

    @property
    def requests(self) -> dict[str, SchedRequest]:
        return self.state.requests

    @property
    def running(self) -> dict[str, SchedRequest]:
        return self.state.running

    @property
    def outbox(self) -> list[Outgoing]:
        return self.state.outbox

    @property
    def counters(self) -> dict[str, int]:
        return self.state.counters

    @property
    def frees_in_flight(self) -> int:
        return self.state.frees_in_flight

    @property
    def kv_serving(self) -> bool:
        return self.state.kv_serving

    @property
    def admission(self) -> AdmissionState:
        return self.admission_manager.status

    @property
    def admitting(self) -> SchedRequest | None:
        return self.admission_manager.admitting

    @property
    def preempting(self) -> str | None:
        return self.preemption_manager.preempting

    @property
    def reconciled_ids(self) -> set[str]:
        return self.reconcile_manager.reconciled_ids

    def pick_victim(self) -> SchedRequest | None:
        return self.preemption_manager.pick_victim()

    def take_outbox(self) -> list[Outgoing]:
        return self.state.take_outbox(admission_pending=self.admission_manager.pending)

    # ------------------------------------------------------------------ inputs
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

    def submit(self, msg: Submit) -> None:
        self.intake_manager.submit(msg)

    def abort(self, rid: str, reason: str) -> None:
        self.intake_manager.abort(rid, reason)

    def schedule(self) -> None:
        self.admission_manager.schedule()

    def admit_result(self, msg: AdmitResult) -> None:
        self.admission_manager.admit_result(msg)

    def match_reply(self, msg: km.MatchReply) -> None:
        self.admission_manager.match_reply(msg)

    def blocks_freed(self, msg: BlocksFreed) -> None:
        self.admission_manager.blocks_freed(msg)

    def shortage(self, msg: GrowthShortage) -> None:
        self.preemption_manager.shortage(msg)

    def reconcile(self, front: LiveRequests, ex: ExecutorHeld, kv: KVHeld) -> None:
        self.reconcile_manager.reconcile(front, ex, kv)

    def reset(self, reason: str) -> None:
        self.recovery_manager.reset(reason)

    def kv_lost(self, reason: str) -> None:
        self.recovery_manager.kv_lost(reason)

    def kv_back(self, executor_alive: bool) -> None:
        self.recovery_manager.kv_back(executor_alive)

    def kv_rebuilt(self, msg: KVRebuilt) -> None:
        self.recovery_manager.kv_rebuilt(msg)

    # ------------------------------------------------------------------ endings
    def prefill_done(self, msg: PrefillDone) -> None:
        """Cache the prompt's full blocks, then readmit the requests that waited for them."""
        st = self.state
        req = st.running.get(msg.request_id)
        if req is None or req.attempt != msg.attempt:
            return
        st.send(
            "kv_manager",
            km.CachePrefix(
                request_id=req.request_id, attempt=req.attempt, token_ids=req.tokens_now()
            ),
        )
        st.release_prefix(req.request_id)
        self.schedule()

    def request_done(self, msg: RequestDone) -> None:
        """The executor ended an attempt: finished, preempted, aborted or error."""
        st = self.state
        req = st.requests.get(msg.request_id)
        if req is None or req.attempt != msg.attempt or not req.status.holds_blocks:
            st.log.warning("request.done_stale", request_id=msg.request_id, status=msg.status)
            return
        rid = req.request_id
        self.preemption_manager.ended(rid)
        if msg.status == "finished":
            st.counters["finished"] += 1
            st.free_blocks(
                km.Finish(request_id=rid, attempt=req.attempt, token_ids=msg.kv_token_ids)
            )
            st.log.info(
                "request.finished",
                request_id=rid,
                finish_reason=msg.finish_reason,
                output_tokens=len(req.output_ids) + len(msg.output_ids),
                preemptions=req.preemptions,
                kv_tail_hashes=chain_hashes(msg.kv_token_ids, st.kv.block_size)[
                    len(req.prompt_ids) // st.kv.block_size :
                ],  # the cached blocks past the prompt's (what a next turn reuses), for replays
            )
            st.drop(req)
        elif msg.status == "preempted" and req.abort_reason is None:
            self.preemption_manager.requeue(req, msg)
        else:
            st.free_blocks(km.Release(request_id=rid, attempt=req.attempt, reason=msg.status))
            if msg.status == "error":
                st.fail(req, ErrorCode.INVALID, msg.message, msg.field)
            else:
                st.drop(req)
        self.schedule()
