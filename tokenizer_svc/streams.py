"""One request's output stream, from the executor's token events to the client's messages (pure:
no sockets, the clock is passed in).

Each ``TokenEvent`` becomes one ``Delta``: the token id, the text it completed (incremental
detokenization never splits a UTF-8 character), minus anything that might be the start of a stop
string (held back until the next token decides), plus its logprobs when they were asked for. A
stop string ends the stream (``stop``, the string as ``stop_reason``, the request aborted
upstream) unless fewer than the request's ``min_tokens`` tokens have been generated. On the last
token the held-back text is flushed. ``final`` gives the closing ``Final`` with usage and timings,
and ``completed`` the scheduler's metrics record of it. Without a tokenizer a stream carries
token ids only (no text, so no stop string can match): the replay's, whose tokens stand for
recorded ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from messages import client as cm
from messages.scheduler import Completed
from messages.tokenizer import PromptScores, TokenEvent
from tokenizer_svc.agent.tools import Reading
from tokenizer_svc.detok import IncrementalDetokenizer
from tokenizer_svc.stops import StopMatcher


@dataclass(frozen=True)
class Ending:
    """How a token ended its stream. ``abort_upstream``: a stop string ended it here, so the
    scheduler and executor must be told to stop generating."""

    finish_reason: str
    stop_reason: str | None = None
    abort_upstream: bool = False


class Stream:
    """The state of one request's output. ``request_id`` is the client's own id (what every
    message to the client carries)."""

    def __init__(
        self,
        request_id: str,
        tokenizer: Any,
        prompt_tokens: int,
        stops: list[str],
        arrival: float,
        want_logprobs: bool = False,
        min_tokens: int = 0,
        scored_prompt: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.want_logprobs = want_logprobs
        self.min_tokens = min_tokens
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopMatcher(stops)
        self.first_t = 0.0
        self.last_t = 0.0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.queue_s = 0.0
        self.attempts = 0
        self.attempt = 0  # the attempt last admitted
        self.fewer_cached: dict[int, int] = {}  # attempt -> cached tokens, as the executor found
        self.token_ids: list[int] = []  # every token streamed (what a resume continues after)
        self.reading = Reading()  # how the client reads the output (tools, reasoning)
        # prompt logprobs asked for: the prompt, and its tokens' scores as chunks bring them
        self.scored_prompt = scored_prompt
        self.scores: dict[int, tuple[float | None, int | None, list[tuple[int, float]]]] = {}
        self.scores_sent = False

    def scored(self, ps: PromptScores | None) -> cm.PromptLogprobs | None:
        """Fold in one chunk's prompt scores; the client's message once every prompt token
        past the first is scored (once: a recomputed attempt scores them again). ``None``: the
        first token came, send what there is (a one-token prompt has no score to wait for)."""
        prompt = self.scored_prompt
        if prompt is None or self.scores_sent:
            return None
        if ps is not None:
            for k, (lp, rank) in enumerate(zip(ps.logprobs, ps.ranks, strict=True)):
                top = ps.top_logprobs[k] if ps.top_logprobs else []
                self.scores[ps.start + k] = (lp, rank, top)
            if len(self.scores) < len(prompt) - 1:
                return None
        self.scores_sent = True
        rows = [self.scores.get(i, (None, None, [])) for i in range(1, len(prompt))]
        return cm.PromptLogprobs(
            request_id=self.request_id,
            token_ids=list(prompt),
            logprobs=[None, *(lp for lp, _, _ in rows)],
            ranks=[None, *(r for _, r, _ in rows)],
            top_logprobs=[[], *([cm.TokenLogprob(t, v) for t, v in top] for _, _, top in rows)],
        )

    def prime(self, token_ids: list[int]) -> None:
        """A resumed request: the client already received ``token_ids`` (and their text) from
        the front door's predecessor. Replay them through the detokenizer and the stop matcher
        without emitting, so the text of the next tokens continues exactly; text the matcher
        held back then was never sent, and comes out with the next tokens."""
        for t in token_ids:
            self.completion_tokens += 1
            self.token_ids.append(t)
            self.stops.feed(self._text(t), self.completion_tokens >= self.min_tokens)

    def _text(self, token_id: int) -> str:
        return self.detok.push(token_id) if self.detok is not None else ""

    def admitted(self, cached_tokens: int, queue_s: float, attempt: int = 0) -> None:
        """The scheduler admitted the request (again, after a preemption)."""
        self.cached_tokens = min(cached_tokens, self.fewer_cached.get(attempt, cached_tokens))
        self.queue_s = queue_s
        self.attempts += 1
        self.attempt = attempt

    def recomputed(self, cached_tokens: int, attempt: int) -> None:
        """The executor found fewer of the attempt's cached tokens usable (a bad block file of
        the disk tier: recomputed). Either message may arrive first."""
        self.fewer_cached[attempt] = cached_tokens
        if attempt == self.attempt:
            self.cached_tokens = min(self.cached_tokens, cached_tokens)

    def token(self, ev: TokenEvent, now: float) -> tuple[cm.Delta, Ending | None]:
        """The client's ``Delta`` for one generated token, and how it ended the stream (or None)."""
        if not self.first_t:
            self.first_t = now
        self.last_t = now
        self.completion_tokens += 1
        self.token_ids.append(ev.token_id)
        armed = self.completion_tokens >= self.min_tokens
        text, matched = self.stops.feed(self._text(ev.token_id), armed)
        if matched is None and ev.finish_reason is not None:
            more, matched = self.stops.feed(self.detok.flush() if self.detok else "", armed)
            text += more if matched else more + self.stops.flush()
        delta = cm.Delta(request_id=self.request_id, text=text, token_ids=[ev.token_id])
        if self.want_logprobs and ev.logprob is not None:
            delta.logprobs = [ev.logprob]
            if ev.top_logprobs:
                delta.top_logprobs = [[cm.TokenLogprob(t, lp) for t, lp in ev.top_logprobs]]
        ending = None
        if matched is not None:
            ending = Ending("stop", matched, abort_upstream=True)
        elif ev.finish_reason is not None:
            ending = Ending(ev.finish_reason)
        return delta, ending

    def final(self, finish_reason: str, stop_reason: str | None, now: float) -> cm.Final:
        """The stream's last message, with usage and timings (seconds since arrival)."""
        n = self.completion_tokens
        return cm.Final(
            request_id=self.request_id,
            finish_reason=finish_reason,
            usage=cm.Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=n,
                cached_tokens=self.cached_tokens,
            ),
            timings=cm.Timings(
                queue_s=self.queue_s,
                ttft_s=(self.first_t - self.arrival) if self.first_t else 0.0,
                tpot_s=(self.last_t - self.first_t) / (n - 1) if n > 1 else 0.0,
                total_s=now - self.arrival,
            ),
            stop_reason=stop_reason,
            preemptions=max(0, self.attempts - 1),
        )


def completed(internal_id: str, final: cm.Final) -> Completed:
    """The scheduler's record (for metrics) of a request that ended with ``final``."""
    return Completed(
        request_id=internal_id,
        finish_reason=final.finish_reason,
        prompt_tokens=final.usage.prompt_tokens,
        completion_tokens=final.usage.completion_tokens,
        cached_tokens=final.usage.cached_tokens,
        queue_s=final.timings.queue_s,
        ttft_s=final.timings.ttft_s,
        tpot_s=final.timings.tpot_s,
        e2e_s=final.timings.total_s,
    )
