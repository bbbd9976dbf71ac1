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
from messages import kv as km
from messages.scheduler import (
    Abort,
    AdmitResult,
    BlocksFreed,
    GrowthShortage,
    PrefillDone,
    RequestDone,
    Submit,
)


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
        if isinstance(msg, Submit):
            core.submit(msg)
        elif isinstance(msg, Abort):
            core.abort(msg.request_id, msg.reason)
        elif isinstance(msg, AdmitResult):
            core.admit_result(msg)
        elif isinstance(msg, RequestDone):
            core.request_done(msg)
        elif isinstance(msg, GrowthShortage):
            core.shortage(msg)
        elif isinstance(msg, BlocksFreed):
            core.blocks_freed(msg)
        elif isinstance(msg, PrefillDone):
            core.prefill_done(msg)
        elif isinstance(msg, km.MatchReply):
            core.match_reply(msg)
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
        if isinstance(msg, km.Admit):
            core.admit(msg)
        elif isinstance(msg, km.Grow):
            core.grow(msg)
        elif isinstance(msg, km.CachePrefix):
            core.cache_prefix(msg)
        elif isinstance(msg, (km.Finish, km.Release)):
            core.leave(msg)
        elif isinstance(msg, km.MatchQuery):  # answered on the scheduler's own connection
            self.loop.send("scheduler", core.match(msg))
        for peer, out in core.take_outbox():
            self.loop.send(peer, out)
