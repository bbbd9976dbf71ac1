"""The executor core's part in recovering from its peers' crashes (docs/protocol.md, *Crashes
and resumes*). Its KV tensors outlive the KV manager and the scheduler, so neither crash stops a
running request here:

- the KV manager dies: requests keep stepping; growth is held back (a request that needs a block
  waits) and, once the successor answers, asked again in ``kv_holding`` with every block table;
- the scheduler dies: nothing changes here; its successor asks (``reconcile``) what runs, and
  gets the running attempts and every ``done`` of the last ``RECENT_S`` seconds (the dead one
  may never have read them).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from messages.kv import HeldBlocks, Holding
from messages.scheduler import ExecutorHeld, RequestDone, RunningAttempt

if TYPE_CHECKING:
    from gpu.core import ExecutorCore

RECENT_S = 15.0  # how long a done is kept for a restarted scheduler's reconciliation


class Flight:
    """What the core tracks per in-flight request (the executor tracks the rest)."""

    __slots__ = ("attempt", "grow_asked", "output_offset", "outputs", "prompt", "spec", "started")

    def __init__(
        self, attempt: int, prompt: list[int], output_offset: int = 0, started: float = 0.0
    ) -> None:
        self.attempt = attempt
        self.prompt = prompt
        self.output_offset = output_offset
        self.outputs: list[int] = []
        self.grow_asked = 0  # total tokens last asked of the KV manager
        self.started = started  # the core's clock when it started running
        self.spec = [0, 0, 0]  # speculation: steps that verified drafts, drafts, accepted


def finished(rid: str, fl: Flight, reason: str) -> RequestDone:
    """What the scheduler is told when request ``rid`` ends. The last output's KV was never
    written: it is not among the cacheable tokens."""
    return RequestDone(
        request_id=rid,
        attempt=fl.attempt,
        status="finished",
        kv_token_ids=fl.prompt + fl.outputs[:-1],
        output_ids=fl.outputs,
        finish_reason=reason,
        spec_drafts=fl.spec[0],
        spec_draft_tokens=fl.spec[1],
        spec_accepted=fl.spec[2],
    )


class Recovery:
    """The executor core's part in its peers' crashes; it reads and resets the core's ledger."""

    def __init__(self, core: ExecutorCore) -> None:
        self.core = core
        self.kv_down = False  # the KV manager died: growth waits for its successor
        self.holding_due = False  # its successor answers: send it kv_holding
        # every done of the last RECENT_S seconds: a scheduler that died may not have read them
        self.recent_done: deque[tuple[float, RequestDone]] = deque(maxlen=8192)

    def done_sent(self, msg: RequestDone, now: float) -> None:
        self.recent_done.append((now, msg))

    def held(self) -> ExecutorHeld:
        """What runs here and what ended lately: the answer to a (re)started scheduler."""
        core = self.core
        running = [RunningAttempt(r, f.attempt, f.output_offset) for r, f in core.flight.items()]
        running += [
            RunningAttempt(run.request_id, run.attempt, run.output_offset)
            for run in core.building()
        ]
        since = core.clock() - RECENT_S
        ended = [d for t, d in self.recent_done if t >= since]
        core.log.info("executor.reconcile_answered", running=len(running), ended=len(ended))
        return ExecutorHeld(running=running, ended=ended)

    def peer_dead(self, name: str, reason: str) -> None:
        core = self.core
        if name == "kv_manager":  # our KV tensors are intact: keep running, rebuild it later
            self.kv_down, self.holding_due = True, False
            core.log.warning("executor.kv_lost", reason=reason, running=len(core.flight))
            return
        if name == "scheduler":  # its successor asks what runs here (reconcile): keep it all
            core.log.warning("executor.scheduler_lost", reason=reason, running=len(core.flight))
            return
        if core.builds is not None:
            core.builds.clear()
        if core.disk is not None:
            core.disk.loading.clear()
        for rid in list(core.flight):
            core.requests.abort(rid)
        core.log.warning("executor.reset", reason=reason, dropped=len(core.flight))
        core.flight.clear()

    def peer_back(self, name: str) -> bool:
        """Whether ``kv_holding`` is now due (the KV manager's successor answers)."""
        if name == "kv_manager" and self.kv_down:
            self.holding_due = True  # sent by the step loop, after the mailbox's grants
        return self.holding_due

    def holding(self) -> None:
        """Tell the KV manager's successor every block table held, and the growth still due."""
        core = self.core
        held = [
            HeldBlocks(rid, fl.attempt, core.requests.block_table(rid), fl.grow_asked)
            for rid, fl in core.flight.items()
        ]
        held += [
            HeldBlocks(run.request_id, run.attempt, list(run.block_table))
            for run in core.building()
        ]
        self.kv_down = self.holding_due = False
        core.send("kv_manager", Holding(requests=held))
        core.log.info("executor.kv_holding_sent", requests=len(held))
