"""A small trio adapter for pyzmq sockets.

pyzmq exposes one file descriptor per socket and it is *edge-triggered*: it signals "something
changed", not "a message is waiting", and any operation on the socket (a send too) may consume
that edge. So a reader must drain while ``EVENTS & POLLIN`` after every wake-up, and a send made
by another task must wake a parked reader if it finds input pending. ``inproc://`` endpoints do
not signal the FD at all, so minirt only uses ``ipc://`` and ``tcp://`` between tasks/processes.

One task reads a socket (``recv``); any task may ``send``. Sends never block the event loop: the
fast path is a non-blocking send, and at the high-water mark the sender waits (bounded) for room.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import trio
import zmq

DEFAULT_MAX_MSG_SIZE = 64 * 1024 * 1024
DEFAULT_HWM = 100_000


class SendTimeout(RuntimeError):
    """The peer did not take a message within the send deadline (its queue stayed full)."""


class ZSocket:
    """A pyzmq socket driven by trio. Create with ``open_socket``; close with ``close``."""

    def __init__(self, sock: zmq.Socket, send_timeout: float = 10.0) -> None:
        self.sock = sock
        self._fd: int = int(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
        self._wake = trio.Event()
        self._parked = False
        self.send_timeout = send_timeout
        self.closed = False

    def _events(self) -> int:
        return int(self.sock.getsockopt(zmq.EVENTS))  # type: ignore[arg-type]

    # ---------------------------------------------------------------- receive
    def recv_nowait(self) -> list[bytes] | None:
        """One multipart message if one is waiting, else None. Never blocks."""
        if self.closed:
            raise trio.ClosedResourceError("socket closed")
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def recv(self) -> list[bytes]:
        """The next multipart message, waiting for it without blocking other tasks."""
        while True:
            msg = self.recv_nowait()
            if msg is not None:
                return msg
            await self._wait_in()

    async def _wait_in(self) -> None:
        if self._events() & zmq.POLLIN:
            return
        self._wake = trio.Event()
        self._parked = True
        try:
            async with trio.open_nursery() as nursery:

                async def fd_ready() -> None:
                    await trio.lowlevel.wait_readable(self._fd)
                    nursery.cancel_scope.cancel()

                async def woken() -> None:
                    await self._wake.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(fd_ready)
                nursery.start_soon(woken)
        except (BaseExceptionGroup, OSError, trio.ClosedResourceError):
            # Closed while parked: trio may report the dead fd as EBADF; say what happened.
            if self.closed:
                raise trio.ClosedResourceError("socket closed") from None
            raise
        finally:
            self._parked = False

    async def wait_readable(self) -> None:
        """Return once a message can be received (for loops that drain with ``recv_nowait``),
        or once ``wake`` is called."""
        await self._wait_in()

    def wake(self) -> None:
        """Make a reader parked in ``wait_readable`` (or ``recv``) look at the socket again."""
        if self._parked:
            self._wake.set()

    # ------------------------------------------------------------------- send
    def _after_send(self) -> None:
        # A send may have consumed the FD's edge while input arrived: wake the parked reader.
        if self._parked and self._events() & zmq.POLLIN:
            self._wake.set()

    def send_nowait(self, frames: Sequence[bytes]) -> bool:
        """Send now if the socket has room; False at the high-water mark. Raises on routing errors."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            self._after_send()
        return True

    async def send(self, frames: Sequence[bytes]) -> None:
        """Send, waiting (up to ``send_timeout``) while the peer's queue is full."""
        if self.send_nowait(frames):
            return
        delay = 0.0005
        with trio.move_on_after(self.send_timeout):
            while True:
                await trio.sleep(delay)
                if self.send_nowait(frames):
                    return
                delay = min(delay * 2, 0.05)
        raise SendTimeout(f"send to {self.sock.getsockopt(zmq.LAST_ENDPOINT)!r} timed out")

    def close(self, linger_ms: int = 0) -> None:
        """Close now. A task parked in ``recv`` gets ``trio.ClosedResourceError``. ``linger_ms``:
        how long zmq's I/O thread may still deliver frames already sent (it never blocks here)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(RuntimeError):  # outside trio there is no waiter to tell
                trio.lowlevel.notify_closing(self._fd)
            self._wake.set()
            self.sock.close(linger=linger_ms)


def open_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: Sequence[str] = (),
    identity: bytes | None = None,
    max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
    hwm: int = DEFAULT_HWM,
    send_timeout: float = 10.0,
    curve: Any = None,
    allow_remote: bool = False,
) -> ZSocket:
    """Create a socket with minirt's defaults (size limit, high-water marks, no linger).

    ``curve`` (``actors.runtime.security.CurveKeys``): a bound socket becomes a CURVE server, a connecting
    one a CURVE client. Binding a non-loopback address raises ``InsecureBind`` unless
    ``allow_remote`` and ``curve`` are both given.
    """
    from actors.runtime.security import check_bind

    if bind is not None:
        check_bind(bind, allow_remote, curve is not None)
    sock = ctx.socket(kind)
    if curve is not None:
        if bind is not None:
            curve.server(sock)
        else:
            curve.client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Sending to a peer that is gone raises EHOSTUNREACH instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind is not None:
        if bind.startswith("ipc://"):
            path = bind[len("ipc://") :]
            if os.path.exists(path):
                os.unlink(path)
        sock.bind(bind)
    for addr in connect:
        sock.connect(addr)
    return ZSocket(sock, send_timeout=send_timeout)


def set_immediate(sock: ZSocket) -> None:
    """Queue nothing for a peer that is not connected (ZMQ_IMMEDIATE): a restarted peer never
    receives messages meant for the process it replaced."""
    sock.sock.setsockopt(zmq.IMMEDIATE, 1)
