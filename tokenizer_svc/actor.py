"""The tokenizer service (the front door): its sockets and the dispatch of what arrives on them.

Clients connect a DEALER to the client endpoint (a ROUTER beside the actor's inbox). A ``Generate``
is validated, tokenized and its constraint compiled (``requests``: the runtime's one trust
boundary), given a runtime-wide id scoped to its connection (``clients``) and handed to the core
(``core.TokenizerCore``), which decides the rest of its life: its stream, stop strings, ends and
resumes. The framing, handshake and error replies are the ``Actor`` base's, for both sockets.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import trio
import zmq

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from actors.runtime.liveness import State, host_id
from actors.runtime.transport import ZSocket
from actors.shared.lora import LoraError
from messages import client as cm
from messages.codec import Decoder
from messages.common import PROTOCOL_VERSION, ErrorCode, ErrorReply, Hello, Pong, Reconcile
from messages.tokenizer import (
    Cancel,
    FromClient,
    Generate,
    Lora,
    TokenizerInbound,
)
from tokenizer_svc.clients import ClientEndpoint
from tokenizer_svc.core import TokenizerCore
from tokenizer_svc.loras import Loras
from tokenizer_svc.requests import Invalid, Parsers, Prompts, check_request
from tokenizer_svc.resume import Resume, check_resume_ids
from tokenizer_svc.streams import Stream

SETTLE_EVERY = 1024  # client frames read, at most, before clients found gone are settled


class TokenizerActor(Actor):
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
        self.core = TokenizerCore(self.clients, self.log, self.eos_ids)
        self.live = self.core.live  # by runtime-wide id
        self.prompts = Prompts()
        self.parsers = Parsers(cfg.tool_call_parser, cfg.reasoning_parser)
        self.loras = Loras(cfg.lora, cfg.model, self.model_name)
        self.tasks: trio.Nursery  # start_tasks's: where adapter loads run

    def open(self) -> None:
        super().open()
        self.client_sock = self.socket(zmq.ROUTER, bind=self.cfg.endpoints.client)

    def close(self) -> None:
        if self.client_sock is not None:
            self.client_sock.close()
        super().close()

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        self.tasks = nursery
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
        elif isinstance(msg, Lora):
            self.tasks.start_soon(self._on_lora, ident, msg)
        elif isinstance(msg, Cancel):
            # only the client's own requests: another client's ids are not even visible
            live = self.live.get(self.clients.lookup(ident, msg.request_id) or "")
            if live is not None:
                self.core.abort(live, "cancel", trio.current_time())
                self._flush()
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
            **({"tools": len(msg.tools), "tool_choice": msg.tool_choice} if msg.tools else {}),
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
                msg,
                self.tokenizer,
                self.vocab_size,
                self.max_model_len,
                self.prompts,
                self.parsers,
                self.cfg.runner,
                self.loras,
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
        now = trio.current_time()
        stream = Stream(
            rid,
            self.tokenizer,
            len(ids),
            msg.stop,
            now,
            want_logprobs=params.logprobs is not None,
            min_tokens=params.min_tokens,
            scored_prompt=ids if params.prompt_logprobs is not None else None,
        )
        stream.reading = checked.reading
        salt = msg.cache_salt
        if params.prompt_logprobs is not None or params.pooling == "mean":
            salt = f"{salt}\x00whole:{internal}"  # its prompt computed whole: a salt of its own
        if params.lora is not None:  # an adapter's KV is its own: shared only under it
            salt = f"{salt}\x00lora:{params.lora.digest}"
        resume = Resume(ids, params, time.time(), grammar=checked.grammar, cache_salt=salt)
        # a peer died and is being restarted: the request waits, as a resumed one does, and is
        # submitted once the runtime serves (or fails after the resume window, resume.py)
        self.core.start(ident, internal, stream, resume, msg.resume_ids, sorted(self.down), now)
        self._flush()

    async def _on_lora(self, ident: bytes, msg: Lora) -> None:
        """Load, unload or list the adapters; the answer lists them afterwards."""
        try:
            if msg.op == "load":
                self.loras.check(msg.lora_name, msg.lora_path)
                ref = await trio.to_thread.run_sync(
                    self.loras.inspect, msg.lora_name, msg.lora_path
                )
                self.loras.add(ref)
                self.log.info(
                    "tokenizer.lora_added",
                    lora=ref.name,
                    path=ref.path,
                    rank=ref.rank,
                    digest=ref.digest,
                )
            elif msg.op == "unload":
                ref = self.loras.remove(msg.lora_name)
                self.log.info("tokenizer.lora_removed", lora=ref.name, digest=ref.digest)
            elif msg.op != "list":
                raise LoraError("op", f"{msg.op!r} is not load, unload or list")
        except LoraError as e:
            self.log.info(
                "tokenizer.lora_refused",
                op=msg.op,
                lora=msg.lora_name,
                field=e.field,
                reason=e.reason,
            )
            self._refuse(ident, msg.request_id, ErrorCode.INVALID, str(e), e.field)
            return
        self.clients.send(ident, cm.LoraList(msg.request_id, self.loras.listing()))

    def _refuse(
        self, ident: bytes, rid: str, code: ErrorCode, message: str, field: str | None = None
    ) -> None:
        self.clients.send(
            ident, ErrorReply(code=code, message=message, request_id=rid, field=field)
        )

    def _clients_gone(self, internal_ids: list[str]) -> None:
        self.core.clients_gone(internal_ids, trio.current_time())
        self._flush()

    def _flush(self) -> None:
        for peer, msg in self.core.take_outbox():
            self.send(peer, msg)

    # ------------------------------------------------------------ actor side
    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, Reconcile):
            self.reply(ident, self.core.live_requests())
        else:
            self.core.handle(msg, trio.current_time())
        self._flush()

    def on_peer_dead(self, name: str, reason: str) -> None:
        self.core.peer_dead(name, reason, trio.current_time())
        self._flush()

    async def _resume_loop(self) -> None:
        """Submit the pending requests again once the runtime serves; fail those that waited
        too long."""
        while True:
            await trio.sleep(0.1)
            self.core.resume_due(trio.current_time(), self.is_ready())
            self._flush()
