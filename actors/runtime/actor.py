"""What every actor process shares: its inbox, connections to peers, handshake, health and errors.

An actor binds one ROUTER inbox; it talks to a peer through a DEALER connected to the peer's
inbox. The first message on each connection is ``Hello`` (protocol version); the receiver answers
``HelloAck`` and refuses a mismatch. Frames are decoded with the actor's typed decoder; a bad
frame gets an ``ErrorReply`` on the same connection and a ``protocol.error`` event, and the actor
carries on. Handlers are synchronous (policy, no awaits); their sends are queued and flushed by
the loop, so a handler never waits on a peer. Liveness (``liveness``), the send queues
(``outbox``) and the sockets (``transport``) are parts of their own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import trio
import zmq

from actors.runtime.config import RuntimeConfig
from actors.runtime.events import get_logger
from actors.runtime.exits import open_pidfd, wait_exit
from actors.runtime.liveness import Change, Kind, Liveness, LoopLag, host_id
from actors.runtime.outbox import Outbox
from actors.runtime.transport import ZSocket, open_socket, set_immediate
from messages.codec import BadFrame, Decoder, encode
from messages.common import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloAck,
    Ping,
    Pong,
)


class Actor:
    """Base class. Subclasses set ``name`` and ``inbound`` (their union), implement ``handle``."""

    name = "actor"
    inbound: Any = None
    peers: tuple[str, ...] = ("tokenizer", "scheduler", "kv_manager", "executor")
    dead_after = 3.0  # heartbeats of silence before a peer is suspect (liveness.py: not dead)
    replies: Any = None  # extra message types peers answer on our DEALERs (see on_peer_reply)

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.log = get_logger()
        self.boot_id = uuid.uuid4().hex[:12]
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.decoder: Decoder[Any] = Decoder(self.inbound)
        self.inbox: ZSocket | None = None
        self.out: dict[str, ZSocket] = {}  # one DEALER per peer
        self.curve: Any = None
        self.authenticator: Any = None
        base_replies: Any = HelloAck | Pong | ErrorReply
        self._reply_decoder: Decoder[Any] = Decoder(
            base_replies if self.replies is None else base_replies | self.replies
        )
        self.outbox: Outbox[str] = Outbox(self._send_to_peer)
        self.hb = cfg.heartbeat_s
        self.liveness = Liveness(
            (p for p in self.peers if p != self.name), self.hb, self.dead_after
        )
        self.peer_ready: dict[str, bool] = {}  # each peer's last Pong: does it take work?
        self.lag = LoopLag()  # how late this actor's event loop wakes (the heartbeat's sleep)
        self._nursery: trio.Nursery | None = None  # serve's: the pid watches run there

    # ------------------------------------------------------------------ setup
    def socket(self, kind: int, bind: str | None = None, connect: tuple[str, ...] = ()) -> ZSocket:
        """A socket with this runtime's size limit and security settings."""
        return open_socket(
            self.ctx,
            kind,
            bind=bind,
            connect=connect,
            max_msg_size=self.cfg.max_msg_size,
            curve=self.curve,
            allow_remote=self.cfg.security.allow_remote,
        )

    def open(self) -> None:
        """Bind the inbox and connect to peers (no waiting: zmq connects in the background)."""
        self.curve = self.cfg.curve_keys()
        if self.curve is not None:
            from actors.runtime.security import start_authenticator

            self.authenticator = start_authenticator(self.ctx, self.curve)
        self.inbox = self.socket(zmq.ROUTER, bind=self.cfg.endpoints.of(self.name))
        for peer in self.peers:
            if peer == self.name:
                continue
            sock = self.socket(zmq.DEALER, connect=(self.cfg.endpoints.of(peer),))
            set_immediate(sock)
            self.out[peer] = sock
            self.send(peer, Hello(actor=self.name, version=PROTOCOL_VERSION, pid=os.getpid()))

    def close(self) -> None:
        for sock in self.out.values():
            sock.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.authenticator is not None:
            self.authenticator.stop()

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actor until cancelled. Reports readiness once its inbox is bound."""
        self.open()
        self.log.info(
            "actor.started",
            pid=os.getpid(),
            boot_id=self.boot_id,
            endpoint=self.cfg.endpoints.of(self.name),
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for peer, sock in self.out.items():
                    nursery.start_soon(self._read_peer, peer, sock)
                nursery.start_soon(self.outbox.run)
                nursery.start_soon(self._heartbeat)
                await self.start_tasks(nursery)
                task_status.started()
                await self.main_loop()
        finally:
            self.close()

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        """Hook: start extra background tasks."""

    async def main_loop(self) -> None:
        """Default loop: wait for frames, handle each. The executor overrides this."""
        assert self.inbox is not None
        while True:
            await self.inbox.wait_readable()
            self.drain_inbox()
            await trio.sleep(0)

    # --------------------------------------------------------------- receive
    def drain_inbox(self, limit: int = 100_000) -> int:
        """Handle every frame waiting in the inbox, without waiting. Returns how many."""
        assert self.inbox is not None
        n = 0
        while n < limit:
            frames = self.inbox.recv_nowait()
            if frames is None:
                break
            n += 1
            self._dispatch(frames)
        return n

    def _dispatch(self, frames: list[bytes]) -> None:
        self.dispatch(frames, self.decoder, self.reply, self._on_hello, self.handle)

    def dispatch(
        self,
        frames: list[bytes],
        decoder: Decoder[Any],
        reply: Callable[[bytes, msgspec.Struct], None],
        on_hello: Callable[[bytes, Hello], None],
        handle: Callable[[bytes, Any], None],
        socket: str = "inbox",
    ) -> None:
        """One frame from a ROUTER: check the framing, decode it, answer ``Ping``, pass ``Hello``
        to ``on_hello`` and anything else to ``handle``. A bad frame or a handler bug is answered
        with an ``ErrorReply`` through ``reply``. Used by the inbox and by the tokenizer's client
        endpoint (which answers ``Hello`` with a ``Welcome`` and replies through its outbox)."""
        ident = frames[0]
        if len(frames) != 2:
            self.protocol_error(
                ident,
                f"expected 1 payload frame, got {len(frames) - 1}",
                reply=reply,
                socket=socket,
            )
            return
        try:
            msg = decoder.decode(frames[1])
        except BadFrame as e:
            self.protocol_error(ident, str(e), e.field, e.request_id, reply=reply, socket=socket)
            return
        if isinstance(msg, Hello):
            on_hello(ident, msg)
        elif isinstance(msg, Ping):
            reply(ident, self.pong(msg.nonce))
        else:
            try:
                handle(ident, msg)
            except Exception as e:  # a handler bug must not kill the actor
                self.log.exception(
                    "actor.handler_error",
                    message_type=type(msg).__name__,
                    request_id=getattr(msg, "request_id", None),
                )
                reply(
                    ident,
                    ErrorReply(
                        code=ErrorCode.INTERNAL,
                        message=f"{type(e).__name__}: {e}",
                        request_id=getattr(msg, "request_id", None),
                    ),
                )

    def pong(self, nonce: int) -> Pong:
        """The answer to a ``ping``: who this is, whether it takes work, how busy it was."""
        busy_ms = round(1000 * max(self.lag.recent_s, self.busy_s()), 1)
        return Pong(
            actor=self.name,
            nonce=nonce,
            pid=os.getpid(),
            boot_id=self.boot_id,
            ready=self.is_ready(),
            host=host_id(),
            busy_ms=busy_ms,
        )

    def version_refusal(self, msg: Hello, socket: str = "inbox") -> str:
        """Why ``msg``'s protocol version is refused (logged as ``protocol.error``), or ""."""
        if msg.version == PROTOCOL_VERSION:
            return ""
        reason = f"protocol version {msg.version} not supported; this {self.name} speaks {PROTOCOL_VERSION}"
        self.log.error(
            "protocol.error", peer=msg.actor, reason=reason, code=ErrorCode.VERSION, socket=socket
        )
        return reason

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        reason = self.version_refusal(msg)
        if reason:
            self.reply(
                ident, HelloAck(actor=self.name, version=PROTOCOL_VERSION, ok=False, reason=reason)
            )
            return
        self.log.info("peer.hello", peer=msg.actor, peer_pid=msg.pid)
        self.reply(ident, HelloAck(actor=self.name, version=PROTOCOL_VERSION))
        self.on_peer_hello(msg)

    def on_peer_hello(self, msg: Hello) -> None:
        """Hook: a peer (re)connected."""

    def handle(self, ident: bytes, msg: Any) -> None:
        raise NotImplementedError

    def protocol_error(
        self,
        ident: bytes,
        message: str,
        field: str | None = None,
        request_id: str | None = None,
        reply: Callable[[bytes, msgspec.Struct], None] | None = None,
        socket: str = "inbox",
    ) -> None:
        self.log.warning(
            "protocol.error", reason=message, field=field, request_id=request_id, socket=socket
        )
        (reply or self.reply)(
            ident,
            ErrorReply(
                code=ErrorCode.BAD_FRAME, message=message, field=field, request_id=request_id
            ),
        )

    async def _read_peer(self, peer: str, sock: ZSocket) -> None:
        """Read what a peer sends back on our DEALER: hello acks, pongs, errors."""
        while True:
            frames = await sock.recv()
            try:
                msg = self._reply_decoder.decode(frames[-1])
            except BadFrame as e:
                self.log.warning("protocol.error", peer=peer, reason=str(e))
                continue
            if isinstance(msg, Pong):
                self.peer_ready[peer] = msg.ready
                change = self.liveness.pong(peer, msg.boot_id, msg.busy_ms / 1000)
                if change is not None:
                    self._peer_changed(change, msg.pid)
                if msg.pid and msg.host and self.liveness.wants_watch(peer, msg.boot_id):
                    self._watch(peer, msg)
            elif isinstance(msg, HelloAck):
                if not msg.ok:
                    self.log.error(
                        "protocol.error", peer=peer, reason=msg.reason, code=ErrorCode.VERSION
                    )
                    raise SystemExit(f"{peer} refused the handshake: {msg.reason}")
                self.log.info("peer.ready", peer=peer)
            elif isinstance(msg, ErrorReply):
                self.log.warning(
                    "peer.error",
                    peer=peer,
                    code=msg.code,
                    reason=msg.message,
                    request_id=msg.request_id,
                )
            else:
                self.on_peer_reply(peer, msg)

    def _watch(self, peer: str, pong: Pong) -> None:
        """Watch ``peer``'s process for its exit when it runs on this host (``exits``)."""
        here = pong.host == host_id() and self._nursery is not None
        fd = open_pidfd(pong.pid, peer, self.log) if here else None
        self.liveness.watch(peer, pong.boot_id, fd is not None)
        if fd is not None and self._nursery is not None:
            self._nursery.start_soon(self._await_exit, peer, pong.boot_id, pong.pid, fd)

    async def _await_exit(self, peer: str, boot_id: str, pid: int, fd: int) -> None:
        await wait_exit(fd)
        change = self.liveness.exited(peer, boot_id, f"its process {pid} exited")
        if change is not None:
            self._peer_changed(change, pid)

    def on_peer_reply(self, peer: str, msg: Any) -> None:
        """Hook: a reply of one of ``replies``' types from ``peer``."""

    async def _heartbeat(self) -> None:
        """Ping every peer each ``heartbeat_s``; then act on the ones silent for too long."""
        nonce = 0
        while True:
            nonce += 1
            ping = encode(Ping(nonce=nonce))
            for sock in self.out.values():
                try:
                    sock.send_nowait([ping])
                except zmq.ZMQError:
                    pass
            asked = trio.current_time()
            await trio.sleep(self.hb)
            window = self.lag.add(trio.current_time() - asked - self.hb, trio.current_time())
            if window is not None:
                self.log.info("actor.loop_lag", **window)
            for change in self.liveness.check():
                self._peer_changed(change)

    def _peer_changed(self, change: Change, pid: int = 0) -> None:
        """Act on what ``self.liveness`` noticed: a restart is a death followed by a return."""
        peer = change.peer
        if change.kind is Kind.SUSPECT:  # slow, starved, stopped: requests wait, nothing resets
            self.log.warning("peer.suspect", peer=peer, silent_s=round(change.silent_s, 2))
            return
        if change.kind is Kind.CLEARED:
            self.log.info("peer.cleared", peer=peer, silent_s=round(change.silent_s, 2))
            return
        if change.kind in (Kind.DIED, Kind.RESTARTED):
            self.outbox.drop(peer)  # never deliver stale messages to a successor
            self.log.error("peer.dead", peer=peer, reason=change.reason)
            self.on_peer_dead(peer, change.reason)
        if change.kind is not Kind.DIED:
            self.log.info("peer.alive", peer=peer, peer_pid=pid, boot_id=change.boot_id)
        if change.kind in (Kind.BACK, Kind.RESTARTED):
            self.on_peer_back(peer)

    @property
    def down(self) -> frozenset[str]:
        """Peers declared dead and not back yet."""
        return self.liveness.down

    def busy_s(self) -> float:
        """Hook: how long this actor has been kept from answering by work of its own (the
        executor: the step in flight), reported in every Pong beside the loop's lag."""
        return 0.0

    def is_ready(self) -> bool:
        """Whether this actor takes work now (answered in every Pong)."""
        return True

    def on_peer_dead(self, name: str, reason: str) -> None:
        """Hook: ``name`` died. Every request in flight spans all actors, so by default each
        actor drops (and reports) the requests it holds; see the subclasses."""

    def on_peer_back(self, name: str) -> None:
        """Hook: ``name`` answers heartbeats again after it was declared dead (its successor)."""

    # ------------------------------------------------------------------ send
    def send(self, peer: str, msg: msgspec.Struct) -> None:
        """Queue ``msg`` for ``peer``; sent now when its queue has room, else by the flusher."""
        self.outbox.send(peer, encode(msg))

    def _send_to_peer(self, peer: str, data: bytes) -> bool:
        return self.out[peer].send_nowait([data])

    def reply(self, ident: bytes, msg: msgspec.Struct) -> None:
        """Answer the sender of a frame on the inbox connection (dropped if it is gone)."""
        assert self.inbox is not None
        try:
            self.inbox.send_nowait([ident, encode(msg)])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer disconnected
            self.log.info("actor.reply_dropped", reason=str(e), message_type=type(msg).__name__)
