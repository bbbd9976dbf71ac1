"""What a restarted KV manager rebuilds its pool from: its peers' reports.

The executor's KV tensors outlive the KV manager, so a restarted KV manager need not throw away
the running requests' KV: the scheduler knows which requests hold blocks (``kv_rebuild``, each
with the table it was admitted with) and the executor holds the tables as grown since
(``kv_holding``). The scheduler is the authority on *which* requests hold blocks (a request it
no longer runs gave its blocks back, even if its ``kv_finish`` died with the old KV manager);
the executor on *which blocks* (it wrote them). Messages that arrive between the two reports
wait, and are handled after the rebuild.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.kv.block_manager import BlockManager
from actors.kv.state import CoreState
from actors.shared.errors import KVError
from messages import kv as km
from messages.scheduler import KVRebuilt


@dataclass
class Rebuilding:
    """The reports a restarted KV manager has so far, and the messages waiting for the rest."""

    running: list[km.HeldBlocks] | None = None  # the scheduler's kv_rebuild
    holding: list[km.HeldBlocks] | None = None  # the executor's kv_holding
    wait_for_executor: bool = True
    scheduler_gone: bool = False  # it died before its report: rebuild from the executor's
    deferred: list[Any] = field(default_factory=list)

    def add(self, msg: km.Rebuild | km.Holding) -> None:
        if isinstance(msg, km.Rebuild):
            self.running, self.wait_for_executor = list(msg.running), msg.executor_alive
        else:
            self.holding = list(msg.requests)

    @property
    def ready(self) -> bool:
        if self.scheduler_gone and self.running is None:
            return self.holding is not None
        return self.running is not None and (self.holding is not None or not self.wait_for_executor)

    def tables(self) -> list[km.HeldBlocks]:
        """Each request the scheduler runs, with the executor's table when it holds the same
        attempt (grown since admission; and the growth it still needs), else the admitted one
        (its ``x_run`` had not reached the executor, or it ended there meanwhile)."""
        if self.running is None:  # the scheduler died first: its successor reconciles the rest
            return list(self.holding or ())
        held = {h.request_id: h for h in self.holding or ()}
        out = []
        for r in self.running or ():
            h = held.get(r.request_id)
            out.append(h if h is not None and h.attempt == r.attempt else r)
        return out

    @property
    def from_executor(self) -> int:
        """How many of the rebuilt tables are the executor's."""
        held = {(h.request_id, h.attempt) for h in self.holding or ()}
        return sum((r.request_id, r.attempt) in held for r in self.running or ())


class Rebuild:
    """``KVManagerCore``'s part that rebuilds a restarted KV manager's pool from its peers' reports.

    It gets the core's state and the three core operations it calls when it is built:
    ``new_manager`` (an empty manager of the core's configuration), ``grow`` (grant growth or
    report the shortage) and ``handle`` (dispatch a message that waited for the rebuild)."""

    def __init__(
        self,
        state: CoreState,
        new_manager: Callable[[int], BlockManager],
        grow: Callable[[str, int, int], bool],
        handle: Callable[[Any], Any],
    ) -> None:
        self.state = state
        self.new_manager = new_manager
        self.grow = grow
        self.handle = handle
        self.rebuilding: Rebuilding | None = None  # a restarted KV manager, reports coming in

    def report(self, msg: km.Rebuild | km.Holding) -> None:
        """A peer's report to this restarted KV manager; rebuild once both are in."""
        if self.rebuilding is None:
            self.rebuilding = Rebuilding()
        self.rebuilding.add(msg)
        if self.rebuilding.ready:
            self.rebuild(self.rebuilding)

    def rebuild(self, r: Rebuilding) -> None:
        st = self.state
        self.rebuilding = None
        tables = r.tables()
        mgr = self.new_manager(st.mgr.pool.num_blocks)
        try:
            mgr.adopt([(h.request_id, h.block_table) for h in tables])
        except KVError as e:  # a peer's tables do not fit this pool: resume them instead
            st.log.error("kv.rebuild_failed", reason=str(e), requests=len(tables))
            st.send("scheduler", KVRebuilt(ok=False, reason=str(e)))
            return
        st.mgr, st.pending_growth = mgr, OrderedDict()
        st.attempts = {h.request_id: h.attempt for h in tables}
        s = mgr.stats()
        st.log.info(
            "kv.rebuilt",
            requests=len(tables),
            from_executor=r.from_executor,
            in_use=s.in_use,
            free=s.free,
            cache_dropped=True,
            deferred=len(r.deferred),
        )
        done = KVRebuilt(
            ok=True, requests=len(tables), in_use=s.in_use, free=s.free, num_blocks=s.num_blocks
        )
        st.send("scheduler", done)
        for h in tables:  # growth asked of the dead KV manager, asked again
            if h.want_tokens > mgr.capacity(h.request_id):
                self.grow(h.request_id, h.attempt, h.want_tokens)
        for msg in r.deferred:
            self.handle(msg)
