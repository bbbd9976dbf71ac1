"""Python client for minirt (sync and trio async). The CLI uses it; so can you.

async with open_client("ipc://.minirt/sock/client") as c:
    result = await c.generate(prompt="hello", max_tokens=16)
    async for delta in c.stream(prompt="hello"): ...

with SyncClient(endpoint) as c:
    for msg in c.stream(prompt="hello"): ...
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import zmq

from actors.runtime.security import CurveKeys
from actors.runtime.transport import ZSocket, open_socket
from messages import client as cm
from messages.codec import Decoder, encode
from messages.common import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloAck,
    Ping,
    Pong,
    SamplingParams,
)
from messages.tokenizer import Cancel, ChatMessage, Generate


class RequestError(RuntimeError):
    """The server refused or failed a request. ``code`` and ``field`` say why."""

    def __init__(self, reply: ErrorReply) -> None:
        where = f" ({reply.field})" if reply.field else ""
        super().__init__(f"{reply.code}{where}: {reply.message}")
        self.code = str(reply.code)
        self.field = reply.field
        self.request_id = reply.request_id


@dataclass
class Result:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    preemptions: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def build_generate(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt_ids: list[int] | None = None,
    stop: list[str] | None = None,
    request_id: str | None = None,
    **params: Any,
) -> Generate:
    """A ``Generate`` message; ``params`` are ``SamplingParams`` fields (max_tokens, temperature...)."""
    return Generate(
        prompt=prompt,
        messages=[ChatMessage(**m) for m in messages] if messages is not None else None,
        prompt_ids=prompt_ids,
        params=SamplingParams(**params),
        request_id=request_id or uuid.uuid4().hex,
        stop=stop or [],
    )


def _ends_stream(msg: Any) -> bool:
    """True for a request's last message; raises ``RequestError`` for an error reply."""
    if isinstance(msg, ErrorReply):
        raise RequestError(msg)
    return isinstance(msg, cm.Final)


def _apply(result: Result, msg: Any) -> bool:
    """Fold one server message into ``result``; True when it ends the request."""
    if isinstance(msg, cm.Delta):
        result.text += msg.text
        result.token_ids.extend(msg.token_ids)
        if msg.logprobs:
            result.logprobs.extend(msg.logprobs)
        return False
    if isinstance(msg, cm.Final):
        result.finish_reason = msg.finish_reason
        result.usage = msgspec.structs.asdict(msg.usage)
        result.timings = msgspec.structs.asdict(msg.timings)
        result.stop_reason = msg.stop_reason
        result.preemptions = msg.preemptions
        return True
    if isinstance(msg, ErrorReply):
        raise RequestError(msg)
    return False


