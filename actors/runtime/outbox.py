"""Frames that could not be sent at once, per destination, and one task that flushes them.

ZeroMQ sockets here are used with non-blocking sends: when a destination's queue is full, the frame
waits in that destination's deque and the flusher retries it, in order. Both the actor base (one
DEALER per peer) and the client endpoint (one ROUTER, one destination per client identity) use it.
A destination that turns out to be gone (``zmq.ZMQError`` on send, e.g. EHOSTUNREACH from a ROUTER
with ROUTER_MANDATORY) is dropped and reported through ``on_gone``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import trio
import zmq

K = TypeVar("K", bound=Hashable)

RETRY_S = 0.001  # how long the flusher waits before retrying a full queue


class Outbox(Generic[K]):
    """``try_send(key, data)`` sends one frame without blocking and returns False when the
    destination's queue is full; it may raise ``zmq.ZMQError`` when the destination is gone."""

    def __init__(
        self,
        try_send: Callable[[K, bytes], bool],
        on_gone: Callable[[K], None] | None = None,
    ) -> None:
        self._try_send = try_send
        self._on_gone = on_gone
        self._pending: dict[K, deque[bytes]] = {}
        self._wake = trio.Event()

    def send(self, key: K, data: bytes) -> bool:
        """Send now, or queue behind earlier frames for ``key``. False if ``key`` is gone."""
        queued = self._pending.get(key)
        if queued:
            queued.append(data)
            return True
        try:
            if self._try_send(key, data):
                return True
        except zmq.ZMQError:
            self._gone(key)
            return False
        self._pending.setdefault(key, deque()).append(data)
        self._wake.set()
        return True

    def pending(self, key: K) -> int:
        """Frames waiting for ``key``."""
        return len(self._pending.get(key, ()))

    def drop(self, key: K) -> None:
        """Forget what waits for ``key`` (it died or restarted: never deliver to a successor)."""
        self._pending.pop(key, None)

    def _gone(self, key: K) -> None:
        self.drop(key)
        if self._on_gone is not None:
            self._on_gone(key)

    def _flush_once(self) -> None:
        for key in list(self._pending):
            queued = self._pending.get(key)
            while queued:
                try:
                    if not self._try_send(key, queued[0]):
                        break
                except zmq.ZMQError:
                    self._gone(key)
                    break
                queued.popleft()
            if key in self._pending and not self._pending[key]:
                del self._pending[key]

    async def run(self) -> None:
        """The flusher: retries queued frames until every queue is empty, then sleeps until the
        next ``send`` that had to queue."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._pending:
                self._flush_once()
                if self._pending:
                    await trio.sleep(RETRY_S)
