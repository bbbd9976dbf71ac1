"""Request-level data of the executor: its error type, per-step outputs, in-flight state, and
the invariants a new request meets.

The executor trusts what it runs: the front door validated the client's request (its fields,
token ids and constraint) and the scheduler and KV manager made its block table. ``check_invariants``
asserts, cheaply, only what would corrupt the KV pool if a peer were wrong (the table holds the
prompt, the cached part is whole blocks); it never validates the client's fields again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from messages.common import SamplingParams
from messages.tokenizer import Pooled, PromptScores

if TYPE_CHECKING:
    from gpu.logits_processors import LogitsProcessors
    from gpu.spec.ngram import NgramTokens
    from gpu.spec.verify import SpecStats
    from gpu.step.budget import Costs
    from gpu.structured.masks import GrammarState


class ExecutorInputError(ValueError):
    """A request's input is invalid; ``request_id`` and ``field`` say which and where."""

    def __init__(self, request_id: str, field: str, reason: str) -> None:
        super().__init__(f"request {request_id!r}: invalid {field}: {reason}")
        self.request_id = request_id
        self.field = field
        self.reason = reason


@dataclass
class TokenOutput:
    """One request's progress in one step. Logprobs are of the model's raw distribution
    (log-softmax of the logits, before the grammar mask, penalties, bias, temperature and
    filters, as vLLM's default ``raw_logprobs``); ``top_logprobs`` is ``[]`` when
    ``logprobs == 0`` and None when logprobs were not asked for."""

    request_id: str
    token_id: int | None  # None: this step only advanced a non-final prefill chunk
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | None
    prefill_done: bool  # True on the step that produced the first output token
    num_prompt_tokens: int
    num_output_tokens: int  # outputs so far, this one included (and any before a preemption)


@dataclass
class StepResult:
    """What one ``ModelRunner.step`` did; ``forward_s`` covers the forward and sampling, ``step_s``
    the whole call (scheduling, input building, bookkeeping included), ``mask_s`` the grammar
    work of constrained rows (bitmask fill and application, matcher advance; within
    ``forward_s``). ``failed``: ``(request_id, field, reason)`` of requests that ended in
    error this step (a grammar that allowed no token); they have no output."""

    outputs: list[TokenOutput]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int
    skipped: list[str]  # requests whose block table had no room this step
    forward_s: float
    step_s: float
    mask_s: float = 0.0
    num_constrained: int = 0
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    decode_ctx: int = 0  # sum of the decodes' context lengths (keys their attention reads)
    prefill_ctx: int = 0  # sum over prefill chunks of chunk * (start + chunk)
    spec: SpecStats | None = None  # the step's speculation; None when speculation is off
    prefill_cap: int | None = None  # the adaptive budget's cap on prompt tokens (None: fixed)
    refit: Costs | None = None  # the adaptive budget's model, when this step refitted it
    prompt: list[PromptScores] = field(default_factory=list)  # prompt logprobs it scored
    pooled: list[Pooled] = field(default_factory=list)  # embeddings it completed
    loras: int = 0  # LoRA adapters its rows ran with


@dataclass
class RequestState:
    """One in-flight request as the executor tracks it (mutated by ModelRunner.step): the wire
    params, and the sampling state derived from them (resolved seed, stop ids, the logit
    processors' token counts and the grammar's matcher, each None when the request uses none).
    ``ngram``: its tokens for the draft proposer, None when it does not speculate."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    table: list[int]
    computed: int  # tokens whose K/V is in the cache
    seed: int
    stop: frozenset[int]
    prior: int = 0  # outputs generated before a preemption, at the end of ``prompt``
    out: list[int] = field(default_factory=list)
    procs: LogitsProcessors | None = None
    grammar: GrammarState | None = None
    ngram: NgramTokens | None = None
    pool: Any = None  # an embedding's sum of final hidden states so far (gpu/pooling.py)
    lora: Any = None  # its LoRA adapter's factors (gpu/lora/slots.py Adapter), None: the base


def check_invariants(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    table: list[int],
    num_cached_tokens: int,
    prior_output_tokens: int,
    *,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Raise ExecutorInputError naming ``request_id`` and the field a peer got wrong; pure."""

    def bad(fld: str, reason: str) -> ExecutorInputError:
        return ExecutorInputError(request_id, fld, reason)

    n = len(prompt)
    if n == 0:
        raise bad("prompt_ids", "empty prompt")
    if n >= max_model_len:
        raise bad("prompt_ids", f"{n} tokens; the model's max positions is {max_model_len}")
    if table and not (min(table) >= 0 and max(table) < num_blocks):
        raise bad("block_table", f"block ids must be in [0, {num_blocks})")
    if len(table) * block_size < n:
        raise bad("block_table", f"{len(table)} blocks of {block_size} cannot hold {n} tokens")
    if not (0 <= num_cached_tokens < n) or num_cached_tokens % block_size:
        raise bad(
            "num_cached_tokens",
            f"{num_cached_tokens} must be a multiple of {block_size} below {n}",
        )
    if not (0 <= prior_output_tokens < min(n, params.max_tokens)):
        raise bad(
            "prior_output_tokens",
            f"{prior_output_tokens} must be >= 0 and below len(prompt_ids) and max_tokens",
        )
