"""Reconciliation: a restarted scheduler rebuilds its state from its peers' answers.

A scheduler keeps no state on disk; what it knew lives on in its peers. At its start it asks
each (``reconcile``) and admits nothing until all three have answered:

- the front door (``live_requests``): every request in flight, with the tokens streamed so far;
- the executor (``x_held``): the attempts it runs, and the ``done`` of the last seconds (the dead
  scheduler may never have read them);
- the KV manager (``kv_held``): every request that holds blocks, and which attempt.

Then, per request: running in the executor with the attempt the KV manager holds blocks for
and still wanted by the front door: it goes on running, untouched (nothing recomputed). Holding
blocks but not running (its ``x_run`` or its ``done`` died with the scheduler): its blocks are
freed (cached if it finished) and, if the front door still wants it and it did not finish,
queued again with the tokens it streamed (a resume, recomputed like a preempted request).
Running but no longer wanted (cancelled meanwhile): stopped. Only at the front door: queued.
At a first start every answer is empty. Nothing runs twice, nothing is forgotten.

``Reconcile`` owns the ids of the requests it rebuilt (``reconciled_ids``): the front door may
have sent their submit to the restarted scheduler too, and that second copy is dropped
(``second_copy``).
"""

from __future__ import annotations

from actors.scheduler.admission import Admission
from actors.scheduler.base import CoreState
from actors.scheduler.state import Status
from messages import executor as xm
from messages import kv as km
from messages.common import ErrorCode, SamplingParams
from messages.scheduler import ExecutorHeld, KVHeld, LiveRequests, RequestDone, Submit

REASON = "scheduler restarted"


class Reconcile:
    def __init__(self, state: CoreState, admission: Admission) -> None:
        self.state = state
        self.admission = admission
        self.reconciled_ids: set[str] = set()  # requests a restarted scheduler reconciled

    def second_copy(self, msg: Submit) -> bool:
        """``msg`` is the submit of a request already rebuilt by ``reconcile`` (it reached the
        dead scheduler's successor as well as its reconciliation): drop it, once."""
        rid = msg.request_id
        if rid not in self.reconciled_ids or msg.resume_reason:
            return False
        self.reconciled_ids.discard(rid)
        self.state.log.info("request.submit_reconciled", request_id=rid)
        return True

    def reconcile(self, front: LiveRequests, ex: ExecutorHeld, kv: KVHeld) -> None:
        """Rebuild the state of a (re)started scheduler from its peers' answers."""
        st = self.state
        running = {r.request_id: r for r in ex.running}
        held = {h.request_id: h for h in kv.allocations}
        ended: dict[tuple[str, int], RequestDone] = {(d.request_id, d.attempt): d for d in ex.ended}
        wanted = {s.request_id: s for s in front.requests}
        n = {"running": 0, "queued": 0, "resumed": 0, "stopped": 0, "freed": 0, "ended": 0}
        for rid, h in held.items():  # blocks of an attempt that no longer runs: free them
            r = running.get(rid)
            if r is not None and r.attempt == h.attempt:
                continue
            done = ended.get((rid, h.attempt))
            if done is not None and done.status == "finished":
                st.free_blocks(
                    km.Finish(request_id=rid, attempt=h.attempt, token_ids=done.kv_token_ids)
                )
            else:
                st.free_blocks(km.Release(request_id=rid, attempt=h.attempt, reason=REASON))
            n["freed"] += 1
        for rid, r in running.items():
            s = wanted.get(rid)
            mine = held.get(rid)
            if s is not None and mine is not None and mine.attempt == r.attempt:
                self._adopt(s, r.attempt, r.output_offset, mine.block_table)
                n["running"] += 1
            else:  # not wanted any more, or its blocks are not its own: stop it
                req = st.track(rid, [], SamplingParams(), 0.0)
                req.attempt, req.status = r.attempt, Status.STOPPING
                st.running[rid] = req
                st.send("executor", xm.Stop(request_id=rid, attempt=r.attempt, reason=REASON))
                n["stopped"] += 1
        self.reconciled_ids = set(wanted)  # a second copy of their submit is dropped
        for rid, s in wanted.items():
            if rid in st.requests:
                continue
            attempts = [a for (i, a) in ended if i == rid]
            last = max([*attempts, held[rid].attempt if rid in held else 0], default=0)
            done = ended.get((rid, last))
            if done is not None and done.status == "finished":
                n["ended"] += 1  # its last token is on its way to the front door
                continue
            if done is not None and done.status == "error":
                req = st.track(
                    rid, list(s.prompt_ids), s.params, s.arrival, s.grammar, s.cache_salt
                )
                st.fail(req, ErrorCode.INVALID, done.message, done.field)
                n["ended"] += 1
                continue
            req = st.track(rid, list(s.prompt_ids), s.params, s.arrival, s.grammar, s.cache_salt)
            req.output_ids, req.attempt = list(s.output_ids), last
            st.queue.push(req)
            n["queued"] += 1
            if s.output_ids:
                n["resumed"] += 1
                st.log.info(
                    "request.resumed",
                    request_id=rid,
                    reason=REASON,
                    resumes=s.resumes,
                    output_tokens=len(s.output_ids),
                    recomputed_tokens=len(req.tokens_now()),
                )
        st.log.info("scheduler.reconciled", **n)
        self.admission.schedule()

    def _adopt(self, s: Submit, attempt: int, output_offset: int, table: list[int]) -> None:
        """A request running in the executor, as the dead scheduler had it."""
        st = self.state
        req = st.track(
            s.request_id, list(s.prompt_ids), s.params, s.arrival, s.grammar, s.cache_salt
        )
        req.attempt, req.status = attempt, Status.RUNNING
        req.output_ids = list(s.output_ids[:output_offset])  # the earlier attempts' outputs
        req.block_table = list(table)
        st.mark_admitted(req)
        st.running[s.request_id] = req
