"""The KV-manager actor: sockets and dispatch only. Every decision is ``actors.kv.core.KVManagerCore``'s.

Admission answers go to the scheduler; decode-time growth is granted straight to the executor,
and a shortage is reported to the scheduler, which decides preemption. Queries (``kv_match``,
``kv_stats``) are answered on the connection they came from.
"""

from __future__ import annotations

from typing import Any

from actors.kv.block_manager import BlockManager
from actors.kv.core import KVManagerCore
from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from messages import kv as km


class KVManagerActor(Actor):
    name = "kv_manager"
    inbound = km.KVInbound

    def __init__(self, cfg: RuntimeConfig, num_blocks: int) -> None:
        super().__init__(cfg)
        self.core = KVManagerCore(num_blocks, cfg.kv, self.log)

    @property
    def kv(self) -> BlockManager:
        """The block pool and prefix cache (the core's ``BlockManager``)."""
        return self.core.mgr

    def on_peer_dead(self, name: str, reason: str) -> None:
        self.core.peer_dead(name, reason)
        self._flush()

    def handle(self, ident: bytes, msg: Any) -> None:
        answer = self.core.handle(msg)
        if answer is not None:
            self.reply(ident, answer)
        self._flush()

    def _flush(self) -> None:
        for peer, out in self.core.take_outbox():
            self.send(peer, out)
