"""The front door's side of resuming requests after a crash: losing an attempt and submitting the
request again once the runtime serves (the bookkeeping is ``tokenizer_svc.resume``'s; the
protocol is docs/protocol.md, *Crashes and resumes*). A mixin of ``TokenizerService``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from messages.common import ErrorCode
from messages.scheduler import Abort, LiveRequests
from tokenizer_svc.clients import ClientEndpoint
from tokenizer_svc.resume import Resume
from tokenizer_svc.streams import Stream


@dataclass(slots=True)
class Live:
    """A request in flight: whose it is (the client's ROUTER identity) and its output stream."""

    ident: bytes
    internal_id: str
    stream: Stream
    resume: Resume


class ResumingMixin:
    live: dict[str, Live]
    clients: ClientEndpoint
    log: Any

    if TYPE_CHECKING:  # provided by TokenizerService and the Actor base

        def send(self, peer: str, msg: Any) -> None: ...
        def is_ready(self) -> bool: ...
        def _fail(self, live: Live, code: str, message: str, field: str | None = None) -> None: ...

    # ------------------------------------------------------------ resuming
    def _lose(self, live: Live, reason: str) -> None:
        """The request's attempt died (or was refused while the runtime settles): abort the old
        id everywhere and pend the request under a new one (see ``tokenizer_svc.resume``)."""
        if live.resume.pending:
            return
        old = live.internal_id
        self.send("scheduler", Abort(request_id=old, reason="resume"))
        why = live.resume.lost(reason, trio.current_time())
        new = self.clients.rekey(live.ident, live.stream.request_id)
        if why or new is None:
            self._fail(live, ErrorCode.ACTOR_DEAD, why or f"{reason}; client gone")
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

    async def _resume_loop(self) -> None:
        """Submit the pending requests again once the runtime serves; fail those that waited
        too long."""
        while True:
            await trio.sleep(0.1)
            now = trio.current_time()
            ready = self.is_ready()
            for live in [lv for lv in self.live.values() if lv.resume.pending]:
                expired = live.resume.expired(now)
                if expired:
                    self._fail(live, ErrorCode.ACTOR_DEAD, expired)
                elif ready:
                    self.send(
                        "scheduler", live.resume.submit(live.internal_id, live.stream.token_ids)
                    )
