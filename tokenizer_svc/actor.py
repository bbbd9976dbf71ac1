"""The tokenizer service (the front door): its sockets and the dispatch of what arrives on them.

Clients connect a DEALER to the client endpoint (a ROUTER beside the actor's inbox). A ``Generate``
is validated and tokenized (``requests``), given a runtime-wide id scoped to its connection
(``clients``) and submitted to the scheduler; the executor's ``TokenBatch`` events become the
client's ``Delta`` messages and one ``Final`` (``streams``). Stop strings end a request here (and
abort it upstream). A ``Cancel`` or a client whose connection is gone aborts its requests.
The framing, handshake and error replies are the ``Actor`` base's, for both sockets. A request
whose attempt dies with another actor is resumed, token for token (``resuming``, ``resume``).

Over 300 lines: the one trust boundary, the socket shell of every client request's life (admit,
stream, stop, cancel, fail, resume); its pure parts are ``requests``, ``streams``, ``clients``
and ``resume``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from actors.runtime.liveness import State, host_id
from actors.runtime.transport import ZSocket
from messages import client as cm
from messages.codec import Decoder
from messages.common import PROTOCOL_VERSION, ErrorCode, ErrorReply, Hello, Pong, Reconcile
from messages.scheduler import Abort
from messages.tokenizer import (
    Cancel,
    FromClient,
    Generate,
    RequestAdmitted,
    RequestFailed,
    TokenBatch,
    TokenizerInbound,
)
from tokenizer_svc.clients import ClientEndpoint
from tokenizer_svc.requests import Invalid, Prompts, check_request
from tokenizer_svc.resume import Resume, already_ended, check_resume_ids
from tokenizer_svc.resuming import Live, ResumingMixin
from tokenizer_svc.streams import Stream, completed

SETTLE_EVERY = 1024  # client frames read, at most, before clients found gone are settled


class TokenizerService(ResumingMixin, Actor):
    name = "tokenizer"
    inbound = TokenizerInbound

    def __init__(self, cfg: RuntimeConfig) -> None:
        super().__init__(cfg)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        model_cfg = json.loads((Path(cfg.model) / "config.json").read_text())
        self.vocab_size = int(model_cfg["vocab_size"])
        self.max_model_len = int(
            cfg.max_model_len or model_cfg.get("max_position_embeddings", 2048)
        )
        eos = model_cfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.model_name = cfg.http.served_model_name or Path(cfg.model).name
        self.client_decoder: Decoder[Any] = Decoder(FromClient)
        self.client_sock: ZSocket | None = None
        self.clients = ClientEndpoint(
            self._send_to_client, self._clients_gone, self.boot_id, self.log, self._wake_reader
        )
        self.live: dict[str, Live] = {}  # by runtime-wide id
        self.prompts = Prompts()

    def open(self) -> None:
        super().open()
        self.client_sock = self.socket(zmq.ROUTER, bind=self.cfg.endpoints.client)

    def close(self) -> None:
        if self.client_sock is not None:
            self.client_sock.close()
        super().close()

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._client_loop)
        nursery.start_soon(self._resume_loop)
        nursery.start_soon(self.clients.outbox.run)
        nursery.start_soon(self.clients.probe_loop, Pong(actor=self.name, boot_id=self.boot_id))

    def _send_to_client(self, ident: bytes, data: bytes) -> bool:
        assert self.client_sock is not None
        return self.client_sock.send_nowait([ident, data])

    # ------------------------------------------------------------ readiness
    def waiting_for(self) -> list[str]:
        """What keeps the runtime from serving: peers not heard from, suspect (silent: slow or
        stopped; requests wait for them) or down, a scheduler that does not admit yet."""
        suspect = self.liveness.suspect
        missing = [
            f"{p} (suspect: silent {suspect[p]:.1f}s)" if p in suspect else p
            for p in self.liveness.peers
            if self.liveness.state(p) is not State.ALIVE
        ]
        scheduler_up = self.liveness.state("scheduler") is State.ALIVE
        if scheduler_up and not self.peer_ready.get("scheduler", False):
            missing.append("scheduler (not admitting yet)")
        return missing

    def is_ready(self) -> bool:
        return not self.waiting_for()

    # ------------------------------------------------------------ client side
    async def _client_loop(self) -> None:
        """Read every frame that waits (yielding between them), then settle the clients found
        gone meanwhile: a cancel a client sent before it went is handled as a cancel."""
        sock = self.client_sock
        assert sock is not None
        while True:
            await sock.wait_readable()
            # bounded: the ROUTER reads its peers in turn, so a gone client's frames still waiting
            # come up within one read per connection; a socket never empty still settles
            for _ in range(SETTLE_EVERY):
                frames = sock.recv_nowait()
                if frames is None:
                    break
                self.dispatch(
                    frames,
                    self.client_decoder,
                    self.clients.send,
                    self._welcome,
                    self._on_client,
                    socket="client",
                )
                await trio.sleep(0)
            self.clients.settle()

    def _wake_reader(self) -> None:
        if self.client_sock is not None:
            self.client_sock.wake()

    def _welcome(self, ident: bytes, msg: Hello) -> None:
        refusal = self.version_refusal(msg, socket="client")
        waiting = self.waiting_for()
        self.clients.send(
            ident,
            cm.Welcome(
                version=PROTOCOL_VERSION,
                model=self.model_name,
                max_model_len=self.max_model_len,
                boot_id=self.boot_id,
                ok=not refusal,
                ready=not waiting,
                reason=refusal or (f"waiting for {', '.join(waiting)}" if waiting else ""),
                pid=os.getpid(),
                host=host_id(),
            ),
        )

    def _on_client(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, Generate):
            self._on_generate(ident, msg)
        elif isinstance(msg, Cancel):
            # only the client's own requests: another client's ids are not even visible
            live = self.live.get(self.clients.lookup(ident, msg.request_id) or "")
            if live is not None:
                self._abort(live, "cancel", notify_client=True)
            else:
                self.log.info("client.cancel_ignored", client_request_id=msg.request_id)

    def _on_generate(self, ident: bytes, msg: Generate) -> None:
        rid = msg.request_id or uuid.uuid4().hex
        internal = self.clients.open(ident, rid, msg.batch)
        if internal is None:
            self._refuse(ident, rid, ErrorCode.INVALID, "request_id: already in use", "request_id")
            return
        kind = (
            "prompt"
            if msg.prompt is not None
            else "messages"
            if msg.messages is not None
            else "prompt_ids"
        )
        self.log.info(
            "client.received",
            request_id=internal,
            client_request_id=rid,
            client=self.clients.label(ident),
            kind=kind,
        )
        try:
            self._admit(ident, internal, rid, msg)
        finally:
            if internal not in self.live:  # refused (or a bug): the id is free again
                self.clients.close(ident, rid)

    def _admit(self, ident: bytes, internal: str, rid: str, msg: Generate) -> None:
        """Validate, tokenize and compile the constraint, once for the whole runtime (the
        scheduler and the executor trust what passes); then open the stream and submit, or
        refuse naming the field."""
        try:
            checked = check_request(
                msg, self.tokenizer, self.vocab_size, self.max_model_len, self.prompts
            )
        except Invalid as e:
            self.log.info(
                "client.rejected",
                request_id=internal,
                client_request_id=rid,
                code=e.code,
                field=e.field,
                reason=e.reason,
            )
            self._refuse(ident, rid, ErrorCode(e.code), str(e), e.field)
            return
        ids, params = checked.ids, checked.params
        why = check_resume_ids(msg.resume_ids, params, self.vocab_size)
        if why:
            self._refuse(ident, rid, ErrorCode.INVALID, f"resume_ids: {why}", "resume_ids")
            return
        stream = Stream(
            rid,
            self.tokenizer,
            len(ids),
            msg.stop,
            trio.current_time(),
            want_logprobs=params.logprobs is not None,
            min_tokens=params.min_tokens,
        )
        resume = Resume(ids, params, time.time(), grammar=checked.grammar)
        live = self.live[internal] = Live(ident, internal, stream, resume)
        self.clients.send(ident, cm.Accepted(request_id=rid, prompt_tokens=len(ids)))
        if msg.resume_ids:  # the client resumes a stream its connection's predecessor lost
            stream.prime(msg.resume_ids)
            resume.resumes, resume.reason = 1, "tokenizer restarted"
            self.log.info("client.resumed", request_id=internal, output_tokens=len(msg.resume_ids))
            ended = already_ended(msg.resume_ids, params, self.eos_ids)
            if ended is not None:  # everything was received but the final
                self._finish(live, ended, None)
                return
        if self.down:  # a peer died and is being restarted: the request waits, as a resumed
            # one does, and is submitted once the runtime serves (or fails after the resume
            # window, tokenizer_svc/resume.py)
            resume.pending_since = trio.current_time()
            self.log.info("client.held", request_id=internal, waiting_for=sorted(self.down))
            return
        self.send("scheduler", resume.submit(internal, stream.token_ids))

    def _refuse(
        self, ident: bytes, rid: str, code: ErrorCode, message: str, field: str | None = None
    ) -> None:
        self.clients.send(
            ident, ErrorReply(code=code, message=message, request_id=rid, field=field)
        )

    def _clients_gone(self, internal_ids: list[str]) -> None:
        for internal in internal_ids:
            live = self.live.get(internal)
            if live is not None:
                self._abort(live, "disconnect", notify_client=False)

    # ------------------------------------------------------------ actor side
    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            now = trio.current_time()
            with self.clients.batching():  # one frame per client that takes batches
                for ev in msg.events:
                    live = self.live.get(ev.request_id)
                    if live is None:
                        continue  # aborted or already ended by a stop string
                    delta, ending = live.stream.token(ev, now)
                    live.resume.progressed = True
                    self.clients.send(live.ident, delta)
                    if ev.request_id not in self.live:
                        continue  # that send found the client gone, which aborted the request
                    if ending is not None:
                        if ending.abort_upstream:
                            self.send(
                                "scheduler",
                                Abort(request_id=live.internal_id, reason="stop_string"),
                            )
                        self._finish(live, ending.finish_reason, ending.stop_reason)
        elif isinstance(msg, RequestAdmitted):
            live = self.live.get(msg.request_id)
            if live is not None:
                live.stream.admitted(msg.cached_tokens, msg.queue_s)
                live.resume.progressed = True
        elif isinstance(msg, RequestFailed):
            live = self.live.get(msg.request_id)
            if live is not None and msg.code == ErrorCode.ACTOR_DEAD:
                self._lose(live, msg.message)  # an actor died or the runtime settles: resume
            elif live is not None:
                self._fail(live, msg.code, msg.message, msg.field)
        elif isinstance(msg, Reconcile):
            self.reply(ident, self.live_requests())

    def on_peer_dead(self, name: str, reason: str) -> None:
        if name in ("kv_manager", "scheduler"):
            # nothing is lost: the executor keeps running; the KV manager's successor rebuilds
            # its pool, the scheduler's asks every peer what it holds (reconcile)
            return
        for live in list(self.live.values()):
            if live.internal_id in self.live:  # not ended meanwhile by its client's disconnect
                self._lose(live, reason)

    # ------------------------------------------------------------ endings
    def _forget(self, live: Live) -> None:
        # First, before any send to the client: a send that finds the client gone aborts its
        # requests in flight, and this one must not be among them (it would end twice).
        self.live.pop(live.internal_id, None)
        self.clients.close(live.ident, live.stream.request_id)

    def _abort(self, live: Live, reason: str, notify_client: bool) -> None:
        self.log.info(
            "client.aborted",
            request_id=live.internal_id,
            client_request_id=live.stream.request_id,
            reason=reason,
        )
        self.send("scheduler", Abort(request_id=live.internal_id, reason=reason))
        self._finish(live, "abort", None, notify_client=notify_client)

    def _fail(self, live: Live, code: str, message: str, field: str | None = None) -> None:
        """End the request with an error to its client and the terminal ``client.failed`` event."""
        self._forget(live)
        rid = live.stream.request_id
        self.log.info(
            "client.failed",
            request_id=live.internal_id,
            client_request_id=rid,
            code=code,
            reason=message,
        )
        self._refuse(live.ident, rid, ErrorCode(code), message, field)

    def _finish(
        self, live: Live, reason: str, stop_reason: str | None, notify_client: bool = True
    ) -> None:
        """End the request: ``Final`` to the client (unless it is gone), metrics to the scheduler,
        and the terminal ``client.completed`` event."""
        self._forget(live)
        final = live.stream.final(reason, stop_reason, trio.current_time())
        if notify_client:
            self.clients.send(live.ident, final)
        self.send("scheduler", completed(live.internal_id, final))
        self.log.info(
            "client.completed",
            request_id=live.internal_id,
            client_request_id=final.request_id,
            finish_reason=reason,
            usage=msgspec.structs.asdict(final.usage),
            timings=msgspec.structs.asdict(final.timings),
        )
