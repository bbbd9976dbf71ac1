"""The scheduler actor: feeds protocol messages to ``SchedulerCore`` and sends what it emits."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import trio

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from actors.scheduler.base import FLUSH_EVERY
from actors.scheduler.core import SchedulerCore
from actors.scheduler.metrics import Metrics, serve_metrics
from messages.common import ErrorCode, Reconcile
from messages.kv import MatchReply
from messages.scheduler import (
    AdmitResult,
    BlocksFreed,
    Completed,
    ExecutorHeld,
    KVHeld,
    LiveRequests,
    MetricsQuery,
    MetricsText,
    RequestDone,
    SchedulerInbound,
    Submit,
)
from messages.tokenizer import RequestFailed


class SchedulerActor(Actor):
    name = "scheduler"
    inbound = SchedulerInbound
    replies = MatchReply | LiveRequests | ExecutorHeld | KVHeld
    # who answers ``reconcile``, with which reply type
    RECONCILE = {"tokenizer": LiveRequests, "executor": ExecutorHeld, "kv_manager": KVHeld}

    def __init__(self, cfg: RuntimeConfig) -> None:
        super().__init__(cfg)
        self.core = SchedulerCore(cfg.scheduler, cfg.kv, self.log)
        self.batching = False  # inside drain_inbox: it sends after each slice
        # Nothing is admitted until every peer said what it holds (reconcile.py): empty at a
        # first start; a restarted scheduler picks up where its predecessor stopped.
        self.answers: dict[str, Any] | None = {}
        self.deferred: list[Any] = []  # protocol messages that arrived before the answers
        # A (re)started scheduler admits nothing until every peer has had time to notice that
        # its predecessor died and to drop what referred to it.
        self.settle_until = time.monotonic() + (self.dead_after + 1) * self.hb
        self.metrics = Metrics(
            waiting=lambda: len(self.core.queue),
            running=lambda: len(self.core.running),
            preemptions=lambda: self.core.counters["preemptions"],
        )
        self.log.info(
            "scheduler.config",
            **dataclasses.asdict(cfg.scheduler),
            kv_mode=cfg.kv.mode,
            block_size=cfg.kv.block_size,
            victim_policy=cfg.kv.victim_policy,
        )

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        if self.cfg.scheduler.metrics_port is not None:
            await nursery.start(
                serve_metrics, self.metrics, self.cfg.scheduler.metrics_port, self.log
            )

    def open(self) -> None:
        super().open()
        for peer in self.RECONCILE:
            self.send(peer, Reconcile())

    def on_peer_reply(self, peer: str, msg: Any) -> None:
        if isinstance(msg, MatchReply):
            self.core.match_reply(msg)
            self._flush()
        elif self.answers is not None and isinstance(msg, self.RECONCILE.get(peer, ())):
            self.answers[peer] = msg
            if len(self.answers) == len(self.RECONCILE):
                a, self.answers = self.answers, None
                self.core.reconcile(a["tokenizer"], a["executor"], a["kv_manager"])
                deferred, self.deferred = self.deferred, []
                for m in deferred:
                    self.core.handle(m)
                self._flush()

    def on_peer_dead(self, name: str, reason: str) -> None:
        if name == "kv_manager":  # the executor's KV outlives it: its successor rebuilds
            self.core.kv_lost(reason)
        else:
            self.core.reset(reason)
        self._flush()

    def on_peer_back(self, name: str) -> None:
        if self.answers is not None and name in self.RECONCILE and name not in self.answers:
            self.send(name, Reconcile())  # the first ask died with the peer's predecessor
        if name == "kv_manager":
            self.core.kv_back(executor_alive="executor" not in self.down)
            self._flush()
            return
        # let every actor notice the death and reset before admitting again
        self.settle_until = time.monotonic() + 2 * self.hb

    def drain_inbox(self, limit: int = 100_000) -> int:
        """Handle what is waiting in slices of :data:`FLUSH_EVERY` messages, sending what they
        emitted after each slice rather than after each message: a burst's submits that arrived
        while its first request was being granted are queued before that request's run leaves,
        so the run says more follow (``take_outbox``) and an idle executor waits for them."""
        n, self.batching = 0, True
        try:
            while n < limit:
                got = super().drain_inbox(min(FLUSH_EVERY, limit - n))
                n += got
                self._flush()
                if got < FLUSH_EVERY:
                    break
        finally:
            self.batching = False
        return n

    def is_ready(self) -> bool:
        """Admitting: every peer alive, settled after a restart, the KV manager serving, and the
        peers' reconcile answers in (so the front door, which waits for this, sends no request
        that a (re)starting scheduler would take for one it inherited)."""
        return (
            not self.down
            and self.answers is None
            and time.monotonic() >= self.settle_until
            and self.core.kv_serving
        )

    def handle(self, ident: bytes, msg: Any) -> None:
        core = self.core
        if isinstance(msg, Submit) and self.answers is not None:
            # reconciling: the front door's answer may hold this very request (it was sent to
            # the dead scheduler and delivered here too); the core drops such a second copy
            self.deferred.append(msg)
            return
        if isinstance(msg, Submit):
            if not self.is_ready() and msg.request_id not in core.reconciled_ids:
                down = ", ".join(sorted(self.down)) or "an actor restarted"
                self.send(
                    "tokenizer",
                    RequestFailed(
                        request_id=msg.request_id,
                        code=ErrorCode.ACTOR_DEAD,
                        message=f"{down}: not admitting yet, retry",
                    ),
                )
                return
            core.submit(msg)
        elif self.answers is not None and not isinstance(msg, MetricsQuery):
            self.deferred.append(msg)  # handled once reconciled
        elif core.handle(msg):
            if isinstance(msg, BlocksFreed) or (isinstance(msg, AdmitResult) and msg.ok):
                self.metrics.kv(msg.in_use, msg.num_blocks)
                if isinstance(msg, AdmitResult):
                    self.metrics.admitted(msg, self.cfg.kv.block_size)
                else:
                    self.metrics.disk(msg.disk_bytes)
            elif isinstance(msg, RequestDone):
                self.metrics.done(msg)
        elif isinstance(msg, Completed):
            self.metrics.completed(msg)
        elif isinstance(msg, MetricsQuery):
            self.reply(ident, MetricsText(text=self.metrics.render().decode()))
        if not self.batching:
            self._flush()

    def _flush(self) -> None:
        for peer, out in self.core.take_outbox():
            self.send(peer, out)
