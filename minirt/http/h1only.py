"""No HTTP/2 prior knowledge: hypercorn closes a connection that opens with the HTTP/2 preface.

hypercorn turns a cleartext connection into HTTP/2 when it opens with the HTTP/2 preface (prior
knowledge). sglang-router opens such connections to every worker's port (its gRPC health
checks, docs/scale-out.md), and hypercorn's HTTP/2 code on its trio worker let two different
errors out of one such connection (``KeyError`` for a DATA frame after the response,
``trio.BusyResourceError`` from two concurrent sends), which stopped the whole HTTP server: found
with the router in front of minirt. Here such a connection is closed at once; the router, its
gRPC probe failed, talks HTTP/1.1 to the worker. (``Upgrade: h2c`` requests are left to
hypercorn as before: it answers 101 before it switches, so refusing there would fail clients.)
"""

from __future__ import annotations

from typing import Any

import hypercorn.trio.tcp_server as tcp_server
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class NoPriorKnowledge(ProtocolWrapper):
    """hypercorn's per-connection protocol switch, minus HTTP/2 by prior knowledge: the first
    bytes of a connection are held until they cannot be the HTTP/2 preface (at once, for any
    HTTP/1.1 request); a connection that sends the preface is closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head: bytes | None = b""  # None once the connection is known not to be HTTP/2

    async def handle(self, event: Any) -> None:
        if self._head is None or not isinstance(event, RawData):
            return await super().handle(event)
        head = self._head + event.data
        if head.startswith(PREFACE):
            self._head = None
            await self.send(Closed())  # closes the connection; nothing of it reached the app
            return None
        if event.data and PREFACE.startswith(head):
            self._head = head  # could still be the preface: wait for more bytes
            return None
        self._head = None
        if head:
            await super().handle(RawData(data=head))
        if not event.data:
            await super().handle(event)  # the end of the stream
        return None


def install() -> None:
    """Make hypercorn's trio worker use ``NoPriorKnowledge`` for every connection it accepts."""
    tcp_server.ProtocolWrapper = NoPriorKnowledge  # type: ignore[misc]
