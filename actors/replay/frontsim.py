"""The front door (tokenizer service), simulated: it replays the recorded arrivals (a
``Submit`` reaches the scheduler as long after arrival as it did in the recorded run), cancels
and stop strings, times every token like the real service (TTFT from its own arrival stamp) and
records the events the real service logs (``client.received``, ``client.completed``,
``client.aborted``, ``client.failed``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from actors.replay.loop import Loop
from actors.replay.workload import RequestSpec
from messages.common import SamplingParams
from messages.scheduler import Abort, Submit
from messages.tokenizer import RequestAdmitted, RequestFailed, TokenBatch, client_request_id


class _Live:
    __slots__ = (
        "attempts", "cached", "end", "error", "final", "queue_s", "reason", "spec", "times",
    )  # fmt: skip

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.times: list[float] = []
        self.cached = 0
        self.queue_s = 0.0
        self.attempts = 0
        self.end: float | None = None
        self.reason = ""
        self.error = ""
        self.final: dict[str, Any] | None = None  # the record, once it ended


class SimFrontDoor:
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
        self.state: dict[str, _Live] = {}
        self.live: set[str] = set()

    def start(self) -> None:
        for spec in self.specs:
            self.loop.at(spec.received, self._arrive, spec)

    def _arrive(self, spec: RequestSpec) -> None:
        rid = spec.rid
        self.rec.record(
            "client.received", request_id=rid, client_request_id=client_request_id(rid),
            kind="prompt_ids",
        )  # fmt: skip
        self.state[rid] = _Live(spec)
        self.live.add(rid)
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, priority=spec.priority)
        submit = Submit(
            request_id=rid,
            prompt_ids=self.prompt_of(spec),
            params=params,
            arrival=self.rec.t0 + self.loop.now,
        )
        self.loop.send("scheduler", submit, spec.submit_delay)
        if spec.cancel_after_s is not None:
            self.loop.at(self.loop.now + spec.cancel_after_s, self._cancel, rid)

    def _cancel(self, rid: str) -> None:
        if rid not in self.live:
            return
        reason = self.state[rid].spec.cancel_reason
        self.rec.record(
            "client.aborted", request_id=rid, client_request_id=client_request_id(rid),
            reason=reason,
        )  # fmt: skip
        self.loop.send("scheduler", Abort(request_id=rid, reason=reason))
        self._finish(rid, "abort")

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            now = self.loop.now
            for ev in msg.events:
                rid = ev.request_id
                if rid not in self.live:
                    continue
                st = self.state[rid]
                st.times.append(now)
                if st.spec.stop_after is not None and len(st.times) >= st.spec.stop_after:
                    self.loop.send("scheduler", Abort(request_id=rid, reason="stop_string"))
                    self._finish(rid, "stop")
                elif ev.finish_reason is not None:
                    self._finish(rid, ev.finish_reason)
        elif isinstance(msg, RequestAdmitted):
            if msg.request_id in self.live:
                st = self.state[msg.request_id]
                st.cached, st.queue_s = msg.cached_tokens, msg.queue_s
                st.attempts += 1
        elif isinstance(msg, RequestFailed) and msg.request_id in self.live:
            st = self.state[msg.request_id]
            self.live.discard(msg.request_id)
            st.end, st.error = self.loop.now, f"{msg.code}: {msg.message}"
            self.rec.record(
                "client.failed",
                request_id=msg.request_id,
                client_request_id=client_request_id(msg.request_id),
                code=msg.code,
                reason=msg.message,
            )

    def _finish(self, rid: str, reason: str) -> None:
        self.live.discard(rid)
        st = self.state[rid]
        st.end, st.reason = self.loop.now, reason
        r = st.final = self.record(st)
        self.rec.record(
            "client.completed",
            request_id=rid,
            client_request_id=client_request_id(rid),
            finish_reason=reason,
            usage={
                "prompt_tokens": st.spec.prompt_tokens,
                "completion_tokens": r["completion_tokens"],
                "cached_tokens": st.cached,
            },
            timings={  # as the front door times them (the records are the client's view)
                "queue_s": st.queue_s,
                "ttft_s": (r["ttft_s"] - self.client_s) if r["ttft_s"] is not None else 0.0,
                "tpot_s": r["tpot_s"] or 0.0,
                "total_s": r["e2e_s"] - self.client_s,
            },
        )

    def record(self, st: _Live) -> dict[str, Any]:
        """The request as ``minirt bench serve`` records it (times in seconds from the start)."""
        t, s = st.times, st.spec
        end = st.end if st.end is not None else self.loop.now
        return {
            "request_id": s.rid,
            "tags": list(s.tags),
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": len(t),
            "cached_tokens": st.cached,
            "finish_reason": st.reason,
            "error": st.error or ("" if st.end is not None else "unfinished: the replay ended"),
            "sent_s": s.received,
            "queue_s": st.queue_s,
            "ttft_s": (t[0] - s.received + self.client_s) if t else None,
            "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "e2e_s": end - s.received + self.client_s,
            "itl_s": [b - a for a, b in itertools.pairwise(t)],
            "preemptions": max(0, st.attempts - 1),
            "token_times_s": [x + self.client_s for x in t] if self.client_s else t,
        }

    def records(self) -> list[dict[str, Any]]:
        out = []
        for s in self.specs:
            st = self.state.get(s.rid)
            if st is not None:
                out.append(st.final or self.record(st))
        return out
