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

from gpu.state import CoreState
from messages.kv import HeldBlocks, Holding
from messages.scheduler import ExecutorHeld, RunningAttempt

RECENT_S = 15.0  # how long a done is kept for a restarted scheduler's reconciliation


class Recovery:
    """The executor core's part in its peers' crashes; it reads and resets the flight ledger."""

    def __init__(self, state: CoreState) -> None:
        self.state = state
        self.kv_down = False  # the KV manager died: growth waits for its successor
        self.holding_due = False  # its successor answers: send it kv_holding

    def held(self) -> ExecutorHeld:
        """What runs here and what ended lately: the answer to a (re)started scheduler."""
        st = self.state
        running = [RunningAttempt(r, f.attempt, f.output_offset) for r, f in st.flight.items()]
        running += [
            RunningAttempt(run.request_id, run.attempt, run.output_offset) for run in st.building()
        ]
        since = st.clock() - RECENT_S
        ended = [d for t, d in st.recent_done if t >= since]
        st.log.info("executor.reconcile_answered", running=len(running), ended=len(ended))
        return ExecutorHeld(running=running, ended=ended)

    def peer_dead(self, name: str, reason: str) -> None:
        st = self.state
        if name == "kv_manager":  # our KV tensors are intact: keep running, rebuild it later
            self.kv_down, self.holding_due = True, False
            st.log.warning("executor.kv_lost", reason=reason, running=len(st.flight))
            return
        if name == "scheduler":  # its successor asks what runs here (reconcile): keep it all
            st.log.warning("executor.scheduler_lost", reason=reason, running=len(st.flight))
            return
        if st.builds is not None:
            st.builds.clear()
        if st.loras is not None:
            st.loras.clear()
        if st.disk is not None:
            st.disk.loading.clear()
        for rid in list(st.flight):
            st.requests.abort(rid)
        st.log.warning("executor.reset", reason=reason, dropped=len(st.flight))
        st.flight.clear()

    def peer_back(self, name: str) -> bool:
        """Whether ``kv_holding`` is now due (the KV manager's successor answers)."""
        if name == "kv_manager" and self.kv_down:
            self.holding_due = True  # sent by the step loop, after the mailbox's grants
        return self.holding_due

    def holding(self) -> None:
        """Tell the KV manager's successor every block table held, and the growth still due."""
        st = self.state
        held = [
            HeldBlocks(rid, fl.attempt, st.requests.block_table(rid), fl.grow_asked)
            for rid, fl in st.flight.items()
        ]
        held += [
            HeldBlocks(run.request_id, run.attempt, list(run.block_table)) for run in st.building()
        ]
        self.kv_down = self.holding_due = False
        st.send("kv_manager", Holding(requests=held))
        st.log.info("executor.kv_holding_sent", requests=len(held))
