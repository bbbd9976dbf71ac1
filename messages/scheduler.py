"""What the scheduler accepts: new requests and aborts (tokenizer), KV answers (KV manager) and
request state changes (executor)."""

from __future__ import annotations

import msgspec

from messages.common import Hello, Msg, Ping, SamplingParams
from messages.kv import HeldBlocks


class Submit(Msg, tag="submit"):
    """Tokenizer -> scheduler: a validated, tokenized request to queue."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # wall-clock seconds when the tokenizer received it
    # A resumed request (its attempt died with an actor): the tokens it already generated and
    # the client already received. They follow ``prompt_ids`` in the next attempt (recompute),
    # count against ``params.max_tokens``, and seeded sampling resumes at their output index.
    output_ids: list[int] = []
    resumes: int = 0  # how many lost attempts (admitted, or streaming) were resumed
    resume_reason: str = ""  # set on every submission after a loss: why (the actor that died)
    # ``params.structured`` as the front door compiled it (llguidance's grammar, JSON text): the
    # executor builds its matcher from this, never from the client's constraint
    grammar: str = ""
    # the tenant's ``cache_salt`` (vLLM's field): requests share cached KV only with the same salt
    cache_salt: str = ""


class Abort(Msg, tag="abort"):
    """Tokenizer -> scheduler: stop this request wherever it is (cancel, disconnect, stop string)."""

    request_id: str
    reason: str = "abort"


class AdmitResult(Msg, tag="admit_result"):
    """KV manager -> scheduler: the answer to ``kv.Admit``."""

    request_id: str
    attempt: int
    ok: bool
    block_table: list[int] = []
    cached_tokens: int = 0
    evicted: list[int] = []
    reason: str = ""
    blocks_needed: int = 0
    blocks_free: int = 0
    blocks_evictable: int = 0
    fatal: bool = False  # the request can never fit (larger than the whole pool)
    in_use: int = 0  # blocks held by running requests after this decision (for metrics)
    num_blocks: int = 0
    # the disk tier's part of ``cached_tokens``: blocks of the table (in order, right after the
    # pool's cached prefix) whose KV the executor loads from the files ``load_keys`` first
    load_blocks: list[int] = []
    load_keys: list[str] = []
    # refused, but blocks pinned by disk-tier writes come back without a release: wait
    pinned: bool = False


class GrowthShortage(Msg, tag="shortage"):
    """KV manager -> scheduler: a running request needs a block for decode and none is left."""

    request_id: str
    attempt: int
    blocks_needed: int
    blocks_free: int
    blocks_evictable: int


class BlocksFreed(Msg, tag="freed"):
    """KV manager -> scheduler: blocks returned to the pool (finish or release); retry admission."""

    free: int
    evictable: int
    in_use: int = 0
    num_blocks: int = 0
    # False: not the answer to a finish/release, but blocks unpinned by a disk-tier write
    answer: bool = True
    disk_bytes: int = 0  # the disk tier's bytes now (for metrics)


class RequestDone(Msg, tag="done"):
    """Executor -> scheduler: a request left the executor.

    ``status``: finished (``finish_reason`` stop/length), aborted, preempted or error.
    ``kv_token_ids`` are the tokens whose KV was written (prompt + outputs except the last), so
    the KV manager can cache their full blocks. ``output_ids`` are all tokens generated in this
    attempt; ``spec_*`` count its speculative decoding (for the Prometheus counters)."""

    request_id: str
    attempt: int
    status: str
    kv_token_ids: list[int] = []
    output_ids: list[int] = []
    finish_reason: str | None = None
    message: str = ""
    field: str | None = None
    # speculative decoding in this attempt (vLLM V1's counters): steps that verified drafts,
    # drafts verified, drafts accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0


class PrefillDone(Msg, tag="prefill_done"):
    """Executor -> scheduler: the step in flight completes the request's prompt (sent when the
    step is planned, before its forward). The scheduler then has the KV manager cache the
    prompt's full blocks and admits requests it held back because they share that prompt's
    prefix: they reach the executor during that step and join a later one, after the forward
    has written the KV they share."""

    request_id: str
    attempt: int


class Completed(Msg, tag="completed"):
    """Tokenizer -> scheduler: a request ended (for metrics). Seconds for the timings."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0


class KVRebuilt(Msg, tag="kv_rebuilt"):
    """KV manager -> scheduler: a restarted KV manager rebuilt its pool from ``kv_rebuild`` and
    ``kv_holding`` (``ok``), so admission may go on; or could not (``reason``: the running
    requests must be resumed instead)."""

    ok: bool
    requests: int = 0
    in_use: int = 0
    free: int = 0
    num_blocks: int = 0
    reason: str = ""


class LiveRequests(Msg, tag="live_requests"):
    """Tokenizer -> scheduler, the answer to ``reconcile``: every request in flight at the front
    door (not pending a resume), as it would submit it again (``output_ids``: the tokens streamed
    so far)."""

    requests: list[Submit]


class RunningAttempt(msgspec.Struct, array_like=True):
    """One attempt in the executor: ``output_offset`` of its prompt's tokens are outputs of
    earlier attempts."""

    request_id: str
    attempt: int
    output_offset: int


class ExecutorHeld(Msg, tag="x_held"):
    """Executor -> scheduler, the answer to ``reconcile``: the attempts it runs (or compiles a
    grammar for), and the ``done`` it sent or held in the last seconds, which a dead scheduler
    may never have read."""

    running: list[RunningAttempt]
    ended: list[RequestDone]


class KVHeld(Msg, tag="kv_held"):
    """KV manager -> scheduler, the answer to ``reconcile``: every request that holds blocks."""

    allocations: list[HeldBlocks]


class MetricsQuery(Msg, tag="metrics"):
    """Anyone -> scheduler: answered on the same connection with ``MetricsText``."""


class MetricsText(Msg, tag="metrics_text"):
    """The scheduler's Prometheus metrics, text exposition format (``minirt:*`` and ``vllm:*``)."""

    text: str


SchedulerInbound = (
    Hello
    | Ping
    | Submit
    | Abort
    | AdmitResult
    | GrowthShortage
    | BlocksFreed
    | RequestDone
    | PrefillDone
    | Completed
    | MetricsQuery
    | KVRebuilt
)
