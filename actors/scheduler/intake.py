"""Intake: what the front door sends about a request, its arrival and its cancellation.

``submit`` checks a request (a duplicate id, a resume with nothing left to generate, a full
waiting queue: each failed back to the front door), tracks it and queues it (a resumed request
at the front, it was accepted before), then runs a scheduling pass (admission.py). A second
copy of a submit that a restarted scheduler already rebuilt is dropped (reconcile.py).
``abort`` drops a waiting request, stops a running one, or marks one whose answer is pending
(admitting, preempting, stopping) to be dropped when that answer arrives.

``Intake`` owns no state of its own: the requests and the queue are ``CoreState``'s (base.py).
"""

from __future__ import annotations

from actors.scheduler.admission import Admission
from actors.scheduler.base import CoreState
from actors.scheduler.reconcile import Reconcile
from actors.scheduler.state import Status
from actors.shared.blockhash import chain_hashes
from messages import executor as xm
from messages import tokenizer as tm
from messages.common import ErrorCode
from messages.scheduler import Submit


class Intake:
    def __init__(self, state: CoreState, admission: Admission, reconcile: Reconcile) -> None:
        self.state = state
        self.admission = admission
        self.reconcile = reconcile

    def submit(self, msg: Submit) -> None:
        """A new request (or a resumed one): checked, tracked and queued; then a pass."""
        st = self.state
        rid = msg.request_id
        if self.reconcile.second_copy(msg):
            return
        if rid in st.requests:
            st.log.warning("request.duplicate", request_id=rid)
            dup = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.INVALID,
                message="duplicate request_id",
                field="request_id",
            )
            st.send("tokenizer", dup)
            return
        if len(msg.output_ids) >= msg.params.max_tokens:
            bad = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.INVALID,
                message=f"{len(msg.output_ids)} tokens already generated, max_tokens is "
                f"{msg.params.max_tokens}: nothing to resume",
                field="output_ids",
            )
            st.send("tokenizer", bad)
            return
        # A resumed request was accepted before its attempt died: never refused as overload.
        if not msg.resume_reason and len(st.queue) >= st.cfg.max_waiting:
            waiting, cap = len(st.queue), st.cfg.max_waiting
            st.log.info("request.overloaded", request_id=rid, waiting=waiting, max_waiting=cap)
            full = tm.RequestFailed(
                request_id=rid,
                code=ErrorCode.OVERLOADED,
                message=f"waiting queue full ({waiting} >= max_waiting {cap})",
            )
            st.send("tokenizer", full)
            return
        req = st.track(rid, msg.prompt_ids, msg.params, msg.arrival, msg.grammar, msg.cache_salt)
        req.output_ids = list(msg.output_ids)
        if msg.resume_reason:
            st.log.info(
                "request.resumed",
                request_id=rid,
                reason=msg.resume_reason,
                resumes=msg.resumes,
                output_tokens=len(msg.output_ids),
                recomputed_tokens=len(req.tokens_now()),
            )
            st.queue.push_front(req)  # it was running or waiting before: ahead of new ones
        else:
            st.queue.push(req)
        st.log.info(
            "request.queued",
            request_id=rid,
            prompt_tokens=len(msg.prompt_ids),
            max_tokens=msg.params.max_tokens,
            priority=msg.params.priority,
            block_hashes=chain_hashes(msg.prompt_ids, st.kv.block_size),  # for replays
            waiting=len(st.queue),
            running=len(st.running),
        )
        self.admission.schedule()

    def abort(self, rid: str, reason: str) -> None:
        """The front door gave ``rid`` up: dropped, stopped, or marked for when its answer comes."""
        st = self.state
        req = st.requests.get(rid)
        if req is None:
            return
        st.log.info("request.aborted", request_id=rid, reason=reason, status=req.status.value)
        st.counters["aborted"] += 1
        if req.status is Status.WAITING:
            st.drop(req)
        elif req.status is Status.RUNNING:
            req.status = Status.STOPPING
            st.send("executor", xm.Stop(request_id=rid, attempt=req.attempt, reason=reason))
        else:  # admitting / preempting / stopping: act when the pending answer arrives
            req.abort_reason = reason
