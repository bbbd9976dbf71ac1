"""The HTTP server's limits on what one client may hold (minirt/http/serving.py): a
connection that trickles its headers or its body is dropped, an idle kept-alive connection is
closed, and past the connection limit a new one is answered 503 and closed, while the
connections already open are served. The real server (hypercorn with the runtime's settings and
app) on a loopback port, on a mock clock: every timeout here is virtual, none takes real time."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
import trio.testing

from actors.runtime.config import HttpConfig
from actors.runtime.events import get_logger
from minirt.http.app import build_app
from minirt.http.model import ModelInfo
from minirt.http.server import Server
from minirt.http.serving import Connections, serve
from minirt.http.upstream import Upstream

KEEP_ALIVE_S = 5.0
BODY_TIMEOUT_S = 30.0


@pytest.fixture
def clock() -> trio.testing.MockClock:
    # a small real threshold: the jump waits for the loopback bytes in flight, not only tasks
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def http(tiny_model, nursery):
    settings = HttpConfig(
        port=0, keep_alive_s=KEEP_ALIVE_S, body_timeout_s=BODY_TIMEOUT_S, max_connections=3
    )
    log = get_logger()
    server = Server(
        model=ModelInfo.load(str(tiny_model)),
        upstream=Upstream("ipc:///nowhere", None, log),
        endpoints={},
        log=log,
        body_timeout_s=settings.body_timeout_s,
    )
    connections = Connections(settings.max_connections)
    [url] = await nursery.start(partial(serve, build_app(server), settings, connections))
    port = url.rsplit(":", 1)[1]
    return int(port), connections


async def _connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _read_all(stream: trio.SocketStream) -> bytes:
    """Everything until the server closes the connection (a reset too: the server closed while
    the client was still sending)."""
    out = b""
    try:
        while chunk := await stream.receive_some(65536):
            out += chunk
    except trio.BrokenResourceError:
        pass
    return out


async def _response(stream: trio.SocketStream) -> bytes:
    """One whole response (its head and ``content-length`` bytes of body)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += await stream.receive_some(65536)
    head, body = out.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body


async def _trickle(
    stream: trio.SocketStream, data: bytes, clock: trio.testing.MockClock, every_s: float
) -> None:
    """One byte, then the clock moved on ``every_s`` once the server has taken it in, until
    the server hangs up."""
    try:
        for i in range(len(data)):
            await stream.send_all(data[i : i + 1])
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(every_s)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def test_a_client_trickling_its_headers_is_dropped(http, clock):
    port, _ = http
    stream = await _connect(port)
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 100 + b"\r\n\r\n"
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_trickle, stream, head, clock, 1.0)  # would take 140 s
        answer = await _read_all(stream)
        nursery.cancel_scope.cancel()
    assert answer == b""  # closed without an answer: the request never started
    assert KEEP_ALIVE_S <= trio.current_time() - t0 < KEEP_ALIVE_S + 2


async def test_a_client_trickling_its_body_gets_408(http, clock):
    port, _ = http
    stream = await _connect(port)
    body = json.dumps({"prompt": "x" * 200}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_trickle, stream, body, clock, 1.0)  # would take 210 s
        answer = await _read_all(stream)
        nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "timeout" and "30 s" in error["message"]
    assert BODY_TIMEOUT_S <= trio.current_time() - t0 < BODY_TIMEOUT_S + 2


async def test_an_idle_kept_alive_connection_is_closed(http, clock):
    port, _ = http
    stream = await _connect(port)
    await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    first = await _response(stream)
    assert first.startswith(b"HTTP/1.1 200"), first[:100]
    t0 = trio.current_time()
    rest = await _read_all(stream)  # the response is whole: nothing more, then the close
    assert rest == b""
    assert KEEP_ALIVE_S <= trio.current_time() - t0 < KEEP_ALIVE_S + 2


async def test_past_the_connection_limit_a_new_one_gets_503_and_the_open_ones_are_served(
    http, clock
):
    port, connections = http
    held = [await _connect(port) for _ in range(3)]
    await trio.testing.wait_all_tasks_blocked()
    assert connections.open == 3
    extra = await _connect(port)
    answer = await _read_all(extra)
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"retry-after: 1" in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    assert connections.refused == 1
    # the connections already open are served
    await held[0].send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await _response(held[0])).startswith(b"HTTP/1.1 200")
    # and a closed one makes room (hypercorn ends its side within the keep-alive time)
    await held[1].aclose()
    clock.jump(KEEP_ALIVE_S + 0.5)
    await trio.testing.wait_all_tasks_blocked()
    assert connections.open < 3
    again = await _connect(port)
    await again.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert (await _read_all(again)).startswith(b"HTTP/1.1 200")
    for s in (held[0], held[2], extra, again):
        await s.aclose()
