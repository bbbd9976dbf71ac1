"""The executor actor's part in recovering from its peers' crashes (docs/protocol.md, *Crashes
and resumes*). Its KV tensors outlive the KV manager and the scheduler, so neither crash stops a
running request here:

- the KV manager dies: requests keep stepping; growth is held back (a request that needs a block
  waits) and, once the successor answers, asked again in ``kv_holding`` with every block table;
- the scheduler dies: nothing changes here; its successor asks (``reconcile``) what runs, and
  gets the running attempts and every ``done`` of the last ``RECENT_S`` seconds (the dead one
  may never have read them).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from messages.kv import HeldBlocks, Holding
from messages.scheduler import ExecutorHeld, RequestDone, RunningAttempt

if TYPE_CHECKING:
    import trio

    from gpu.executor import Executor
    from gpu.structured.pending import PendingCompiles

RECENT_S = 15.0  # how long a done is kept for a restarted scheduler's reconciliation


class Flight:
    """What the actor tracks per in-flight request (the executor tracks the rest)."""

    __slots__ = ("attempt", "grow_asked", "output_offset", "outputs", "prompt", "started")

    def __init__(self, attempt: int, prompt: list[int], output_offset: int = 0) -> None:
        self.attempt = attempt
        self.prompt = prompt
        self.output_offset = output_offset
        self.outputs: list[int] = []
        self.grow_asked = 0  # total tokens last asked of the KV manager
        self.started = time.monotonic()


def finished(rid: str, fl: Any, reason: str) -> RequestDone:
    """What the scheduler is told when request ``rid`` ends: ``fl`` is its ``Flight`` (the
    replay's executor passes its own, with the same ``attempt``, ``prompt`` and ``outputs``).
    The last output's KV was never written: it is not among the cacheable tokens."""
    return RequestDone(
        request_id=rid,
        attempt=fl.attempt,
        status="finished",
        kv_token_ids=fl.prompt + fl.outputs[:-1],
        output_ids=fl.outputs,
        finish_reason=reason,
    )


class RecoveryMixin:
    flight: dict[str, Flight]
    ex: Executor
    compiling: PendingCompiles
    wake: trio.Event
    log: Any
    kv_down: bool  # the KV manager died: growth waits for its successor
    holding_due: bool  # its successor answers: send it kv_holding
    recent_done: deque[tuple[float, RequestDone]]
    mailbox: deque[Any]

    if TYPE_CHECKING:  # the Actor base's

        def reply(self, ident: bytes, msg: Any) -> None: ...

    def _init_recovery(self) -> None:
        self.kv_down = self.holding_due = False
        self.reconcile_due: list[bytes] = []  # a (re)started scheduler asked what runs here
        # every done of the last RECENT_S seconds: a scheduler that died may not have read them
        self.recent_done = deque(maxlen=8192)

    def send(self, peer: str, msg: Any) -> None:
        if isinstance(msg, RequestDone):
            self.recent_done.append((time.monotonic(), msg))
        super().send(peer, msg)  # type: ignore[misc]

    def _held(self) -> ExecutorHeld:
        """What runs here and what ended lately: the answer to a (re)started scheduler."""
        running = [RunningAttempt(r, f.attempt, f.output_offset) for r, f in self.flight.items()]
        running += [
            RunningAttempt(run.request_id, run.attempt, run.output_offset)
            for run in self.compiling.runs.values()
        ]
        since = time.monotonic() - RECENT_S
        ended = [d for t, d in self.recent_done if t >= since]
        self.log.info("executor.reconcile_answered", running=len(running), ended=len(ended))
        return ExecutorHeld(running=running, ended=ended)

    def on_peer_dead(self, name: str, reason: str) -> None:
        if name == "kv_manager":  # our KV tensors are intact: keep running, rebuild it later
            self.kv_down, self.holding_due = True, False
            self.log.warning("executor.kv_lost", reason=reason, running=len(self.flight))
            return
        if name == "scheduler":  # its successor asks what runs here (reconcile): keep it all
            self.log.warning("executor.scheduler_lost", reason=reason, running=len(self.flight))
            return
        self.mailbox.clear()
        self.compiling.clear()
        for rid in list(self.flight):
            self.ex.abort(rid)
        self.log.warning("executor.reset", reason=reason, dropped=len(self.flight))
        self.flight.clear()

    def on_peer_back(self, name: str) -> None:
        if name == "kv_manager" and self.kv_down:
            self.holding_due = True  # sent by the step loop, after the mailbox's grants
            self.wake.set()

    def _send_holding(self) -> None:
        """Tell the KV manager's successor every block table held, and the growth still due."""
        held = [
            HeldBlocks(rid, fl.attempt, self.ex.block_table(rid), fl.grow_asked)
            for rid, fl in self.flight.items()
        ]
        held += [
            HeldBlocks(run.request_id, run.attempt, list(run.block_table))
            for run in self.compiling.runs.values()
        ]
        self.kv_down = self.holding_due = False
        self.send("kv_manager", Holding(requests=held))
        self.log.info("executor.kv_holding_sent", requests=len(held))
