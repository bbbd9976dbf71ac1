"""The scheduler and the KV manager in a replay: their real cores (``SchedulerCore``, ``KVManagerCore``)
on the virtual clock, dispatched exactly as ``actors/scheduler/actor.py`` and
``actors/kv/actor.py`` do, their outboxes delivered through the loop."""

from __future__ import annotations

import dataclasses
from typing import Any

from actors.kv.core import KVManagerCore
from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.base import FLUSH_EVERY
from actors.scheduler.core import SchedulerCore
from minirt.replay.loop import Loop


class SimScheduler:
    name = "scheduler"

    def __init__(self, loop: Loop, cfg: SchedulerConfig, kv: KVConfig, log: Any) -> None:
        self.loop = loop
        self.core = SchedulerCore(cfg, kv, log, clock=loop.clock)
        self.pending = 0  # messages handled since the outbox was last sent
        log.record(
            "scheduler.config",
            **dataclasses.asdict(cfg),
            kv_mode=kv.mode,
            block_size=kv.block_size,
            victim_policy=kv.victim_policy,
        )

    def handle(self, msg: Any) -> None:
        """As the actor drains a backlog: the messages due at one instant are handled in slices
        of ``FLUSH_EVERY``, the outbox sent after each slice (a flush queued behind the messages
        already due now), so a burst's runs say ``more`` as the real scheduler's do."""
        self.core.handle(msg)
        self.pending += 1
        if self.pending == 1:
            self.loop.at(self.loop.now, self.flush)
        elif self.pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.pending = 0
            for peer, out in self.core.take_outbox():
                self.loop.send(peer, out)


class SimKV:
    name = "kv_manager"

    def __init__(self, loop: Loop, cfg: KVConfig, num_blocks: int, log: Any) -> None:
        self.loop = loop
        self.core = KVManagerCore(num_blocks, cfg, log)

    def free(self) -> int:
        return self.core.mgr.stats().free

    def handle(self, msg: Any) -> None:
        core = self.core
        answer = core.handle(msg)
        if answer is not None:  # a kv_match: answered on the scheduler's own connection
            self.loop.send("scheduler", answer)
        for peer, out in core.take_outbox():
            self.loop.send(peer, out)
