"""Recovery: what the scheduler does when the KV manager dies and its successor starts.

The executor's KV tensors outlive the KV manager, so the running requests keep running: nothing
is failed or recomputed. While the KV manager is down (``kv_lost``) the scheduler sends it
nothing (its successor must not see messages meant for the dead one; the rebuild accounts for
them), admits nothing, and puts back the request whose ``kv_admit`` died unanswered. When the
successor answers (``kv_back``) the scheduler sends ``kv_rebuild``: every request that holds
blocks, with the table it was admitted with (the executor sends the grown tables itself,
``kv_holding``). Admission opens again on ``kv_rebuilt``; a failed rebuild resets the scheduler
(every request resumed by the front door, as for any other crash).
"""

from __future__ import annotations

import msgspec

from actors.scheduler.base import AdmissionState, CoreBase
from actors.scheduler.state import Status
from messages import kv as km
from messages.scheduler import KVRebuilt


class RecoveryMixin(CoreBase):
    @property
    def kv_serving(self) -> bool:
        """The KV manager takes admissions (not down, not rebuilding)."""
        return not self.kv_down and not self.kv_rebuilding

    def _send(self, peer: str, msg: msgspec.Struct) -> None:
        if peer == "kv_manager" and self.kv_down:
            return  # the successor rebuilds from kv_rebuild, which accounts for this
        self.outbox.append((peer, msg))

    def kv_lost(self, reason: str) -> None:
        """The KV manager died: keep the running requests, put back the one being admitted."""
        self.kv_down, self.kv_rebuilding = True, False
        requeued = None
        req = self.admitting
        if req is not None:
            if req.abort_reason is not None:
                self._drop(req)
            else:
                req.status = Status.WAITING
                self.queue.push_front(req)  # admit_result may have removed nothing yet
                requeued = req.request_id
        self.admission, self.admitting = AdmissionState.OPEN, None
        self.frees_in_flight = 0  # their answers died with it
        self.log.warning(
            "scheduler.kv_lost", reason=reason, running=len(self.running), requeued=requeued
        )

    def kv_back(self, executor_alive: bool) -> None:
        """The KV manager's successor answers: tell it which requests hold which blocks."""
        if not self.kv_down:
            return
        self.kv_down, self.kv_rebuilding = False, True
        running = [
            km.HeldBlocks(r.request_id, r.attempt, list(r.block_table))
            for r in self.running.values()
            if r.status.holds_blocks
        ]
        self._send("kv_manager", km.Rebuild(running=running, executor_alive=executor_alive))
        self.log.info("scheduler.kv_rebuild_sent", running=len(running))

    def kv_rebuilt(self, msg: KVRebuilt) -> None:
        if not self.kv_rebuilding:
            return
        self.kv_rebuilding = False
        if not msg.ok:
            self.reset(f"kv_manager could not rebuild its pool: {msg.reason}")
            return
        self.log.info("scheduler.kv_rebuilt", requests=msg.requests, running=len(self.running))
        self.schedule()
