"""Preemption: who is stopped to make room, and how a stopped request goes back to the queue.

Two triggers, one at a time (``preempting``):
- a decode-time shortage (``shortage``): the victim is chosen by ``KVConfig.victim_policy``
  (``newest`` admitted, or ``priority``: the least important, ties newest);
- with ``SchedulerConfig.priority_preemption``, a waiting request more important than a running
  one while admission is blocked (``preempt_for_priority``, asked by ``Admission.schedule``):
  the least important running request yields and is requeued by policy, not first.
The victim is stopped in the executor (``x_preempt``); once the executor confirms
(``done{preempted}``, ``requeue``) its blocks are released and it is requeued with the tokens it
generated. Victims are chosen by the one victim policy, ``actors.shared.victim.pick_victim``.
``Preemption`` owns the one preemption in flight (``preempting``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from actors.scheduler.base import CoreState
from actors.scheduler.state import SchedRequest, Status
from actors.shared.victim import VictimPolicy, pick_victim
from messages import executor as xm
from messages import kv as km
from messages.scheduler import GrowthShortage, RequestDone


def choose_victim(running: Iterable[SchedRequest], policy: VictimPolicy) -> SchedRequest | None:
    """The running request (status RUNNING) to preempt under ``policy``, or None. A request's
    ``priority`` is lower-is-more-important, so the victim policy gets ``-priority`` as the
    keep rank: the least important request is given up first, ties newest."""
    live = {r.request_id: r for r in running if r.status is Status.RUNNING}
    rid = pick_victim(
        {rid: r.admitted_seq for rid, r in live.items()},
        policy,
        {rid: -r.priority for rid, r in live.items()} if policy == "priority" else None,
    )
    return live[rid] if rid is not None else None


class Preemption:
    def __init__(self, state: CoreState) -> None:
        self.state = state
        self.preempting: str | None = None  # one preemption at a time

    def pick_victim(self) -> SchedRequest | None:
        """The request a decode-time shortage preempts, by ``KVConfig.victim_policy``."""
        return choose_victim(self.state.running.values(), self.state.kv.victim_policy)

    def shortage(self, msg: GrowthShortage) -> None:
        """A running request could not grow: preempt a victim (it may be the request itself)."""
        req = self.state.running.get(msg.request_id)
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
            self.state.kv.victim_policy,
            blocks_needed=msg.blocks_needed,
            blocks_free=msg.blocks_free,
        )

    def preempt_for_priority(self, now: float) -> None:
        """With ``priority_preemption``, a waiting request that is more important (lower
        priority value) than a running one preempts it when admission is blocked."""
        if not self.state.cfg.priority_preemption or self.preempting is not None:
            return
        head = self.state.queue.peek(now)
        if head is None:
            return
        victim = choose_victim(self.state.running.values(), "priority")
        if victim is None or victim.priority <= head.priority:
            return
        victim.yield_to_priority = True
        self._preempt(
            victim,
            head.request_id,
            "priority",
            victim_priority=victim.priority,
            waiting_priority=head.priority,
        )

    def _preempt(self, victim: SchedRequest, for_request: str, policy: str, **why: Any) -> None:
        """Stop ``victim`` in the executor; it is requeued once the executor confirms."""
        st = self.state
        self.preempting = victim.request_id
        victim.status = Status.PREEMPTING
        st.counters["preemptions"] += 1
        st.log.info(
            "request.preempted",
            request_id=victim.request_id,
            attempt=victim.attempt,
            for_request=for_request,
            policy=policy,
            **why,
        )
        st.send("executor", xm.Preempt(request_id=victim.request_id, attempt=victim.attempt))

    def ended(self, rid: str) -> None:
        """An attempt of ``rid`` ended: if it was the one being preempted, that is over."""
        if self.preempting == rid:
            self.preempting = None

    def requeue(self, req: SchedRequest, msg: RequestDone) -> None:
        """The executor stopped a preempted request: free its blocks, keep what it generated and
        queue it again, first (or by policy when it yielded to a more important request)."""
        st = self.state
        rid = req.request_id
        st.free_blocks(km.Release(request_id=rid, attempt=req.attempt, reason="preempted"))
        st.running.pop(rid, None)
        st.release_prefix(rid)
        req.output_ids.extend(msg.output_ids)
        req.preemptions += 1
        req.status = Status.WAITING
        req.enqueued = st.clock()
        if req.yield_to_priority:
            req.yield_to_priority = False
            st.queue.push(req)
        else:
            st.queue.push_front(req)
        st.log.info(
            "request.requeued",
            request_id=rid,
            preemptions=req.preemptions,
            generated=len(req.output_ids),
            full_reservation_next=req.preemptions > st.cfg.max_preemptions,
        )
