"""Admission: which waiting request is offered to the KV manager, and what its answer does.

One pass of ``schedule`` (core.py) takes these steps, each its own method:
1. ``_ask_for_matches``: a policy that needs cached-prefix lengths (``lpm``) gets them first
   (``kv_match``; admission is MATCHING until ``match_reply``);
2. ``_next_admissible``: requests that share their first ``prefix_defer_tokens`` prompt tokens
   with one being prefilled are held back until that prefill is done (prefix_defer.py);
3. ``_offer``: the head is offered (``kv_admit`` with its reservation; ADMITTING), logged as
   ``request.aged`` if it waited past ``max_wait_s``.
The answer (``admit_result``) runs the request, or parks admission (BLOCKED) until ``freed``, or
fails the request when it can never fit. A run that leaves while the next admission is already out
is marked ``more`` (a burst is being admitted: an idle executor waits for the rest; decided in
``take_outbox``, base.py).
"""

from __future__ import annotations

from actors.kv.reservation import reserve_tokens
from actors.runtime.config import KVConfig
from actors.scheduler.base import AdmissionState, CoreBase
from actors.scheduler.state import SchedRequest, Status
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


class AdmissionMixin(CoreBase):
    # --------------------------------------------------------- the pass's steps
    def _ask_for_matches(self) -> bool:
        """Send the policy's match query if it needs one; True if one went out."""
        cands = self.queue.match_query()
        if cands is None:
            return False
        self.admission = AdmissionState.MATCHING
        self._send("kv_manager", km.MatchQuery(token_lists=[r.tokens_now() for r in cands]))
        return True

    def _next_admissible(self, now: float) -> SchedRequest | None:
        """The head of the queue after holding back the requests whose prefix is being
        computed; None when the queue is empty or this pass held its maximum."""
        held = 0
        req = self.queue.peek(now)
        while req is not None and (owner := self.defer.owner_for(req)) is not None:
            if held >= MAX_HOLDS_PER_PASS:
                return None
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
        return req

    def _offer(self, req: SchedRequest, now: float) -> None:
        """Ask the KV manager for ``req``'s blocks (the next attempt)."""
        if self.queue.aged(req, now):
            self.log.info(
                "request.aged", request_id=req.request_id, waited_s=round(now - req.enqueued, 3)
            )
        req.status = Status.ADMITTING
        req.attempt += 1
        self.admission, self.admitting = AdmissionState.ADMITTING, req
        ask = km.Admit(
            request_id=req.request_id,
            attempt=req.attempt,
            token_ids=req.tokens_now(),
            reserve_tokens=reservation(req, self.kv, self.cfg.max_preemptions),
        )
        self._send("kv_manager", ask)

    # ------------------------------------------------------------- the answers
    def match_reply(self, msg: km.MatchReply) -> None:
        """The cached prefix lengths the policy asked for, in the order it asked."""
        if self.admission is AdmissionState.MATCHING:
            self.admission = AdmissionState.OPEN
        self.queue.match_reply(msg.cached_tokens)
        self.schedule()

    def admit_result(self, msg: AdmitResult) -> None:
        """The KV manager's answer to the pending ``kv_admit``."""
        req = self.admitting
        if req is None or req.request_id != msg.request_id or req.attempt != msg.attempt:
            self.log.warning("admission.stale", request_id=msg.request_id, attempt=msg.attempt)
            if msg.ok:  # blocks granted to something we no longer track: give them back
                self._free_blocks(
                    km.Release(request_id=msg.request_id, attempt=msg.attempt, reason="stale")
                )
            return
        self.admission, self.admitting = AdmissionState.OPEN, None
        if not msg.ok:
            self._refused(req, msg)
        elif req.abort_reason is not None:
            self._free_blocks(
                km.Release(request_id=req.request_id, attempt=req.attempt, reason=req.abort_reason)
            )
            self._drop(req)
        else:
            self._granted(req, msg)
        self.schedule()

    def _refused(self, req: SchedRequest, msg: AdmitResult) -> None:
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
        else:  # blocks will come back: wait for them, no busy loop
            req.status = Status.WAITING
            self.admission = AdmissionState.BLOCKED

    def _granted(self, req: SchedRequest, msg: AdmitResult) -> None:
        self.queue.remove(req.request_id)
        self.defer.admitted(req, msg.cached_tokens)
        self._admit_seq += 1
        req.admitted_seq = self._admit_seq
        req.status = Status.RUNNING
        req.block_table = list(msg.block_table)
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
        run = xm.Run(
            request_id=req.request_id,
            attempt=req.attempt,
            prompt_ids=req.tokens_now(),
            params=req.params,  # the original max_tokens: the executor counts output_offset
            block_table=msg.block_table,
            cached_tokens=msg.cached_tokens,
            output_offset=len(req.output_ids),
        )
        self._send("executor", run)
        admitted = tm.RequestAdmitted(
            request_id=req.request_id,
            cached_tokens=msg.cached_tokens,
            queue_s=req.queue_s,
            attempt=req.attempt,
        )
        self._send("tokenizer", admitted)

    def blocks_freed(self, msg: BlocksFreed) -> None:
        """Blocks came back (the answer to every finish/release): a parked admission retries."""
        self.frees_in_flight = max(0, self.frees_in_flight - 1)
        if self.admission is AdmissionState.BLOCKED:
            self.log.debug("admission.retry", free=msg.free, evictable=msg.evictable)
            self.admission = AdmissionState.OPEN
        self.schedule()
