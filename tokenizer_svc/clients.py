"""The client endpoint's connections: who is connected, what each has in flight, sending to them.

Clients connect DEALERs to one ROUTER; each is known by its ROUTER identity. Its frames go
through one ``Outbox`` keyed by that identity (sent at once, or queued in order behind earlier
frames while its queue is full). A client is gone when a send to it fails (EHOSTUNREACH:
ROUTER_MANDATORY); an idle client with requests in flight is probed (an unsolicited ``pong``)
so a disconnect is noticed even while its requests wait. When a client is gone, ``on_gone`` gets
the runtime-wide ids of the requests it left, but only at ``settle``: the ROUTER drops a peer's
route as soon as it disconnects, while frames it sent before (a cancel) may still wait unread. So
a gone client is first only *leaving* (nothing more is sent to it, its ids still resolve, and
``on_leaving`` asks the reader to drain the socket), and the reader calls ``settle`` once it has
read everything that was waiting.

Request ids are scoped to the connection: ``open`` maps the client's own ``request_id`` to a
runtime-wide id (``messages.tokenizer.scoped_request_id``) that no other request of any connection
has (nor one of this connection's earlier requests under the same id, which the other actors may
still be ending), and a client can only look up (and so cancel) its own.

A client whose requests asked for it (``Generate.batch``) gets what one executor step made for
it (``Delta``s, ``Final``s) as one ``Batch`` frame: the actor wraps its handling of a
``TokenBatch`` in :meth:`ClientEndpoint.batching`. One frame per step instead of one per token per
stream: W1's 4,096 tokens over 64 streams were ~4,500 sends.

The socket stays in the actor: ``try_send(identity, frame)`` is given in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from actors.runtime.outbox import Outbox
from messages import client as cm
from messages.codec import encode
from messages.tokenizer import scoped_request_id

PROBE_S = 0.5  # an idle client with requests in flight is probed this often


@dataclass
class Client:
    label: str  # "c<n>": names the connection in events
    requests: dict[str, str] = field(default_factory=dict)  # client's id -> runtime-wide id
    last_send: float = 0.0  # trio clock
    leaving: bool = False  # gone, until ``settle`` (its frames still waiting are read first)
    batches: bool = False  # takes a step's messages in one ``Batch`` frame (``Generate.batch``)


class ClientEndpoint:
    def __init__(
        self,
        try_send: Callable[[bytes, bytes], bool],
        on_gone: Callable[[list[str]], None],
        boot_id: str,
        log: Any,
        on_leaving: Callable[[], None] = lambda: None,
    ) -> None:
        self.outbox: Outbox[bytes] = Outbox(try_send, on_gone=self._gone)
        self.clients: dict[bytes, Client] = {}
        self._on_gone = on_gone
        self._on_leaving = on_leaving
        self._leaving: list[bytes] = []
        self._boot = boot_id[:6]
        self._connections = itertools.count(1)
        self._requests = itertools.count(1)
        self.log = log
        self._batch: (
            dict[bytes, list[cm.PromptLogprobs | cm.Embedding | cm.Delta | cm.Final]] | None
        ) = None  # see ``batching``

    # ------------------------------------------------------------ requests
    def open(self, ident: bytes, request_id: str, batch: bool = False) -> str | None:
        """The runtime-wide id for the client's new ``request_id``, or None when the client
        already has a request in flight under that id. ``batch``: the client takes ``Batch``
        frames from now on (see :meth:`batching`)."""
        client = self.clients.get(ident)
        if client is None:
            client = self.clients[ident] = Client(f"c{next(self._connections)}")
        if request_id in client.requests:
            return None
        client.batches = client.batches or batch
        internal = scoped_request_id(request_id, f"{self._boot}.{next(self._requests)}")
        client.requests[request_id] = internal
        return internal

    def rekey(self, ident: bytes, request_id: str) -> str | None:
        """A new runtime-wide id for the client's request ``request_id`` in flight (its attempt
        died and it is resumed under a new id, so late messages of the old one cannot reach it);
        None if the client has no such request."""
        client = self.clients.get(ident)
        if client is None or request_id not in client.requests:
            return None
        internal = scoped_request_id(request_id, f"{self._boot}.{next(self._requests)}")
        client.requests[request_id] = internal
        return internal

    def lookup(self, ident: bytes, request_id: str) -> str | None:
        """The runtime-wide id of this client's request ``request_id`` in flight, if any."""
        client = self.clients.get(ident)
        return client.requests.get(request_id) if client is not None else None

    def label(self, ident: bytes) -> str:
        """The connection's name in events (``c<n>``)."""
        client = self.clients.get(ident)
        return client.label if client is not None else "?"

    def close(self, ident: bytes, request_id: str) -> None:
        """The request ended: its id is free for the client to use again."""
        client = self.clients.get(ident)
        if client is not None:
            client.requests.pop(request_id, None)

    def in_flight(self) -> int:
        return sum(len(c.requests) for c in self.clients.values())

    # ------------------------------------------------------------ sending
    def send(self, ident: bytes, msg: msgspec.Struct) -> None:
        """Send ``msg`` to the client (queued behind earlier frames if its queue is full).
        Inside :meth:`batching`, a ``Delta`` or ``Final`` for a client that takes batches waits
        for the batch's end; anything else first sends what waits for that client."""
        client = self.clients.get(ident)
        if client is not None:
            if client.leaving:
                return
            client.last_send = trio.current_time()
            if self._batch is not None and client.batches:
                if isinstance(msg, (cm.PromptLogprobs, cm.Embedding, cm.Delta, cm.Final)):
                    self._batch.setdefault(ident, []).append(msg)
                    return
                self._flush(ident)
        self.outbox.send(ident, encode(msg))

    @contextmanager
    def batching(self) -> Iterator[None]:
        """Within: what is sent to each client that takes batches is held, and at the end sent
        as one frame per client (a ``Batch``, or the message itself when there is one)."""
        self._batch = {}
        try:
            yield
        finally:
            for ident in list(self._batch):
                self._flush(ident)
            self._batch = None

    def _flush(self, ident: bytes) -> None:
        assert self._batch is not None
        held = self._batch.pop(ident, None)
        if not held:
            return
        client = self.clients.get(ident)
        if client is not None and client.leaving:
            return  # found gone meanwhile: nothing more is sent to it
        msg = held[0] if len(held) == 1 else cm.Batch(items=held)
        self.outbox.send(ident, encode(msg))

    def _gone(self, ident: bytes) -> None:
        client = self.clients.get(ident)
        if client is None or client.leaving:
            return
        client.leaving = True
        self._leaving.append(ident)
        self._on_leaving()

    def settle(self) -> None:
        """Forget the clients found gone; ``on_gone`` gets the requests each still had. Call it
        once the frames they sent before going are read (their cancels are handled as such)."""
        leaving, self._leaving = self._leaving, []
        for ident in leaving:
            client = self.clients.pop(ident, None)
            if client is None:
                continue
            self.log.info("client.disconnected", client=client.label, requests=len(client.requests))
            self._on_gone(list(client.requests.values()))

    async def probe_loop(self, probe: msgspec.Struct) -> None:
        """Forget clients with nothing in flight; send ``probe`` to the others that were sent
        nothing for ``PROBE_S`` (a failed send reveals a client that is gone)."""
        while True:
            await trio.sleep(PROBE_S)
            now = trio.current_time()
            for ident, client in list(self.clients.items()):
                if client.leaving:
                    continue
                if not client.requests:
                    if not self.outbox.pending(ident):
                        self.clients.pop(ident, None)
                elif now - client.last_send >= PROBE_S:
                    self.send(ident, probe)
