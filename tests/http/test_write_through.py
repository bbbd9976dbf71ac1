"""The HTTP server's writes straight to the socket (minirt/http/serving.py WriteThrough):
what a slow reader's socket cannot take goes hypercorn's way, in order, and a peer that is gone
closes the connection, as hypercorn's own path does."""

from __future__ import annotations

import socket

import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, RawData

from minirt.http.serving import WriteThrough


class _Protocol:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def handle(self, event: object) -> None:
        self.events.append(event)


def _server() -> tuple[WriteThrough, socket.socket, _Protocol]:
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    tcp = WriteThrough(None, Config(), None, None, stream)  # type: ignore[arg-type]
    tcp.protocol = _Protocol()  # type: ignore[assignment]
    return tcp, peer, tcp.protocol  # type: ignore[return-value]


async def test_a_slow_reader_gets_every_write_whole_and_in_order():
    tcp, peer, protocol = _server()
    first = bytes(range(256)) * 4096  # 1 MiB: far more than both socket buffers hold
    second, third = b"second chunk", b"third chunk"
    peer.setblocking(False)
    got = bytearray()
    reading = trio.Event()

    async def read_all() -> None:
        await reading.wait()
        while len(got) < len(first) + len(second) + len(third):
            await trio.lowlevel.wait_readable(peer)
            got.extend(peer.recv(1 << 16))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tcp.protocol_send, RawData(data=first))
        await trio.testing.wait_all_tasks_blocked()
        # the first write filled the socket and waits for it, holding hypercorn's lock
        assert tcp.send_lock.locked()
        nursery.start_soon(read_all)
        got.extend(peer.recv(1 << 16))  # the socket has room again; no task has run since
        reading.set()
        # so a write straight to it now would overtake the rest of the first: it must queue
        await tcp.protocol_send(RawData(data=second))
        await tcp.protocol_send(RawData(data=third))
    assert bytes(got) == first + second + third
    assert protocol.events == []
    # nothing waits now: a write goes straight out
    await tcp.protocol_send(RawData(data=b"straight"))
    assert not tcp.send_lock.locked()
    await trio.lowlevel.wait_readable(peer)
    assert peer.recv(64) == b"straight"
    peer.close()
    await tcp.stream.aclose()


async def test_a_gone_peer_closes_the_connection():
    tcp, peer, protocol = _server()
    peer.close()
    await tcp.protocol_send(RawData(data=b"data: {}\n\n"))
    assert [type(e) for e in protocol.events] == [Closed]
    await tcp.stream.aclose()