class AsyncClient:
    """One DEALER connection; many concurrent requests, demultiplexed by request id."""

    def __init__(self, sock: ZSocket) -> None:
        self.sock = sock
        self._decoder: Decoder[Any] = Decoder(cm.ClientInbound)
        self._streams: dict[str, trio.MemorySendChannel[Any]] = {}
        self._control: trio.MemorySendChannel[Any]
        self._control_recv: trio.MemoryReceiveChannel[Any]
        self._control, self._control_recv = trio.open_memory_channel(64)
        self.welcome: cm.Welcome | None = None
        self._nonce = itertools.count(1)
        self._last_rx = 0.0
        self.probe_s = 1.0
        self.dead_s = 3.0

    async def _reader(self) -> None:
        self._last_rx = trio.current_time()
        while True:
            try:
                frames = await self.sock.recv()
            except (zmq.ZMQError, trio.ClosedResourceError):
                if self.sock.closed:
                    return  # close() was called: the connection is gone on purpose
                raise
            msg = self._decoder.decode(frames[-1])
            self._last_rx = trio.current_time()
            rid = getattr(msg, "request_id", None)
            if isinstance(msg, Pong):
                welcome_boot = self.welcome.boot_id if self.welcome else ""
                if welcome_boot and msg.boot_id and msg.boot_id != welcome_boot:
                    await self._fail_all("tokenizer service restarted; request lost")
                continue
            if rid is not None and rid in self._streams:
                chan = self._streams[rid]
                await chan.send(msg)
                if isinstance(msg, (cm.Final, ErrorReply)):
                    self._streams.pop(rid, None)
                    await chan.aclose()
            elif isinstance(msg, (cm.Welcome, HelloAck)) or (
                isinstance(msg, ErrorReply) and rid is None
            ):
                await self._control.send(msg)
            # late messages of finished requests are ignored

    async def _fail_all(self, reason: str) -> None:
        for rid, chan in list(self._streams.items()):
            self._streams.pop(rid, None)
            await chan.send(ErrorReply(code=ErrorCode.ACTOR_DEAD, message=reason, request_id=rid))
            await chan.aclose()

    async def _watchdog(self) -> None:
        """While requests are open, ping the server; fail them all if it stops answering."""
        while True:
            await trio.sleep(self.probe_s)
            if not self._streams or self.sock.closed:
                continue
            silent = trio.current_time() - self._last_rx
            if silent > self.dead_s:
                await self._fail_all(f"tokenizer service stopped answering ({silent:.1f}s)")
                continue
            try:
                self.sock.send_nowait([encode(Ping(nonce=next(self._nonce)))])
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Drop the connection now; the server aborts this connection's requests."""
        self.sock.close()

    async def hello(self) -> cm.Welcome:
        await self.sock.send(
            [encode(Hello(actor="client", version=PROTOCOL_VERSION, pid=os.getpid()))]
        )
        msg = await self._control_recv.receive()
        if isinstance(msg, ErrorReply):
            raise RequestError(msg)
        if not msg.ok:
            raise RuntimeError(f"server refused the handshake: {msg.reason}")
        self.welcome = msg
        return msg  # type: ignore[no-any-return]

    async def stream(self, request: Generate | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """Yield the server's messages for one request (Accepted, Delta..., Final).
        Raises ``RequestError`` on an error reply. Cancelling the iteration cancels the request."""
        req = request or build_generate(**kwargs)
        send, recv = trio.open_memory_channel[Any](1024)
        self._streams[req.request_id] = send
        done = False
        try:
            await self.sock.send([encode(req)])
            async for msg in recv:
                done = isinstance(msg, (ErrorReply, cm.Final))
                if _ends_stream(msg):
                    yield msg
                    return
                yield msg
        finally:
            self._streams.pop(req.request_id, None)
            if not done:
                with trio.CancelScope(shield=True):
                    await self.cancel(req.request_id)

    async def generate(self, request: Generate | None = None, **kwargs: Any) -> Result:
        """Run one request to completion and return its ``Result``."""
        req = request or build_generate(**kwargs)
        result = Result(req.request_id)
        async for msg in self.stream(req):
            if _apply(result, msg):
                break
        return result

    async def cancel(self, request_id: str) -> None:
        if not self.sock.closed:  # a closed connection already aborts its requests server-side
            await self.sock.send([encode(Cancel(request_id=request_id))])


@asynccontextmanager
async def open_client(
    endpoint: str, handshake: bool = True, curve_dir: str | None = None
) -> AsyncIterator[AsyncClient]:
    """Connect to the client endpoint; ``curve_dir`` holds keys from ``minirt keys`` when the
    server requires CURVE."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    curve = CurveKeys.load(curve_dir) if curve_dir else None
    sock = open_socket(ctx, zmq.DEALER, connect=[endpoint], curve=curve)
    client = AsyncClient(sock)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._reader)
            nursery.start_soon(client._watchdog)
            if handshake:
                await client.hello()
            yield client
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Give the caller the error its own code raised, not a nursery's wrapper.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        sock.close()


class SyncClient:
    """Blocking client: one request at a time on one connection."""

    def __init__(
        self, endpoint: str, timeout_s: float = 600.0, curve_dir: str | None = None
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_dir:
            CurveKeys.load(curve_dir).client(self.sock)
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)
        self._decoder: Decoder[Any] = Decoder(cm.ClientInbound)
        self.welcome: cm.Welcome | None = None

    def __enter__(self) -> SyncClient:
        self.sock.send(encode(Hello(actor="client", version=PROTOCOL_VERSION, pid=os.getpid())))
        msg = self._recv()
        if isinstance(msg, ErrorReply):
            raise RequestError(msg)
        if not isinstance(msg, cm.Welcome) or not msg.ok:
            raise RuntimeError(f"server refused the handshake: {getattr(msg, 'reason', msg)}")
        self.welcome = msg
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close(linger=0)

    def _recv(self, dead_s: float = 3.0) -> Any:
        """The next message. While waiting, ping the server every second; a server silent for
        ``dead_s`` seconds (or one that restarted) fails the request with ``actor_dead``."""
        waited = 0.0
        silent = 0.0
        nonce = 0
        while True:
            if self.sock.poll(1000):
                msg = self._decoder.decode(self.sock.recv())
                silent = 0.0
                if isinstance(msg, Pong):
                    boot = self.welcome.boot_id if self.welcome else ""
                    if boot and msg.boot_id and msg.boot_id != boot:
                        raise RequestError(
                            ErrorReply(
                                code=ErrorCode.ACTOR_DEAD, message="tokenizer service restarted"
                            )
                        )
                    continue
                return msg
            waited += 1.0
            silent += 1.0
            if waited * 1000 >= self.timeout_ms:
                raise TimeoutError(f"no answer from the server in {waited:.0f}s")
            if silent > dead_s and self.welcome is not None:
                raise RequestError(
                    ErrorReply(
                        code=ErrorCode.ACTOR_DEAD,
                        message=f"tokenizer service stopped answering ({silent:.0f}s)",
                    )
                )
            nonce += 1
            try:
                self.sock.send(encode(Ping(nonce=nonce)), zmq.NOBLOCK)
            except zmq.Again:
                pass

    def stream(self, request: Generate | None = None, **kwargs: Any) -> Iterator[Any]:
        req = request or build_generate(**kwargs)
        self.sock.send(encode(req))
        done = False
        try:
            while True:
                msg = self._recv()
                if getattr(msg, "request_id", req.request_id) != req.request_id:
                    continue
                done = isinstance(msg, (ErrorReply, cm.Final))
                if _ends_stream(msg):
                    yield msg
                    return
                yield msg
        finally:
            if not done:
                self.sock.send(encode(Cancel(request_id=req.request_id)))

    def generate(self, request: Generate | None = None, **kwargs: Any) -> Result:
        req = request or build_generate(**kwargs)
        result = Result(req.request_id)
        for msg in self.stream(req):
            if _apply(result, msg):
                break
        return result
