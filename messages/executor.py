"""What the executor accepts: admissions and block grants (scheduler, KV manager), preemption and aborts."""

from __future__ import annotations

from messages.common import Hello, Msg, Ping, Reconcile, SamplingParams


class Run(Msg, tag="x_run"):
    """Scheduler -> executor: the request holds ``block_table``; the first ``cached_tokens`` prompt
    tokens' KV is already in those blocks. ``output_offset`` counts tokens generated in earlier
    attempts: after a preemption ``prompt_ids`` ends with them, ``params`` are the original ones
    (``max_tokens`` counts all outputs) and seeded sampling resumes at output index
    ``output_offset``, so a preempted request gives the tokens it would have given anyway (the
    penalties and ``min_tokens`` count those ``output_offset`` tokens as generated ones).
    ``more``: the scheduler is admitting another request right behind this one, so an executor
    with nothing running waits for it (at most ``burst_wait_ms``) rather than start a step with
    this request alone."""

    request_id: str
    attempt: int
    prompt_ids: list[int]
    params: SamplingParams
    block_table: list[int]
    cached_tokens: int = 0
    output_offset: int = 0
    more: bool = False  # another admission is out: an idle executor waits for it (burst_wait_ms)
    grammar: str = ""  # ``Submit.grammar``: the front door's compiled constraint
    # ``AdmitResult.load_*``: part of ``cached_tokens`` is on disk; load these blocks first (a
    # file that fails its check is recomputed from its position instead)
    load_blocks: list[int] = []
    load_keys: list[str] = []


class Extend(Msg, tag="x_extend"):
    """KV -> executor: blocks appended to the request's block table (decode growth)."""

    request_id: str
    attempt: int
    blocks: list[int]


class DiskSave(Msg, tag="x_disk_save"):
    """KV -> executor: write these cached blocks to the disk tier as ``keys`` (the KV manager
    keeps them from being evicted until ``kv.DiskSaved`` answers ``save_id``)."""

    save_id: int
    blocks: list[int]
    keys: list[str]


class DiskDrop(Msg, tag="x_disk_drop"):
    """KV -> executor: delete these block files (the disk tier's LRU, within its byte bound)."""

    keys: list[str]


class Preempt(Msg, tag="x_preempt"):
    """Scheduler -> executor: stop the request now; answer ``RequestDone(status=preempted)``."""

    request_id: str
    attempt: int


class Stop(Msg, tag="x_stop"):
    """Scheduler -> executor: abort the request; answer ``RequestDone(status=aborted)``."""

    request_id: str
    attempt: int
    reason: str = "abort"


class Stats(Msg, tag="x_stats"):
    """Anyone -> executor: answered with ``ExecutorStats`` on the same connection."""


class ExecutorStats(Msg, tag="x_stats_reply"):
    """``structured_*``: the grammar cache's hits, misses and size (structured output)."""

    running: int
    steps: int
    num_blocks: int
    block_size: int
    max_model_len: int
    structured_hits: int = 0
    structured_misses: int = 0
    structured_cached: int = 0


ExecutorInbound = (
    Hello | Ping | Run | Extend | DiskSave | DiskDrop | Preempt | Stop | Stats | Reconcile
)
