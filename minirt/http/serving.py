"""The HTTP server's sockets: hypercorn's trio worker, and the limits of what a client may hold.

Every limit is a setting of the server library where it has one, and each has a test
(tests/http/test_http_limits.py):

- **Headers and idle connections** (``--http-keep-alive-s``): hypercorn's ``keep_alive_timeout``.
  hypercorn counts a connection as busy only from the moment a request's headers are complete,
  so this one timeout closes both a kept-alive connection that sends nothing and one that
  trickles its headers.
- **Header size**: ``h11_max_incomplete_size`` (a request head over it is answered 400).
- **Requests per connection**: ``keep_alive_max_requests``.
- **Body size and time**: read by the app (``app._body``): 413 as soon as the body is known to
  be over ``MAX_BODY``, 408 when it has not all arrived within ``--http-body-timeout-s``.
- **Open connections** (``--http-max-connections``): the one limit hypercorn has no setting
  for. Its per-connection server is wrapped: past the limit a new connection is answered 503
  (OpenAI's error shape, ``Retry-After``) and closed, as uvicorn's ``--limit-concurrency`` does.

Each write goes straight to the socket when it can (:class:`WriteThrough`): a streamed token is
one write, and hypercorn's own path (its lock and trio's ``send_all``, each a trip through trio's
scheduler, with a shielded cancel scope and async context managers around them) cost more than
the system call.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

import hypercorn.trio.run as hypercorn_run
import trio
from hypercorn.config import Config
from hypercorn.events import Event, RawData
from hypercorn.trio.tcp_server import TCPServer

from actors.runtime.config import HttpConfig
from minirt.http import h1only

MAX_HEADER_BYTES = 16 * 1024
KEEP_ALIVE_MAX_REQUESTS = 1000
REFUSE_SEND_S = 1.0  # a refused client that does not read its 503 is closed anyway


def hypercorn_config(settings: HttpConfig) -> Config:
    config = Config()
    host = settings.host
    config.bind = [f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.backlog = 4096
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = settings.keep_alive_s
    config.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    return config


class WriteThrough(TCPServer):
    """hypercorn's per-connection server, whose writes go straight to the socket when nothing
    else is being written: a non-blocking ``write`` of the whole buffer, with no trip through
    trio's scheduler. What the kernel does not take (a full send buffer: a slow reader), a
    failed write (the peer gone), and any write while an earlier one waits for the socket, go
    hypercorn's way (its lock keeps the order; its errors close the connection). It takes
    ~40% off the server's CPU per streamed chunk (docs/benchmarks/openai/http-cpu/README.md)."""

    async def protocol_send(self, event: Event) -> None:
        stream = self.stream
        if type(event) is RawData and type(stream) is trio.SocketStream:
            fd = stream.socket.fileno()
            if fd >= 0 and not self.send_lock.locked():
                data = event.data
                try:
                    sent = os.write(fd, data)
                except OSError:  # a full socket, or the peer gone (hypercorn's send closes)
                    sent = 0
                if sent == len(data):
                    return
                if sent:
                    event = RawData(data=data[sent:])
        await super().protocol_send(event)


class Connections:
    """The open connections, at most ``limit`` (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0

    def server(self, *args: Any, **kwargs: Any) -> Any:
        """What hypercorn builds per accepted connection: its own server, or a refusal."""
        tcp = WriteThrough(*args, **kwargs)
        if self.limit and self.open >= self.limit:
            return self._refuse(tcp.stream)
        return self._serve(tcp)

    async def _serve(self, tcp: WriteThrough) -> None:
        self.open += 1
        try:
            await tcp.run()
        finally:
            self.open -= 1

    async def _refuse(self, stream: Any) -> None:
        self.refused += 1
        body = json.dumps(
            {
                "error": {
                    "message": f"the server holds its limit of {self.limit} open connections; "
                    "retry",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "too_many_connections",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
        ).encode()
        with trio.move_on_after(REFUSE_SEND_S):
            try:
                await stream.send_all(head + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await stream.aclose()


async def serve(
    app: Any,
    settings: HttpConfig,
    connections: Connections | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with ``settings``' limits until cancelled (one server per process);
    ``started`` with the bound URLs."""
    from hypercorn.trio import serve as hypercorn_serve

    h1only.install()  # no HTTP/2: routers' gRPC probes must not reach its code
    connections = connections or Connections(settings.max_connections)
    hypercorn_run.TCPServer = partial(Connections.server, connections)  # type: ignore[assignment,misc]
    await hypercorn_serve(app, hypercorn_config(settings), task_status=task_status)
