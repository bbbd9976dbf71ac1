"""TokenizerCore: the front door's decisions about a request's life, as a pure state machine.

From the moment a request passed validation (``requests.check_request``) to its end: its output
stream (``streams``: deltas, stop strings, timings), its admission and failures, its end
(``final`` to the client, ``completed`` to the scheduler, ``abort`` upstream when it ends here)
and its resumption when an attempt dies with another actor (``resume``). Inputs are calls with
the messages that arrived and the clock; what goes to the scheduler is the outbox
(``take_outbox``); what goes to a client goes through ``clients`` (``ClientEndpoint`` in the
actor: request ids scoped to a connection, batching, disconnects).

The front door actor (``actor.py``) drives it behind its sockets; the replay
(``minirt/replay/frontsim.py``) drives the same core with the recorded arrivals, its clients a
recorder of what each would have received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from messages import client as cm
from messages.common import ErrorCode, ErrorReply
from messages.scheduler import Abort, LiveRequests
from messages.tokenizer import RequestAdmitted, RequestFailed, TokenBatch
from tokenizer_svc.resume import Resume, already_ended
from tokenizer_svc.streams import Stream, completed


class Clients(Protocol):
    """What the core asks of the client side (``tokenizer_svc.clients.ClientEndpoint``)."""

    def send(self, ident: bytes, msg: msgspec.Struct) -> None: ...
    def close(self, ident: bytes, request_id: str) -> None: ...
    def rekey(self, ident: bytes, request_id: str) -> str | None: ...
    def batching(self) -> Any: ...  # a context manager: one frame per client per step


@dataclass(slots=True)
class Live:
    """A request in flight: whose it is (the client's ROUTER identity) and its output stream."""

    ident: bytes
    internal_id: str
    stream: Stream
    resume: Resume


class TokenizerCore:
    def __init__(self, clients: Clients, log: Any, eos_ids: set[int]) -> None:
        self.clients = clients
        self.log = log
        self.eos_ids = eos_ids
        self.live: dict[str, Live] = {}  # by runtime-wide id
        self.outbox: list[tuple[str, msgspec.Struct]] = []

    def send(self, peer: str, msg: msgspec.Struct) -> None:
        self.outbox.append((peer, msg))

    def take_outbox(self) -> list[tuple[str, msgspec.Struct]]:
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------ a request's start
    def start(
        self,
        ident: bytes,
        internal: str,
        stream: Stream,
        resume: Resume,
        resume_ids: list[int],
        held_for: list[str],
        now: float,
    ) -> Live:
        """Open a validated request's stream: ``accepted`` to the client, then ``submit`` to the
        scheduler, unless ``held_for`` names actors that are down (it waits, as a resumed
        request does, until the runtime serves). ``resume_ids``: the client resumes a stream
        its connection's predecessor lost (the tokens it already received)."""
        live = self.live[internal] = Live(ident, internal, stream, resume)
        r = stream.reading
        self.clients.send(
            ident,
            cm.Accepted(
                request_id=stream.request_id,
                prompt_tokens=stream.prompt_tokens,
                tool_parser=r.tool_parser,
                reasoning_parser=r.reasoning_parser,
                thinking=r.thinking,
            ),
        )
        if resume_ids:
            stream.prime(resume_ids)
            resume.resumes, resume.reason = 1, "tokenizer restarted"
            self.log.info("client.resumed", request_id=internal, output_tokens=len(resume_ids))
            ended = already_ended(resume_ids, resume.params, self.eos_ids)
            if ended is not None:  # everything was received but the final
                self.finish(live, ended, None, now)
                return live
        if held_for:
            resume.pending_since = now
            self.log.info("client.held", request_id=internal, waiting_for=held_for)
            return live
        self.send("scheduler", resume.submit(internal, stream.token_ids))
        return live

    # ------------------------------------------------------------ from the runtime
    def handle(self, msg: Any, now: float) -> bool:
        """A message from the scheduler or the executor; False if not one of theirs."""
        if isinstance(msg, TokenBatch):
            self.tokens(msg, now)
        elif isinstance(msg, RequestAdmitted):
            self.admitted(msg)
        elif isinstance(msg, RequestFailed):
            self.failed(msg, now)
        else:
            return False
        return True

    def tokens(self, msg: TokenBatch, now: float) -> None:
        """One executor step's tokens: a ``delta`` each, and the ends they make."""
        with self.clients.batching():  # one frame per client that takes batches
            for ps in msg.prompt:  # prompt logprobs: before the first token's delta
                live = self.live.get(ps.request_id)
                if live is not None and (scored := live.stream.scored(ps)) is not None:
                    self.clients.send(live.ident, scored)
            for p in msg.pooled:  # embeddings: before the (unshown) token's delta
                if (live := self.live.get(p.request_id)) is not None:
                    vector = cm.Embedding(request_id=live.stream.request_id, data=p.vector)
                    self.clients.send(live.ident, vector)
            for ev in msg.events:
                live = self.live.get(ev.request_id)
                if live is None:
                    continue  # aborted or already ended by a stop string
                if (scored := live.stream.scored(None)) is not None:
                    self.clients.send(live.ident, scored)
                delta, ending = live.stream.token(ev, now)
                live.resume.progressed = True
                self.clients.send(live.ident, delta)
                if ev.request_id not in self.live:
                    continue  # that send found the client gone, which aborted the request
                if ending is not None:
                    if ending.abort_upstream:
                        self.send(
                            "scheduler", Abort(request_id=live.internal_id, reason="stop_string")
                        )
                    self.finish(live, ending.finish_reason, ending.stop_reason, now)

    def admitted(self, msg: RequestAdmitted) -> None:
        live = self.live.get(msg.request_id)
        if live is not None:
            if msg.recomputed:
                live.stream.recomputed(msg.cached_tokens, msg.attempt)
                return
            live.stream.admitted(msg.cached_tokens, msg.queue_s, msg.attempt)
            live.resume.progressed = True

    def failed(self, msg: RequestFailed, now: float) -> None:
        live = self.live.get(msg.request_id)
        if live is not None and msg.code == ErrorCode.ACTOR_DEAD:
            self.lose(live, msg.message, now)  # an actor died or the runtime settles: resume
        elif live is not None:
            self.fail(live, msg.code, msg.message, msg.field)

    def peer_dead(self, name: str, reason: str, now: float) -> None:
        if name in ("kv_manager", "scheduler"):
            # nothing is lost: the executor keeps running; the KV manager's successor rebuilds
            # its pool, the scheduler's asks every peer what it holds (reconcile)
            return
        for live in list(self.live.values()):
            if live.internal_id in self.live:  # not ended meanwhile by its client's disconnect
                self.lose(live, reason, now)

    # ------------------------------------------------------------ endings
    def abort(self, live: Live, reason: str, now: float, notify_client: bool = True) -> None:
        """The client cancelled (``cancel``) or is gone (``disconnect``)."""
        self.log.info(
            "client.aborted",
            request_id=live.internal_id,
            client_request_id=live.stream.request_id,
            reason=reason,
        )
        self.send("scheduler", Abort(request_id=live.internal_id, reason=reason))
        self.finish(live, "abort", None, now, notify_client=notify_client)

    def clients_gone(self, internal_ids: list[str], now: float) -> None:
        for internal in internal_ids:
            live = self.live.get(internal)
            if live is not None:
                self.abort(live, "disconnect", now, notify_client=False)

    def _forget(self, live: Live) -> None:
        # First, before any send to the client: a send that finds the client gone aborts its
        # requests in flight, and this one must not be among them (it would end twice).
        self.live.pop(live.internal_id, None)
        self.clients.close(live.ident, live.stream.request_id)

    def fail(self, live: Live, code: str, message: str, field: str | None = None) -> None:
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
        reply = ErrorReply(code=ErrorCode(code), message=message, request_id=rid, field=field)
        self.clients.send(live.ident, reply)

    def finish(
        self,
        live: Live,
        reason: str,
        stop_reason: str | None,
        now: float,
        notify_client: bool = True,
    ) -> None:
        """End the request: ``Final`` to the client (unless it is gone), metrics to the scheduler,
        and the terminal ``client.completed`` event."""
        self._forget(live)
        final = live.stream.final(reason, stop_reason, now)
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

    # ------------------------------------------------------------ resuming
    def lose(self, live: Live, reason: str, now: float) -> None:
        """The request's attempt died (or was refused while the runtime settles): abort the old
        id everywhere and pend the request under a new one (see ``tokenizer_svc.resume``)."""
        if live.resume.pending:
            return
        old = live.internal_id
        self.send("scheduler", Abort(request_id=old, reason="resume"))
        why = live.resume.lost(reason, now)
        new = self.clients.rekey(live.ident, live.stream.request_id)
        if why or new is None:
            self.fail(live, ErrorCode.ACTOR_DEAD, why or f"{reason}; client gone")
            return
        del self.live[old]
        live.internal_id = new
        self.live[new] = live
        self.log.info(
            "tokenizer.resume_pending",
            request_id=new,
            previous_id=old,
            reason=reason,
            output_tokens=len(live.stream.token_ids),
            resumes=live.resume.resumes,
        )

    def resume_due(self, now: float, serving: bool) -> None:
        """Submit the pending requests again if the runtime serves; fail those that waited
        too long."""
        for live in [lv for lv in self.live.values() if lv.resume.pending]:
            expired = live.resume.expired(now)
            if expired:
                self.fail(live, ErrorCode.ACTOR_DEAD, expired)
            elif serving:
                self.send("scheduler", live.resume.submit(live.internal_id, live.stream.token_ids))

    def live_requests(self) -> LiveRequests:
        """Every request in flight (not pending a resume), as it would be submitted again: the
        answer to a (re)started scheduler's ``reconcile``."""
        reqs = [
            lv.resume.as_submit(lv.internal_id, lv.stream.token_ids)
            for lv in self.live.values()
            if not lv.resume.pending
        ]
        self.log.info("tokenizer.reconcile_answered", requests=len(reqs))
        return LiveRequests(requests=reqs)
