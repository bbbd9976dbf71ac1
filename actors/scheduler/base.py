"""The scheduler core's state and the primitives every part of it uses: send, free, fail, drop.

``SchedulerCore`` (core.py) is assembled from this base, ``AdmissionMixin`` (admission.py) and
``PreemptionMixin`` (preemption.py); each file is one role, all of it pure (no sockets).
"""

from __future__ import annotations

import abc
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


class CoreBase(abc.ABC):
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
        self.admission = AdmissionState.OPEN
        self.admitting: SchedRequest | None = None  # set while ADMITTING
        self.frees_in_flight = 0  # kv_finish/kv_release sent, their ``freed`` not yet back
        self.preempting: str | None = None  # one preemption at a time
        self.reconciled_ids: set[str] = set()  # requests a restarted scheduler reconciled
        self.kv_down = False  # the KV manager died and no successor answers yet (recovery.py)
        self.kv_rebuilding = False  # its successor is rebuilding its pool from kv_rebuild
        self.outbox: list[Outgoing] = []
        self._seq = 0
        self._admit_seq = 0
        self.counters = {"admitted": 0, "refused": 0, "preemptions": 0, "finished": 0, "aborted": 0}

    @abc.abstractmethod
    def reset(self, reason: str) -> None:
        """An actor died: fail every request, start empty (core.py)."""

    @abc.abstractmethod
    def schedule(self) -> None:
        """Offer the next request to the KV manager if nothing blocks admission (core.py)."""

    # ---------------------------------------------------------------- sending
    def _send(self, peer: str, msg: msgspec.Struct) -> None:
        self.outbox.append((peer, msg))

    def _free_blocks(self, msg: km.Finish | km.Release) -> None:
        """Send a finish/release to the KV manager and count it: every one is answered with a
        ``freed``, and a refusal with nothing running fails the request only when none is due.
        Not sent while the KV manager is down (its successor's rebuild accounts for it)."""
        if self.kv_down:
            return
        self.frees_in_flight += 1
        self._send("kv_manager", msg)

    def take_outbox(self) -> list[Outgoing]:
        """The messages to send, as ``(peer, message)`` in order; empties the outbox.

        Each run says whether more follow it (``x_run.more``), decided here, when it leaves,
        not when it was granted: a run followed by another in the same outbox, or sent while
        the next admission is out, says more. The actor handles every message already waiting
        before it takes the outbox, so a burst's requests that reached the scheduler while the
        first one's blocks were being granted count too (an idle executor waits for them)."""
        out, self.outbox = self.outbox, []
        behind = self.admission in (AdmissionState.ADMITTING, AdmissionState.MATCHING)
        for _, msg in reversed(out):
            if isinstance(msg, xm.Run):
                msg.more = behind
                behind = True
        return out

    # -------------------------------------------------------------- endings
    def _fail(self, req: SchedRequest, code: str, message: str, field: str | None = None) -> None:
        self.log.info("request.failed", request_id=req.request_id, code=code, reason=message)
        self._send(
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

    def _release_prefix(self, rid: str) -> None:
        """``rid`` computed its prefix (or left): the requests it held go back to the front."""
        for r in reversed(self.defer.release(rid)):
            self.queue.push_front(r)
