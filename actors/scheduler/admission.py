"""Admission: which waiting request is offered to the KV manager, and what its answer does.

``Admission`` owns where admission stands (``status``, an ``AdmissionState``) and the request
whose ``kv_admit`` is out (``admitting``). One pass of ``schedule`` takes these steps, each its
own method:
1. ``_ask_for_matches``: a policy that needs cached-prefix lengths (``lpm``) gets them first
   (``kv_match``; admission is MATCHING until ``match_reply``);
2. ``_next_admissible``: requests that share their first ``prefix_defer_tokens`` prompt tokens
   with one being prefilled are held back until that prefill is done (prefix_defer.py);
3. ``_offer``: the head is offered (``kv_admit`` with its reservation; ADMITTING), logged as
   ``request.aged`` if it waited past ``max_wait_s``.
While admission is blocked or the batch is full, the pass asks ``Preemption`` whether a more
important waiting request should make room instead (preemption.py).
The answer (``admit_result``) runs the request, or parks admission (BLOCKED) until ``freed``, or
fails the request when it can never fit. A run that leaves while the next admission is already out
(``pending``) is marked ``more`` (a burst is being admitted: an idle executor waits for the rest;
decided in ``CoreState.take_outbox``, base.py).
"""

from __future__ import annotations

from actors.runtime.config import KVConfig
from actors.scheduler.base import AdmissionState, CoreState
from actors.scheduler.preemption import Preemption
from actors.scheduler.state import SchedRequest, Status
from actors.shared.reservation import reserve_tokens
from messages import executor as xm
from messages import kv as km
from messages import tokenizer as tm
from messages.common import ErrorCode
from messages.scheduler import AdmitResult, BlocksFreed

# At most this many requests are held back (deferred) in one scheduling pass, so one decision
# costs O(1) whatever the queue holds; the pass after the next event goes on.
MAX_HOLDS_PER_PASS = 64


def reservation(req: SchedRequest, kv: KVConfig, max_preemptions: int) -> int:
    """``reserve_tokens`` of the request's next ``kv_admit``: by the KV mode, except that a
    request preempted more than ``max_preemptions`` times reserves everything (no more thrash)."""
    mode = "full" if req.preemptions > max_preemptions else kv.mode
    return reserve_tokens(
        mode,
        len(req.tokens_now()),
        max(0, req.remaining_tokens()),
        lookahead_blocks=kv.lookahead_blocks,
        block_size=kv.block_size,
    )


