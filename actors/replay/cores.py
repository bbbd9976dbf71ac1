"""The scheduler and the KV manager in a replay: their real cores (``SchedulerCore``, ``KVCore``)
on the virtual clock, dispatched exactly as ``actors/scheduler/actor.py`` and
``actors/kv/actor.py`` do, their outboxes delivered through the loop."""

from __future__ import annotations

import dataclasses
from typing import Any

from actors.kv.core import KVCore
from actors.replay.loop import Loop
from actors.runtime.config import KVConfig, SchedulerConfig
from actors.scheduler.core import SchedulerCore


class SimScheduler:
    name = "scheduler"

    def __init__(self, loop: Loop, cfg: SchedulerConfig, kv: KVConfig, log: Any) -> None:
        self.loop = loop
        self.core = SchedulerCore(cfg, kv, log, clock=loop.clock)
        log.record(
            "scheduler.config",
            **dataclasses.asdict(cfg),
            kv_mode=kv.mode,
            block_size=kv.block_size,
            victim_policy=kv.victim_policy,
        )

    def handle(self, msg: Any) -> None:
        core = self.core
        core.handle(msg)
        for peer, out in core.take_outbox():
            self.loop.send(peer, out)


class SimKV:
    name = "kv_manager"

    def __init__(self, loop: Loop, cfg: KVConfig, num_blocks: int, log: Any) -> None:
        self.loop = loop
        self.core = KVCore(num_blocks, cfg, log)

    def free(self) -> int:
        return self.core.mgr.stats().free

    def handle(self, msg: Any) -> None:
        core = self.core
        answer = core.handle(msg)
        if answer is not None:  # a kv_match: answered on the scheduler's own connection
            self.loop.send("scheduler", answer)
        for peer, out in core.take_outbox():
            self.loop.send(peer, out)
