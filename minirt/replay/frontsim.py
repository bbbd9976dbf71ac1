"""The front door in a replay: the real ``TokenizerCore`` (``tokenizer_svc/core.py``: streams,
ends, timings, the events the real service logs) driven with the recorded workload. What is
replayed rather than run: the arrivals (a request reaches the core as validated, and its
``Submit`` reaches the scheduler as long after arrival as it did in the recorded run), the
cancels, and the stop strings (the tokens stand for recorded ones and have no text, so a stop
string ends a request after as many tokens as it did then). Its clients record what each would
have received, in the shape ``minirt bench serve`` records a request."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from messages import client as cm
from messages.common import ErrorReply, SamplingParams
from messages.scheduler import Completed, Submit
from messages.tokenizer import (
    TokenEvent,
    client_request_id,
)
from minirt.replay.loop import Loop
from minirt.replay.workload import RequestSpec
from tokenizer_svc.core import TokenizerCore
from tokenizer_svc.resume import Resume
from tokenizer_svc.streams import Ending, Stream


class RecordedStream(Stream):
    """A stream without text whose recorded stop string ends it after ``stop_after`` tokens."""

    def __init__(self, spec: RequestSpec, prompt_tokens: int, arrival: float) -> None:
        super().__init__(client_request_id(spec.rid), None, prompt_tokens, [], arrival)
        self.stop_after = spec.stop_after

    def token(self, ev: TokenEvent, now: float) -> tuple[cm.Delta, Ending | None]:
        delta, ending = super().token(ev, now)
        if self.stop_after is not None and self.completion_tokens >= self.stop_after:
            ending = Ending("stop", "(recorded)", abort_upstream=True)
        return delta, ending


class _Received:
    """What one request's client received: the time of each token, and how it ended."""

    __slots__ = ("end", "error", "reason", "times")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.end: float | None = None
        self.reason = ""
        self.error = ""


class SimClients:
    """One connection per request (its identity is the request id); nothing is resumed."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.got: dict[bytes, _Received] = {}

    def send(self, ident: bytes, msg: msgspec.Struct) -> None:
        got = self.got[ident]
        if isinstance(msg, cm.Delta):
            got.times.extend(self.loop.now for _ in msg.token_ids)
        elif isinstance(msg, cm.Final):
            got.end, got.reason = self.loop.now, msg.finish_reason
        elif isinstance(msg, ErrorReply):
            got.end, got.error = self.loop.now, f"{msg.code}: {msg.message}"

    def close(self, ident: bytes, request_id: str) -> None:
        pass

    def rekey(self, ident: bytes, request_id: str) -> str | None:
        return None  # a replay has no crashes to resume from

    @contextmanager
    def batching(self) -> Iterator[None]:
        yield


class SimTokenizer:
    name = "tokenizer"

    def __init__(
        self,
        loop: Loop,
        rec: Any,
        specs: list[RequestSpec],
        prompt_of: Callable[[RequestSpec], list[int]],
        client_s: float = 0.0,
    ) -> None:
        self.loop = loop
        self.rec = rec
        self.specs = specs
        self.prompt_of = prompt_of
        self.client_s = client_s  # records are as a client sees them: this much later
        self.clients = SimClients(loop)
        self.core = TokenizerCore(self.clients, rec, set())
        self.streams: dict[str, Stream] = {}
        self.delay: dict[str, float] = {}  # request id -> its recorded submit delay

    def start(self) -> None:
        for spec in self.specs:
            self.loop.at(spec.received, self._arrive, spec)

    def _arrive(self, spec: RequestSpec) -> None:
        rid, now = spec.rid, self.loop.now
        self.rec.record(
            "client.received", request_id=rid, client_request_id=client_request_id(rid),
            kind="prompt_ids",
        )  # fmt: skip
        ids = self.prompt_of(spec)
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, priority=spec.priority)
        stream = self.streams[rid] = RecordedStream(spec, len(ids), now)
        self.clients.got[rid.encode()] = _Received()
        self.delay[rid] = spec.submit_delay
        resume = Resume(ids, params, self.rec.t0 + now)
        self.core.start(rid.encode(), rid, stream, resume, [], [], now)
        self._flush()
        if spec.cancel_after_s is not None:
            self.loop.at(now + spec.cancel_after_s, self._cancel, rid, spec.cancel_reason)

    def _cancel(self, rid: str, reason: str) -> None:
        live = self.core.live.get(rid)
        if live is not None:
            self.core.abort(live, reason, self.loop.now)
            self._flush()

    def _flush(self) -> None:
        for peer, msg in self.core.take_outbox():
            if isinstance(msg, Completed):
                continue  # the scheduler actor's metrics, not its core: not replayed
            delay = self.delay.get(msg.request_id) if isinstance(msg, Submit) else None
            self.loop.send(peer, msg, delay)

    def handle(self, msg: Any) -> None:
        self.core.handle(msg, self.loop.now)
        self._flush()

    def record(self, spec: RequestSpec) -> dict[str, Any]:
        """The request as ``minirt bench serve`` records it (times in seconds from the start)."""
        got, stream = self.clients.got[spec.rid.encode()], self.streams[spec.rid]
        t = got.times
        end = got.end if got.end is not None else self.loop.now
        c = self.client_s
        return {
            "request_id": spec.rid,
            "tags": list(spec.tags),
            "prompt_tokens": spec.prompt_tokens,
            "completion_tokens": len(t),
            "cached_tokens": stream.cached_tokens,
            "finish_reason": got.reason,
            "error": got.error or ("" if got.end is not None else "unfinished: the replay ended"),
            "sent_s": spec.received,
            "queue_s": stream.queue_s,
            "ttft_s": (t[0] - spec.received + c) if t else None,
            "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "e2e_s": end - spec.received + c,
            "itl_s": [b - a for a, b in itertools.pairwise(t)],
            "preemptions": max(0, stream.attempts - 1),
            "token_times_s": [x + c for x in t] if c else t,
        }

    def records(self) -> list[dict[str, Any]]:
        return [self.record(s) for s in self.specs if s.rid in self.streams]
