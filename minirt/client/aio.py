"""The trio client: one connection, many concurrent requests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio
import zmq

from actors.runtime.security import CurveKeys
from actors.runtime.transport import ZSocket, open_socket
from messages import client as cm
from messages.codec import Decoder, encode
from messages.common import ErrorReply, HelloAck, Pong
from messages.tokenizer import Cancel, Generate, Lora
from minirt.client.core import (
    CLOSE_LINGER_MS,
    MAX_RESUMES,
    READY_POLL_S,
    READY_TIMEOUT_S,
    ConnectionLost,
    Lost,
    RequestError,
    Result,
    ServerWatch,
    build_generate,
    ends_stream,
    resumed,
)


def connect(endpoint: str, curve_dir: str | None = None) -> ZSocket:
    """A DEALER to the client endpoint with the runtime's socket defaults; ``curve_dir`` holds
    keys from ``minirt keys`` when the server requires CURVE."""
    curve = CurveKeys.load(curve_dir) if curve_dir else None
    return open_socket(zmq.Context.instance(), zmq.DEALER, connect=[endpoint], curve=curve)


class AsyncClient:
    """One DEALER connection; many concurrent requests, demultiplexed by request id.

    With ``resume`` (the default), a request whose connection is lost (the front door restarted
    or went silent) is not failed: once the service serves again the client resubmits it with
    the token ids it already received, and its stream goes on with the next token (a second
    ``Accepted`` is not yielded). After ``MAX_RESUMES`` lost connections it fails with
    ``actor_dead``.

    Its requests ask for ``Batch`` frames (``Generate.batch``): the front door then sends what
    one step made for this connection's streams as one frame, which the reader unpacks in
    order, so each stream still sees one ``Delta`` per token."""

    def __init__(self, sock: ZSocket, resume: bool = True) -> None:
        self.sock = sock
        self.resume = resume
        self._rehello = trio.Lock()
        self.watch = ServerWatch()
        self._decoder: Decoder[Any] = Decoder(cm.ClientInbound)
        self._streams: dict[str, trio.MemorySendChannel[Any]] = {}
        self._control: trio.MemorySendChannel[Any]
        self._control_recv: trio.MemoryReceiveChannel[Any]
        self._control, self._control_recv = trio.open_memory_channel(64)

    @property
    def welcome(self) -> cm.Welcome | None:
        return self.watch.welcome

    async def _reader(self) -> None:
        while True:
            try:
                frames = await self.sock.recv()
            except (zmq.ZMQError, trio.ClosedResourceError):
                if self.sock.closed:
                    return  # close() was called: the connection is gone on purpose
                raise
            msg = self._decoder.decode(frames[-1])
            lost = self.watch.heard(msg, trio.current_time())
            if lost:
                await self._fail_all(lost)
            if isinstance(msg, Pong):
                continue
            for item in msg.items if isinstance(msg, cm.Batch) else (msg,):
                await self._deliver(item)

    async def _deliver(self, msg: Any) -> None:
        """One message to the stream it belongs to (or the handshake's channel)."""
        rid = getattr(msg, "request_id", None)
        if rid is not None and rid in self._streams:
            chan = self._streams[rid]
            await chan.send(msg)
            if isinstance(msg, (cm.Final, ErrorReply, cm.LoraList)):
                # only if still this stream's: during the send above the caller may have
                # ended it and started a new request under the same id
                if self._streams.get(rid) is chan:
                    del self._streams[rid]
                await chan.aclose()
        elif isinstance(msg, (cm.Welcome, HelloAck)) or (
            isinstance(msg, ErrorReply) and rid is None
        ):
            await self._control.send(msg)
        # late messages of finished requests are ignored

    async def _fail_all(self, reason: str) -> None:
        """The connection is lost: tell every open stream, which resumes or fails (``stream``)."""
        lost = Lost(reason, self.watch.boot_id)
        for chan in list(self._streams.values()):
            try:
                await chan.send(lost)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass

    async def _watchdog(self) -> None:
        """While requests are open, ping the server; fail them all if it stops answering."""
        while True:
            await trio.sleep(self.watch.probe_s)
            if not self._streams or self.sock.closed:
                continue
            lost = self.watch.silence(trio.current_time())
            if lost:
                await self._fail_all(lost)
                continue
            try:
                self.sock.send_nowait([self.watch.ping()])
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Drop the connection now; the server aborts this connection's requests."""
        self.sock.close()

    async def hello(self, ready_timeout: float = READY_TIMEOUT_S) -> cm.Welcome:
        """Handshake, then wait until the runtime serves: while ``Welcome.ready`` is false, say
        ``hello`` again every ``READY_POLL_S``; ``TimeoutError`` after ``ready_timeout`` s."""
        with trio.move_on_after(ready_timeout):
            while True:
                await self.sock.send([self.watch.hello()])
                if self.watch.welcomed(await self._control_recv.receive()):
                    assert self.watch.welcome is not None
                    return self.watch.welcome
                await trio.sleep(READY_POLL_S)
        raise self.watch.not_ready(ready_timeout)

    async def _reconnect(self, lost_boot: str, ready_timeout: float = READY_TIMEOUT_S) -> None:
        """After a lost connection: handshake with the front door's successor (once for all the
        streams that lost it) and wait until it serves."""
        async with self._rehello:
            if self.watch.boot_id != lost_boot:
                return  # another stream already did
            with trio.move_on_after(ready_timeout):
                while True:
                    while True:  # answers to earlier hellos would be mistaken for this one's
                        try:
                            self._control_recv.receive_nowait()
                        except trio.WouldBlock:
                            break
                    await self.sock.send([self.watch.hello()])
                    with trio.move_on_after(0.5):  # a hello sent to the dead one is lost
                        welcome = await self._control_recv.receive()
                        if self.watch.welcomed(welcome) and self.watch.boot_id != lost_boot:
                            self.watch.last_rx = trio.current_time()
                            return
                    await trio.sleep(READY_POLL_S)
            raise self.watch.not_ready(ready_timeout)

    async def stream(self, request: Generate | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """Yield the server's messages for one request (Accepted, Delta..., Final).
        Raises ``RequestError`` on an error reply. Cancelling the iteration cancels the request."""
        req = request or build_generate(**kwargs)
        if not req.batch:  # this client unpacks Batch frames (_reader)
            req = msgspec.structs.replace(req, batch=True)
        send, recv = trio.open_memory_channel[Any](1024)
        self._streams[req.request_id] = send
        self.watch.opened(trio.current_time())
        done = False
        received: list[int] = []  # what a resume continues after
        boot, resumes, skip_accepted = self.watch.boot_id, 0, False
        try:
            await self.sock.send([encode(req)])
            async for msg in recv:
                if isinstance(msg, Lost):
                    if msg.boot_id != boot:
                        continue  # a loss of the connection before the last resume
                    if not self.resume or resumes >= MAX_RESUMES:
                        done = True
                        why = f"{msg.reason}; resumed {resumes} times" if resumes else msg.reason
                        raise ConnectionLost(self.watch.lost(why, req.request_id))
                    resumes += 1
                    await self._reconnect(boot)
                    boot, skip_accepted = self.watch.boot_id, True
                    await self.sock.send([encode(resumed(req, received))])
                    continue
                if skip_accepted and isinstance(msg, cm.Accepted):
                    skip_accepted = False
                    continue
                if isinstance(msg, cm.Delta):
                    received.extend(msg.token_ids)
                done = isinstance(msg, (ErrorReply, cm.Final))
                if ends_stream(msg):
                    yield msg
                    return
                yield msg
        finally:
            self.watch.closed()
            self._streams.pop(req.request_id, None)
            if not done:
                with trio.CancelScope(shield=True):
                    await self.cancel(req.request_id)

    async def generate(self, request: Generate | None = None, **kwargs: Any) -> Result:
        """Run one request to completion and return its ``Result``."""
        req = request or build_generate(**kwargs)
        result = Result(req.request_id)
        async for msg in self.stream(req):
            if result.apply(msg):
                break
        return result

    async def lora(self, op: str, lora_name: str = "", lora_path: str = "") -> cm.LoraList:
        """Load (``lora_path``: a PEFT adapter's directory, on the server's machine), unload
        or list (``op``) the server's LoRA adapters; the adapters served afterwards.
        ``RequestError`` naming the field when refused (LoRA not enabled, a name taken or
        unknown, an adapter that does not fit the model)."""
        rid = f"lora-{uuid.uuid4().hex}"
        send, recv = trio.open_memory_channel[Any](4)
        self._streams[rid] = send
        try:
            op_msg = Lora(request_id=rid, op=op, lora_name=lora_name, lora_path=lora_path)
            await self.sock.send([encode(op_msg)])
            async for msg in recv:
                if isinstance(msg, ErrorReply):
                    raise RequestError(msg)
                if isinstance(msg, Lost):
                    raise ConnectionLost(self.watch.lost(msg.reason, rid))
                if isinstance(msg, cm.LoraList):
                    return msg
            raise ConnectionLost(self.watch.lost("the connection closed", rid))
        finally:
            self._streams.pop(rid, None)

    async def cancel(self, request_id: str) -> None:
        if not self.sock.closed:  # a closed connection already aborts its requests server-side
            await self.sock.send([encode(Cancel(request_id=request_id))])


@asynccontextmanager
async def open_client(
    endpoint: str,
    handshake: bool = True,
    curve_dir: str | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
    resume: bool = True,
) -> AsyncIterator[AsyncClient]:
    """Connect to the client endpoint; ``curve_dir`` holds keys from ``minirt keys`` when the
    server requires CURVE. The handshake waits (up to ``ready_timeout`` s) until it serves.
    ``resume``: resume streams whose connection was lost (see ``AsyncClient``)."""
    sock = connect(endpoint, curve_dir)
    client = AsyncClient(sock, resume)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._reader)
            nursery.start_soon(client._watchdog)
            if handshake:
                await client.hello(ready_timeout)
            yield client
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Give the caller the error its own code raised, not a nursery's wrapper.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        sock.close(linger_ms=CLOSE_LINGER_MS)  # a cancel sent just before still goes out
