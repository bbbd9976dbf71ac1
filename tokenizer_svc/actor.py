"""The tokenizer service: the front door.

Clients connect a DEALER to the client endpoint (ROUTER). The service validates and tokenizes each
``Generate``, submits it to the scheduler, and streams ``Delta`` messages (incremental text, token
ids) back as the executor's ``TokenBatch`` events arrive, then one ``Final`` with finish reason,
usage and timings. Stop strings end a request here (and abort it upstream). A ``Cancel``, or a
client whose connection is gone (detected when a send to it fails; idle clients are probed), aborts
its requests.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from actors.runtime.transport import ZSocket
from messages import client as cm
from messages.codec import BadFrame, Decoder, encode
from messages.common import PROTOCOL_VERSION, ErrorCode, ErrorReply, Hello, Ping, Pong
from messages.scheduler import Abort, Completed, Submit
from messages.tokenizer import (
    Cancel,
    FromClient,
    Generate,
    RequestAdmitted,
    RequestFailed,
    TokenBatch,
    TokenEvent,
    TokenizerInbound,
)
from tokenizer_svc.detok import IncrementalDetokenizer
from tokenizer_svc.requests import Invalid, tokenize_request
from tokenizer_svc.stops import StopMatcher

PROBE_S = 0.5


@dataclass
class Live:
    request_id: str
    ident: bytes
    prompt_tokens: int
    detok: IncrementalDetokenizer
    stops: StopMatcher
    arrival: float
    want_logprobs: bool
    first_t: float = 0.0
    last_t: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    attempts: int = 0


@dataclass
class ClientConn:
    requests: set[str] = field(default_factory=set)
    pending: deque[bytes] = field(default_factory=deque)
    last_send: float = 0.0


class TokenizerService(Actor):
    name = "tokenizer"
    inbound = TokenizerInbound

    def __init__(self, cfg: RuntimeConfig) -> None:
        super().__init__(cfg)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        model_cfg = json.loads((Path(cfg.model) / "config.json").read_text())
        self.vocab_size = int(model_cfg["vocab_size"])
        self.max_model_len = int(model_cfg.get("max_position_embeddings", 2048))
        self.model_name = Path(cfg.model).name
        self.client_decoder: Decoder[Any] = Decoder(FromClient)
        self.client_sock: ZSocket | None = None
        self.live: dict[str, Live] = {}
        self.clients: dict[bytes, ClientConn] = {}
        self._client_flush = trio.Event()

    def open(self) -> None:
        super().open()
        self.client_sock = self.socket(zmq.ROUTER, bind=self.cfg.endpoints.client)

    def close(self) -> None:
        if self.client_sock is not None:
            self.client_sock.close()
        super().close()

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._client_loop)
        nursery.start_soon(self._probe_loop)
        nursery.start_soon(self._client_flusher)

    # ------------------------------------------------------------ client side
    async def _client_loop(self) -> None:
        assert self.client_sock is not None
        while True:
            frames = await self.client_sock.recv()
            ident = frames[0]
            if len(frames) != 2:
                self._to_client(
                    ident,
                    ErrorReply(code=ErrorCode.BAD_FRAME, message="expected one payload frame"),
                )
                continue
            try:
                msg = self.client_decoder.decode(frames[1])
            except BadFrame as e:
                self.log.warning("protocol.error", reason=str(e), field=e.field, socket="client")
                self._to_client(
                    ident, ErrorReply(code=ErrorCode.BAD_FRAME, message=str(e), field=e.field)
                )
                continue
            try:
                self._on_client(ident, msg)
            except Exception as e:  # never die of one request
                self.log.exception("actor.handler_error", message_type=type(msg).__name__)
                self._to_client(ident, ErrorReply(code=ErrorCode.INTERNAL, message=str(e)))
            await trio.sleep(0)

    def _on_client(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            ok = msg.version == PROTOCOL_VERSION
            reason = (
                ""
                if ok
                else (
                    f"protocol version {msg.version} not supported; "
                    f"this server speaks {PROTOCOL_VERSION}"
                )
            )
            if not ok:
                self.log.warning(
                    "protocol.error", reason=reason, code=ErrorCode.VERSION, socket="client"
                )
            self._to_client(
                ident,
                cm.Welcome(
                    version=PROTOCOL_VERSION,
                    model=self.model_name,
                    max_model_len=self.max_model_len,
                    boot_id=self.boot_id,
                    ok=ok,
                    reason=reason,
                ),
            )
        elif isinstance(msg, Ping):
            self._to_client(
                ident, Pong(actor=self.name, nonce=msg.nonce, pid=os.getpid(), boot_id=self.boot_id)
            )
        elif isinstance(msg, Generate):
            self._on_generate(ident, msg)
        elif isinstance(msg, Cancel):
            self._abort(msg.request_id, "cancel", notify_client=True)

    def on_peer_dead(self, name: str, reason: str) -> None:
        for req in list(self.live.values()):
            self._fail(req, ErrorCode.ACTOR_DEAD, f"{reason}; request aborted")

    def _fail(self, req: Live, code: str, message: str, field: str | None = None) -> None:
        """End the request with an error to its client and the terminal ``request.failed`` event."""
        self._forget(req)  # first: a failed send aborts the client's live requests
        self.log.info("request.failed", request_id=req.request_id, code=code, reason=message)
        self._to_client(
            req.ident,
            ErrorReply(
                code=ErrorCode(code), message=message, request_id=req.request_id, field=field
            ),
        )

    def _on_generate(self, ident: bytes, msg: Generate) -> None:
        rid = msg.request_id or uuid.uuid4().hex
        if self.down:
            self._to_client(
                ident,
                ErrorReply(
                    code=ErrorCode.ACTOR_DEAD,
                    request_id=rid,
                    message=f"{', '.join(sorted(self.down))} down; retry when it is back",
                ),
            )
            return
        if rid in self.live:
            self._to_client(
                ident,
                ErrorReply(
                    code=ErrorCode.INVALID,
                    request_id=rid,
                    field="request_id",
                    message="request_id: already in use",
                ),
            )
            return
        self.log.info(
            "request.received",
            request_id=rid,
            kind="prompt"
            if msg.prompt is not None
            else "messages"
            if msg.messages is not None
            else "prompt_ids",
        )
        try:
            ids = tokenize_request(msg, self.tokenizer, self.vocab_size, self.max_model_len)
        except Invalid as e:
            self.log.info(
                "request.rejected", request_id=rid, code=e.code, field=e.field, reason=e.reason
            )
            self._to_client(
                ident,
                ErrorReply(code=ErrorCode(e.code), request_id=rid, field=e.field, message=str(e)),
            )
            return
        now = time.monotonic()
        self.live[rid] = Live(
            rid,
            ident,
            len(ids),
            IncrementalDetokenizer(self.tokenizer),
            StopMatcher(msg.stop),
            now,
            msg.params.logprobs is not None,
        )
        self.clients.setdefault(ident, ClientConn()).requests.add(rid)
        self._to_client(ident, cm.Accepted(request_id=rid, prompt_tokens=len(ids)))
        self.send(
            "scheduler",
            Submit(request_id=rid, prompt_ids=ids, params=msg.params, arrival=time.time()),
        )

    def _abort(self, rid: str, reason: str, notify_client: bool) -> None:
        req = self.live.get(rid)
        if req is None:
            return
        self.log.info("request.aborted", request_id=rid, reason=reason)
        self.send("scheduler", Abort(request_id=rid, reason=reason))
        self._finish(req, "abort", None, notify_client=notify_client)

    # ------------------------------------------------------------ actor side
    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            self._on_tokens(msg.events)
        elif isinstance(msg, RequestAdmitted):
            req = self.live.get(msg.request_id)
            if req is not None:
                req.cached_tokens = msg.cached_tokens
                req.queue_s = msg.queue_s
                req.attempts += 1
        elif isinstance(msg, RequestFailed):
            req = self.live.get(msg.request_id)
            if req is not None:
                self._fail(req, msg.code, msg.message, msg.field)

    def _on_tokens(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            req = self.live.get(ev.request_id)
            if req is None:
                continue  # aborted or already ended by a stop string
            if not req.first_t:
                req.first_t = now
            req.last_t = now
            req.completion_tokens += 1
            text, matched = req.stops.feed(req.detok.push(ev.token_id))
            if matched is None and ev.finish_reason is not None:
                more, matched = req.stops.feed(req.detok.flush())
                text += more if matched else more + req.stops.flush()
            delta = cm.Delta(request_id=req.request_id, text=text, token_ids=[ev.token_id])
            if req.want_logprobs and ev.logprob is not None:
                delta.logprobs = [ev.logprob]
                if ev.top_logprobs:
                    delta.top_logprobs = [[cm.TokenLogprob(t, lp) for t, lp in ev.top_logprobs]]
            self._to_client(req.ident, delta)
            if matched is not None:
                self.send("scheduler", Abort(request_id=req.request_id, reason="stop_string"))
                self._finish(req, "stop", matched)
            elif ev.finish_reason is not None:
                self._finish(req, ev.finish_reason, None)

    def _finish(
        self, req: Live, reason: str, stop_reason: str | None, notify_client: bool = True
    ) -> None:
        """End the request: ``Final`` to the client (unless it is gone), metrics to the scheduler,
        and the terminal ``request.completed`` event."""
        # Forget first: sending the Final may find the client gone, and that aborts its
        # remaining requests - this one must not be among them (it would end twice).
        self._forget(req)
        now = time.monotonic()
        n = req.completion_tokens
        timings = cm.Timings(
            queue_s=req.queue_s,
            ttft_s=(req.first_t - req.arrival) if req.first_t else 0.0,
            tpot_s=(req.last_t - req.first_t) / (n - 1) if n > 1 else 0.0,
            total_s=now - req.arrival,
        )
        usage = cm.Usage(
            prompt_tokens=req.prompt_tokens, completion_tokens=n, cached_tokens=req.cached_tokens
        )
        if notify_client:
            self._to_client(
                req.ident,
                cm.Final(
                    request_id=req.request_id,
                    finish_reason=reason,
                    usage=usage,
                    timings=timings,
                    stop_reason=stop_reason,
                    preemptions=max(0, req.attempts - 1),
                ),
            )
        self.send(
            "scheduler",
            Completed(
                request_id=req.request_id,
                finish_reason=reason,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=n,
                cached_tokens=req.cached_tokens,
                queue_s=timings.queue_s,
                ttft_s=timings.ttft_s,
                tpot_s=timings.tpot_s,
                e2e_s=timings.total_s,
            ),
        )
        self.log.info(
            "request.completed",
            request_id=req.request_id,
            finish_reason=reason,
            usage=msgspec.structs.asdict(usage),
            timings=msgspec.structs.asdict(timings),
        )

    def _forget(self, req: Live) -> None:
        self.live.pop(req.request_id, None)
        conn = self.clients.get(req.ident)
        if conn is not None:
            conn.requests.discard(req.request_id)

    # ------------------------------------------------------- sending to clients
    def _to_client(self, ident: bytes, msg: msgspec.Struct) -> None:
        conn = self.clients.get(ident)
        data = encode(msg)
        if conn is not None and conn.pending:
            conn.pending.append(data)
            return
        assert self.client_sock is not None
        try:
            sent = self.client_sock.send_nowait([ident, data])
        except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
            self._client_gone(ident)
            return
        if conn is not None:
            conn.last_send = time.monotonic()
            if not sent:
                conn.pending.append(data)
                self._client_flush.set()

    def _client_gone(self, ident: bytes) -> None:
        conn = self.clients.pop(ident, None)
        if conn is None:
            return
        self.log.info("client.disconnected", requests=len(conn.requests))
        for rid in list(conn.requests):
            self._abort(rid, "disconnect", notify_client=False)

    async def _client_flusher(self) -> None:
        assert self.client_sock is not None
        while True:
            await self._client_flush.wait()
            self._client_flush = trio.Event()
            while any(c.pending for c in self.clients.values()):
                for ident, conn in list(self.clients.items()):
                    while conn.pending:
                        try:
                            if not self.client_sock.send_nowait([ident, conn.pending[0]]):
                                break
                        except zmq.ZMQError:
                            self._client_gone(ident)
                            break
                        conn.pending.popleft()
                await trio.sleep(0.001)

    async def _probe_loop(self) -> None:
        """Detect clients that disconnected while their requests wait (nothing else is sent)."""
        while True:
            await trio.sleep(PROBE_S)
            now = time.monotonic()
            for ident, conn in list(self.clients.items()):
                if not conn.requests:
                    self.clients.pop(ident, None)
                elif now - conn.last_send >= PROBE_S:
                    self._to_client(ident, Pong(actor=self.name, boot_id=self.boot_id))
