"""The KV manager core's shared state: what the core and its parts (``Rebuild``,
``DiskControl``) read and write, handed to each when it is built (the scheduler's ``CoreState``
pattern: parts never import their owner)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from actors.kv.block_manager import BlockManager

Outgoing = tuple[str, msgspec.Struct]


class CoreState:
    """The block manager (replaced whole by a rebuild or a reset), which attempt holds each
    request's blocks, the growth waiting for blocks (oldest first), the outbox, the log."""

    def __init__(self, mgr: BlockManager, log: Any) -> None:
        self.mgr = mgr
        self.log = log
        self.attempts: dict[str, int] = {}  # request id -> the attempt holding its blocks
        self.pending_growth: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.outbox: list[Outgoing] = []

    def send(self, peer: str, msg: msgspec.Struct) -> None:
        self.outbox.append((peer, msg))
