"""Request state as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from messages.common import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # in the queue
    ADMITTING = "admitting"  # asked the KV manager for blocks, no answer yet
    RUNNING = "running"  # in the executor
    PREEMPTING = "preempting"  # told the executor to stop it; will be requeued
    STOPPING = "stopping"  # told the executor to abort it
    DONE = "done"

    @property
    def is_live(self) -> bool:
        return self is not Status.DONE

    @property
    def holds_blocks(self) -> bool:
        return self in (Status.RUNNING, Status.PREEMPTING, Status.STOPPING)


@dataclass
class SchedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # wall clock, from the tokenizer
    enqueued: float  # scheduler clock when (re)queued
    seq: int  # arrival order
    status: Status = Status.WAITING
    attempt: int = 0
    admitted_seq: int = 0  # order of the latest admission (for the newest-first victim policy)
    output_ids: list[int] = field(default_factory=list)  # generated in earlier attempts
    block_table: list[int] = field(default_factory=list)  # as admitted (for a KV rebuild)
    preemptions: int = 0
    yield_to_priority: bool = False  # preempted by priority: requeue by policy, not first
    abort_reason: str | None = None  # set when an abort arrives while an answer is pending
    queue_s: float = 0.0
    grammar: str = ""  # params.structured as the front door compiled it (Submit.grammar)
    cache_salt: str = ""  # Submit.cache_salt: shares cached KV only with this salt

    @property
    def priority(self) -> int:
        return self.params.priority

    def tokens_now(self) -> list[int]:
        """The prompt of the next attempt: original prompt plus what earlier attempts generated."""
        return self.prompt_ids + self.output_ids

    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
