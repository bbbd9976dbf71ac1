"""Resuming requests whose attempt died with an actor (pure: no sockets, the clock is passed in).

The front door is the one actor that sees every token a client received, so it holds what a
resume needs. When an actor other than itself dies (its own heartbeats say so, or the scheduler
fails a request with ``actor_dead``), every request in flight is *lost*: the front door aborts the
old runtime-wide id everywhere, gives the request a new one (so late messages of the old attempt
can never reach it), and keeps it *pending*. Once the runtime serves again (every peer alive, the
scheduler admitting), it submits it again with its prompt plus the tokens already streamed
(``Submit.output_ids``): the scheduler re-admits it as it would a preempted request and its
stream goes on where it stopped, each token exactly once.

A request is resumed at most ``MAX_RESUMES`` times (a resume counts only when the lost attempt
had been admitted or had produced tokens, so refusals while the runtime settles do not count),
and waits at most ``RESUME_TIMEOUT_S`` for the runtime to serve again; past either it fails with
``actor_dead`` and the reason. A client resuming after the front door itself restarted sends
``Generate.resume_ids`` (``check_resume_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.common import SamplingParams
from messages.scheduler import Submit

MAX_RESUMES = 5
RESUME_TIMEOUT_S = 60.0


@dataclass(slots=True)
class Resume:
    """What one request needs to be submitted again, and how often it was."""

    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # wall clock, kept across resumes
    grammar: str = ""  # params.structured as the front door compiled it (Submit.grammar)
    cache_salt: str = ""  # Generate.cache_salt
    resumes: int = 0
    progressed: bool = False  # admitted or streamed a token since it was last submitted
    pending_since: float | None = None  # trio clock; None while submitted
    reason: str = ""

    @property
    def pending(self) -> bool:
        return self.pending_since is not None

    def submit(self, request_id: str, output_ids: list[int]) -> Submit:
        """The ``Submit`` of the next attempt (``output_ids``: the tokens streamed so far)."""
        self.pending_since = None
        self.progressed = False
        return self.as_submit(request_id, output_ids)

    def as_submit(self, request_id: str, output_ids: list[int]) -> Submit:
        """The request as it would be submitted again now (no change)."""
        return Submit(
            request_id=request_id,
            prompt_ids=self.prompt_ids,
            params=self.params,
            arrival=self.arrival,
            output_ids=list(output_ids),
            resumes=self.resumes,
            resume_reason=self.reason,
            grammar=self.grammar,
            cache_salt=self.cache_salt,
        )

    def lost(self, reason: str, now: float) -> str:
        """The attempt in flight died: pend the request. Returns why it cannot be resumed
        (too many resumes), else ""."""
        if self.progressed or not self.reason:  # else a refusal while settling: keep the cause
            self.reason = reason
        if self.progressed:
            self.resumes += 1
        self.progressed = False
        self.pending_since = now
        if self.resumes > MAX_RESUMES:
            return f"{reason}; request resumed {MAX_RESUMES} times already, giving up"
        return ""

    def expired(self, now: float) -> str:
        """Why a pending request fails now (the runtime did not serve again in time), or ""."""
        if self.pending_since is not None and now - self.pending_since > RESUME_TIMEOUT_S:
            why = self.reason or "an actor was down"
            return f"{why}; could not resume within {RESUME_TIMEOUT_S:.0f}s"
        return ""


def check_resume_ids(ids: list[int], params: SamplingParams, vocab_size: int) -> str:
    """Why ``Generate.resume_ids`` are refused (the field is ``resume_ids``), or ""."""
    if any(not 0 <= t < vocab_size for t in ids):
        return f"token ids must be in [0, {vocab_size})"
    if len(ids) > params.max_tokens:
        return f"{len(ids)} tokens is more than max_tokens {params.max_tokens}"
    return ""


def already_ended(ids: list[int], params: SamplingParams, eos_ids: set[int]) -> str | None:
    """The finish reason of a resumed request whose received tokens already end it (its final was
    lost with the front door), else None."""
    if len(ids) >= params.max_tokens:
        return "length"
    if ids and len(ids) >= params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        if ids[-1] in stops:
            return "stop"
    return None