class Admission:
    def __init__(self, state: CoreState, preemption: Preemption) -> None:
        self.state = state
        self.preemption = preemption
        self.status = AdmissionState.OPEN
        self.admitting: SchedRequest | None = None  # set while ADMITTING

    @property
    def pending(self) -> bool:
        """A ``kv_admit`` or ``kv_match`` is out, its answer not yet back."""
        return self.status in (AdmissionState.ADMITTING, AdmissionState.MATCHING)

    def reopen(self) -> SchedRequest | None:
        """Forget any pending question (its answer died, or will be ignored): admission is OPEN.
        Returns the request whose ``kv_admit`` was out, if any."""
        req = self.admitting
        self.status, self.admitting = AdmissionState.OPEN, None
        return req

    def schedule(self) -> None:
        """Offer the next request (by policy) to the KV manager if nothing blocks admission;
        while it is blocked, a more important waiting request may preempt (priority)."""
        st = self.state
        if self.pending:
            return
        if not st.kv_serving:
            return
        now = st.clock()
        if self.status is AdmissionState.BLOCKED or len(st.running) >= st.cfg.max_batch_size:
            self.preemption.preempt_for_priority(now)
            return
        if self._ask_for_matches():
            return
        req = self._next_admissible(now)
        if req is not None:
            self._offer(req, now)

    # --------------------------------------------------------- the pass's steps
    def _ask_for_matches(self) -> bool:
        """Send the policy's match query if it needs one; True if one went out."""
        cands = self.state.queue.match_query()
        if cands is None:
            return False
        self.status = AdmissionState.MATCHING
        self.state.send(
            "kv_manager",
            km.MatchQuery(
                token_lists=[r.tokens_now() for r in cands], salts=[r.cache_salt for r in cands]
            ),
        )
        return True

    def _next_admissible(self, now: float) -> SchedRequest | None:
        """The head of the queue after holding back the requests whose prefix is being
        computed; None when the queue is empty or this pass held its maximum."""
        st = self.state
        held = 0
        req = st.queue.peek(now)
        while req is not None and (owner := st.defer.owner_for(req)) is not None:
            if held >= MAX_HOLDS_PER_PASS:
                return None
            st.queue.remove(req.request_id)
            st.defer.hold(req)
            st.log.info(
                "request.deferred",
                request_id=req.request_id,
                prefix_of=owner,
                prefix_tokens=st.defer.tokens,
            )
            held += 1
            req = st.queue.peek(now)
        return req

    def _offer(self, req: SchedRequest, now: float) -> None:
        """Ask the KV manager for ``req``'s blocks (the next attempt)."""
        st = self.state
        if st.queue.aged(req, now):
            st.log.info(
                "request.aged", request_id=req.request_id, waited_s=round(now - req.enqueued, 3)
            )
        req.status = Status.ADMITTING
        req.attempt += 1
        self.status, self.admitting = AdmissionState.ADMITTING, req
        ask = km.Admit(
            request_id=req.request_id,
            attempt=req.attempt,
            token_ids=req.tokens_now(),
            reserve_tokens=reservation(req, st.kv, st.cfg.max_preemptions),
            cache_salt=req.cache_salt,
        )
        st.send("kv_manager", ask)

    # ------------------------------------------------------------- the answers
    def match_reply(self, msg: km.MatchReply) -> None:
        """The cached prefix lengths the policy asked for, in the order it asked."""
        if self.status is AdmissionState.MATCHING:
            self.status = AdmissionState.OPEN
        self.state.queue.match_reply(msg.cached_tokens)
        self.schedule()

    def admit_result(self, msg: AdmitResult) -> None:
        """The KV manager's answer to the pending ``kv_admit``."""
        st = self.state
        req = self.admitting
        if req is None or req.request_id != msg.request_id or req.attempt != msg.attempt:
            st.log.warning("admission.stale", request_id=msg.request_id, attempt=msg.attempt)
            if msg.ok:  # blocks granted to something we no longer track: give them back
                st.free_blocks(
                    km.Release(request_id=msg.request_id, attempt=msg.attempt, reason="stale")
                )
            return
        self.reopen()
        if not msg.ok:
            self._refused(req, msg)
        elif req.abort_reason is not None:
            st.free_blocks(
                km.Release(request_id=req.request_id, attempt=req.attempt, reason=req.abort_reason)
            )
            st.drop(req)
        else:
            self._granted(req, msg)
        self.schedule()

    def _refused(self, req: SchedRequest, msg: AdmitResult) -> None:
        st = self.state
        st.counters["refused"] += 1
        st.log.info(
            "admission.refused",
            request_id=req.request_id,
            reason=msg.reason,
            blocks_needed=msg.blocks_needed,
            blocks_free=msg.blocks_free,
            blocks_evictable=msg.blocks_evictable,
            running=len(st.running),
        )
        if req.abort_reason is not None:
            st.drop(req)
        elif msg.fatal or (not st.running and not st.frees_in_flight and not msg.pinned):
            st.fail(req, ErrorCode.TOO_LONG, f"cannot fit in the KV pool: {msg.reason}", "prompt")
        else:  # blocks will come back: wait for them, no busy loop
            req.status = Status.WAITING
            self.status = AdmissionState.BLOCKED

    def _granted(self, req: SchedRequest, msg: AdmitResult) -> None:
        st = self.state
        st.queue.remove(req.request_id)
        # a prefix loaded from disk is loaded once: the others wait to find it in the pool
        st.defer.admitted(req, msg.cached_tokens - len(msg.load_keys) * st.kv.block_size)
        st.mark_admitted(req)
        req.status = Status.RUNNING
        req.block_table = list(msg.block_table)
        st.running[req.request_id] = req
        req.queue_s += max(0.0, st.clock() - req.enqueued)
        st.counters["admitted"] += 1
        st.log.info(
            "request.admitted",
            request_id=req.request_id,
            attempt=req.attempt,
            blocks=len(msg.block_table),
            cached_tokens=msg.cached_tokens,
            queue_s=round(req.queue_s, 6),
            running=len(st.running),
        )
        run = xm.Run(
            request_id=req.request_id,
            attempt=req.attempt,
            prompt_ids=req.tokens_now(),
            params=req.params,  # the original max_tokens: the executor counts output_offset
            block_table=msg.block_table,
            cached_tokens=msg.cached_tokens,
            output_offset=len(req.output_ids),
            grammar=req.grammar,
            load_blocks=msg.load_blocks,
            load_keys=msg.load_keys,
        )
        st.send("executor", run)
        admitted = tm.RequestAdmitted(
            request_id=req.request_id,
            cached_tokens=msg.cached_tokens,
            queue_s=req.queue_s,
            attempt=req.attempt,
        )
        st.send("tokenizer", admitted)

    def blocks_freed(self, msg: BlocksFreed) -> None:
        """Blocks came back (the answer to every finish/release): a parked admission retries."""
        st = self.state
        if msg.answer:
            st.frees_in_flight = max(0, st.frees_in_flight - 1)
        if self.status is AdmissionState.BLOCKED:
            st.log.debug("admission.retry", free=msg.free, evictable=msg.evictable)
            self.status = AdmissionState.OPEN
        self.schedule()
