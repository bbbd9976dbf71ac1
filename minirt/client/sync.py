"""The blocking client: one request at a time on one connection (the CLI's)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from messages import client as cm
from messages.codec import Decoder, encode
from messages.common import ErrorReply, Pong
from messages.tokenizer import Cancel, Generate
from minirt.client.aio import connect
from minirt.client.core import (
    CLOSE_LINGER_MS,
    MAX_RESUMES,
    READY_POLL_S,
    READY_TIMEOUT_S,
    ConnectionLost,
    Result,
    ServerWatch,
    build_generate,
    ends_stream,
    resumed,
)


class SyncClient:
    """Blocking client: one request at a time on one connection. With ``resume`` (the default) a
    request whose connection is lost is resubmitted with the tokens already received once the
    service serves again (as ``AsyncClient``)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 600.0,
        curve_dir: str | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        resume: bool = True,
    ) -> None:
        self.resume = resume
        self._zsock = connect(endpoint, curve_dir)
        self.sock = self._zsock.sock
        self.timeout_s = timeout_s
        self.ready_timeout = ready_timeout
        self.watch = ServerWatch()
        self._decoder: Decoder[Any] = Decoder(cm.ClientInbound)

    @property
    def welcome(self) -> cm.Welcome | None:
        return self.watch.welcome

    def __enter__(self) -> SyncClient:
        """Handshake, then wait until the runtime serves (as ``AsyncClient.hello``)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            self.sock.send(self.watch.hello())
            if self.watch.welcomed(self._recv()):
                return self
            if time.monotonic() >= deadline:
                raise self.watch.not_ready(self.ready_timeout)
            time.sleep(READY_POLL_S)

    def _reconnect(self) -> None:
        """Handshake with the front door's successor and wait until it serves."""
        lost_boot = self.watch.boot_id
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            self.sock.send(self.watch.hello())
            if not self.sock.poll(500):
                continue  # a hello sent to the dead one is lost: say it again
            msg = self._decoder.decode(self.sock.recv())
            if isinstance(msg, cm.Welcome) and msg.boot_id != lost_boot:
                if self.watch.welcomed(msg):
                    self.watch.last_rx = time.monotonic()
                    return
                time.sleep(READY_POLL_S)
        raise self.watch.not_ready(self.ready_timeout)

    def __exit__(self, *exc: Any) -> None:
        self._zsock.close(linger_ms=CLOSE_LINGER_MS)  # a cancel sent just before still goes out

    def _recv(self) -> Any:
        """The next message. While a request is open, ping the server every ``probe_s``; a
        server silent for ``dead_s`` (or one that restarted) fails it with ``actor_dead``."""
        watch = self.watch
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.sock.poll(int(watch.probe_s * 1000)):
                msg = self._decoder.decode(self.sock.recv())
                lost = watch.heard(msg, time.monotonic())
                if lost:
                    raise ConnectionLost(watch.lost(lost))
                if not isinstance(msg, Pong):
                    return msg
                continue
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no answer from the server in {self.timeout_s:.0f}s")
            lost = watch.silence(now)
            if lost:
                raise ConnectionLost(watch.lost(lost))
            if watch.open:
                try:
                    self.sock.send(watch.ping(), zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def stream(self, request: Generate | None = None, **kwargs: Any) -> Iterator[Any]:
        req = request or build_generate(**kwargs)
        if req.batch:  # one request at a time: nothing to batch, and no Batch frames to unpack
            req = msgspec.structs.replace(req, batch=False)
        self.sock.send(encode(req))
        self.watch.opened(time.monotonic())
        done = False
        received: list[int] = []  # what a resume continues after
        resumes, skip_accepted = 0, False
        try:
            while True:
                try:
                    msg = self._recv()
                except ConnectionLost:
                    if not self.resume or resumes >= MAX_RESUMES:
                        done = True
                        raise
                    resumes += 1
                    self._reconnect()
                    self.sock.send(encode(resumed(req, received)))
                    skip_accepted = True
                    continue
                if getattr(msg, "request_id", req.request_id) != req.request_id:
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
            if not done:
                self.sock.send(encode(Cancel(request_id=req.request_id)))

    def generate(self, request: Generate | None = None, **kwargs: Any) -> Result:
        req = request or build_generate(**kwargs)
        result = Result(req.request_id)
        for msg in self.stream(req):
            if result.apply(msg):
                break
        return result
