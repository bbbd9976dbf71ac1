"""Recovery: what the scheduler does when a peer dies.

Any actor but the KV manager (``reset``): every attempt in flight is lost. Every request is failed
with ``actor_dead`` (the front door resumes them) and the scheduler starts empty.

The KV manager (``kv_lost``, ``kv_back``, ``kv_rebuilt``): the executor's KV tensors outlive it,
so the running requests keep running: nothing is failed or recomputed. While the KV manager is
down (``kv_lost``) the scheduler sends it nothing (its successor must not see messages meant for
the dead one; the rebuild accounts for them: ``CoreState.send``, base.py), admits nothing, and
puts back the request whose ``kv_admit`` died unanswered. When the successor answers
(``kv_back``) the scheduler sends ``kv_rebuild``: every request that holds blocks, with the table
it was admitted with (the executor sends the grown tables itself, ``kv_holding``). Admission
opens again on ``kv_rebuilt``; a failed rebuild resets the scheduler (every request resumed by
the front door, as for any other crash).

``Recovery`` owns no state of its own: it sets the KV manager's availability in ``CoreState``
(``kv_down``, ``kv_rebuilding``) and reopens admission and preemption.
"""

from __future__ import annotations

from actors.scheduler.admission import Admission
from actors.scheduler.base import CoreState
from actors.scheduler.preemption import Preemption
from actors.scheduler.queue import make_queue
from actors.scheduler.state import Status
from messages import executor as xm
from messages import kv as km
from messages.common import ErrorCode
from messages.scheduler import KVRebuilt


class Recovery:
    def __init__(self, state: CoreState, admission: Admission, preemption: Preemption) -> None:
        self.state = state
        self.admission = admission
        self.preemption = preemption

    def reset(self, reason: str) -> None:
        """An actor died: every attempt in flight is lost. Fail them all with ``actor_dead`` (the
        front door, which holds the tokens each one streamed, submits them again as resumed
        requests: ``tokenizer_svc/resume.py``) and start empty. Blocks held for them are released
        and the executor told to stop them (both ignore requests they no longer know, e.g. when
        they are the ones that restarted). These releases are not counted as frees in flight:
        the count starts again from zero."""
        st = self.state
        for req in list(st.requests.values()):
            if req.status.holds_blocks or req.status is Status.ADMITTING:
                rid, attempt = req.request_id, req.attempt
                st.send("executor", xm.Stop(request_id=rid, attempt=attempt, reason="reset"))
                st.send("kv_manager", km.Release(request_id=rid, attempt=attempt, reason="reset"))
            st.fail(req, ErrorCode.ACTOR_DEAD, f"{reason}; request aborted")
        st.defer.clear()
        self.admission.reopen()
        self.preemption.preempting = None
        st.frees_in_flight = 0
        st.queue = make_queue(st.cfg.policy, st.cfg.max_wait_s)
        st.log.warning("scheduler.reset", reason=reason)

    def kv_lost(self, reason: str) -> None:
        """The KV manager died: keep the running requests, put back the one being admitted."""
        st = self.state
        st.kv_down, st.kv_rebuilding = True, False
        requeued = None
        req = self.admission.reopen()
        if req is not None:
            if req.abort_reason is not None:
                st.drop(req)
            else:
                req.status = Status.WAITING
                st.queue.push_front(req)  # admit_result may have removed nothing yet
                requeued = req.request_id
        st.frees_in_flight = 0  # their answers died with it
        st.log.warning(
            "scheduler.kv_lost", reason=reason, running=len(st.running), requeued=requeued
        )

    def kv_back(self, executor_alive: bool) -> None:
        """The KV manager's successor answers: tell it which requests hold which blocks."""
        st = self.state
        if not st.kv_down:
            return
        st.kv_down, st.kv_rebuilding = False, True
        running = [
            km.HeldBlocks(r.request_id, r.attempt, list(r.block_table))
            for r in st.running.values()
            if r.status.holds_blocks
        ]
        st.send("kv_manager", km.Rebuild(running=running, executor_alive=executor_alive))
        st.log.info("scheduler.kv_rebuild_sent", running=len(running))

    def kv_rebuilt(self, msg: KVRebuilt) -> None:
        """The successor rebuilt its pool: admission opens again (or, failed, a reset)."""
        st = self.state
        if not st.kv_rebuilding:
            return
        st.kv_rebuilding = False
        if not msg.ok:
            self.reset(f"kv_manager could not rebuild its pool: {msg.reason}")
            return
        st.log.info("scheduler.kv_rebuilt", requests=msg.requests, running=len(st.running))
        self.admission.schedule()
