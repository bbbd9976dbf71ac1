"""The scheduler core's shared state and the primitives every part of it uses: send, free, fail,
drop.

``SchedulerCore`` (core.py) is composed, not inherited: it holds one ``CoreState`` and five
managers, each a plain class in its own file that is handed this state (and the managers it
calls) when it is built: ``Intake`` (intake.py), ``Admission`` (admission.py), ``Preemption``
(preemption.py), ``Reconcile`` (reconcile.py) and ``Recovery`` (recovery.py). What more than one
of them reads or writes lives here (the requests, the queue, the outbox, the counters, the frees
in flight, the KV manager's availability); what one of them decides lives in it (admission's
state, the preemption in flight, the reconciled ids). All of it pure (no sockets).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec

from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.prefix_defer import PrefixDeferral
from actors.scheduler.queue import WaitingQueue, make_queue
from actors.scheduler.state import SchedRequest, Status
from messages import executor as xm
from messages import kv as km
from messages import tokenizer as tm
from messages.common import SamplingParams

Outgoing = tuple[str, msgspec.Struct]

# A backlog of inbound messages is handled in slices of this many, the outbox taken (sent) after
# each slice rather than after each message (the actor's ``drain_inbox``, the replay's
# ``SimScheduler``): what arrived together leaves together, and ``take_outbox`` sees it.
FLUSH_EVERY = 32


class AdmissionState(enum.Enum):
    """Where admission stands; exactly one at a time."""

    OPEN = "open"  # nothing pending: ``schedule`` may offer the next request
    MATCHING = "matching"  # a ``kv_match`` query is out (the policy needs match lengths)
    ADMITTING = "admitting"  # a ``kv_admit`` is out for ``admitting``
    BLOCKED = "blocked"  # the last admission was refused for lack of blocks: wait for ``freed``


class CoreState:
    """What the managers share: configuration, log and clock, the requests and the waiting
    queue, the outbox, the counters, and whether the KV manager is serving."""

    def __init__(
        self, cfg: SchedulerConfig, kv: KVConfig, log: Any, clock: Callable[[], float]
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.log = log
        self.clock = clock
        self.queue: WaitingQueue = make_queue(cfg.policy, cfg.max_wait_s)
        self.defer = PrefixDeferral(cfg.prefix_defer_tokens)
        self.requests: dict[str, SchedRequest] = {}  # every live request, by id
        self.running: dict[str, SchedRequest] = {}  # holds blocks (running/preempting/stopping)
        self.frees_in_flight = 0  # kv_finish/kv_release sent, their ``freed`` not yet back
        self.kv_down = False  # the KV manager died and no successor answers yet (recovery.py)
        self.kv_rebuilding = False  # its successor is rebuilding its pool from kv_rebuild
        self.outbox: list[Outgoing] = []
        self.counters = {"admitted": 0, "refused": 0, "preemptions": 0, "finished": 0, "aborted": 0}
        self._seq = 0  # arrival order
        self._admit_seq = 0  # admission order

    @property
    def kv_serving(self) -> bool:
        """The KV manager takes admissions (not down, not rebuilding)."""
        return not self.kv_down and not self.kv_rebuilding

    # -------------------------------------------------------------- requests
    def track(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        grammar: str = "",
        cache_salt: str = "",
    ) -> SchedRequest:
        """A new live request (the next in arrival order), queued nowhere yet."""
        self._seq += 1
        req = SchedRequest(
            rid,
            prompt,
            params,
            arrival,
            self.clock(),
            self._seq,
            grammar=grammar,
            cache_salt=cache_salt,
        )
        self.requests[rid] = req
        return req

    def mark_admitted(self, req: SchedRequest) -> None:
        """``req`` got blocks: it is the newest admitted (the ``newest`` victim policy's order)."""
        self._admit_seq += 1
        req.admitted_seq = self._admit_seq

    # ---------------------------------------------------------------- sending
    def send(self, peer: str, msg: msgspec.Struct) -> None:
        if peer == "kv_manager" and self.kv_down:
            return  # the successor rebuilds from kv_rebuild, which accounts for this
        self.outbox.append((peer, msg))

    def free_blocks(self, msg: km.Finish | km.Release) -> None:
        """Send a finish/release to the KV manager and count it: every one is answered with a
        ``freed``, and a refusal with nothing running fails the request only when none is due.
        Not sent while the KV manager is down (its successor's rebuild accounts for it)."""
        if self.kv_down:
            return
        self.frees_in_flight += 1
        self.send("kv_manager", msg)

    def take_outbox(self, admission_pending: bool) -> list[Outgoing]:
        """The messages to send, as ``(peer, message)`` in order; empties the outbox.

        Each run says whether more follow it (``x_run.more``), decided here, when it leaves,
        not when it was granted: a run followed by another in the same outbox, or sent while
        the next admission is out (``admission_pending``), says more. The actor handles every
        message already waiting before it takes the outbox, so a burst's requests that reached
        the scheduler while the first one's blocks were being granted count too (an idle
        executor waits for them)."""
        out, self.outbox = self.outbox, []
        behind = admission_pending
        for _, msg in reversed(out):
            if isinstance(msg, xm.Run):
                msg.more = behind
                behind = True
        return out

    # -------------------------------------------------------------- endings
    def fail(self, req: SchedRequest, code: str, message: str, field: str | None = None) -> None:
        self.log.info("request.failed", request_id=req.request_id, code=code, reason=message)
        self.send(
            "tokenizer",
            tm.RequestFailed(request_id=req.request_id, code=code, message=message, field=field),
        )
        self.drop(req)

    def drop(self, req: SchedRequest) -> None:
        req.status = Status.DONE
        self.release_prefix(req.request_id)
        self.requests.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        self.queue.remove(req.request_id)

    def release_prefix(self, rid: str) -> None:
        """``rid`` computed its prefix (or left): the requests it held go back to the front."""
        for r in reversed(self.defer.release(rid)):
            self.queue.push_front(r)
