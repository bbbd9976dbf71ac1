"""The scheduler actor: feeds protocol messages to ``SchedulerCore`` and sends what it emits."""

from __future__ import annotations

import dataclasses
from typing import Any

from actors.base import Actor
from actors.config import RuntimeConfig
from actors.scheduler.core import SchedulerCore
from messages.scheduler import (
    Abort,
    AdmitResult,
    BlocksFreed,
    GrowthShortage,
    RequestDone,
    SchedulerInbound,
    Submit,
)


class SchedulerActor(Actor):
    name = "scheduler"
    inbound = SchedulerInbound
    peers = ("tokenizer", "kv_manager", "executor")

    def __init__(self, cfg: RuntimeConfig) -> None:
        super().__init__(cfg)
        self.core = SchedulerCore(cfg.scheduler, cfg.kv, self.log)
        self.log.info(
            "scheduler.config",
            **dataclasses.asdict(cfg.scheduler),
            kv_mode=cfg.kv.mode,
            block_size=cfg.kv.block_size,
        )

    def handle(self, ident: bytes, msg: Any) -> None:
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
        for peer, out in core.take_outbox():
            self.send(peer, out)
