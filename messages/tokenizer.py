"""What the tokenizer service accepts: client requests, plus events from the scheduler and executor.

Request ids are scoped to the client's connection: a client names its requests as it likes (two
clients may both use "1"), and the service gives each request a runtime-wide id,
``"<client's id>@<scope>"`` (``scope``: the service's boot id and a request counter), used between
the actors and in their events. Messages to a client carry the client's own id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from messages.common import Hello, Msg, Ping, Reconcile, SamplingParams

SCOPE_SEP = "@"


def scoped_request_id(request_id: str, scope: str) -> str:
    """The runtime-wide id of a client's ``request_id``; ``scope`` makes it unique."""
    return f"{request_id}{SCOPE_SEP}{scope}"


def client_request_id(request_id: str) -> str:
    """The client's own id inside a runtime-wide id (an unscoped id is returned as it is)."""
    head, sep, _ = request_id.rpartition(SCOPE_SEP)
    return head if sep else request_id


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call an assistant made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: str  # system | user | assistant | tool
    content: str
    tool_calls: list[ToolCall] = []  # an assistant's calls
    tool_call_id: str = ""  # a tool's answer: the call it answers
    reasoning: str = ""  # an assistant's earlier reasoning


class Tool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A function the model may call: rendered by the chat template; its ``parameters`` (a JSON
    Schema) constrain the arguments when a call is required."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class Generate(Msg, tag="generate"):
    """A client's request. Exactly one of ``prompt`` (text), ``messages`` (chat, rendered with the
    model's chat template) or ``prompt_ids`` (raw token ids) is set. ``request_id`` is optional
    (the service assigns one when it is empty) and scoped to the connection: it must be unique
    among the client's own requests in flight. ``stop`` are stop strings, matched on the text
    (not before ``params.min_tokens`` tokens)."""

    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_ids: list[int] | None = None
    request_id: str = ""
    stop: list[str] = []
    add_special_tokens: bool = True
    # Resuming a request after the service restarted: the token ids the client already received
    # (in order). The service continues after them: only new tokens are streamed.
    resume_ids: list[int] = []
    # No max_tokens of the client's own (OpenAI chat's default): the request may generate what the
    # context leaves after its prompt; ``params.max_tokens`` is replaced by that.
    fill_context: bool = False
    # The client takes a step's messages for this connection batched into one ``Batch`` frame
    # (the trio client does: one frame per step instead of one per token per stream).
    batch: bool = False
    # Tool calling (chat): the functions the template shows the model; ``tool_choice``: none |
    # auto (it may call) | required (it must: a grammar from the tools' schemas) | the name of
    # the one tool it must call. ``parallel_tool_calls``: more than one call allowed.
    tools: list[Tool] = []
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    # Extra variables for the chat template (e.g. ``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] = {}
    # vLLM's ``cache_salt``: cached KV (pool and disk) is shared only among requests with the
    # same salt, so one tenant cannot time another's prompts through the prefix cache
    cache_salt: str = ""
    # the LoRA adapter to run with, by name (vLLM's ``model`` of an adapter; "": the base model)
    lora: str = ""


class Lora(Msg, tag="lora"):
    """A client manages the server's LoRA adapters (``--enable-lora``): ``op`` load (read and
    check ``lora_path``, a PEFT directory, and serve it as ``lora_name``), unload (stop serving
    ``lora_name``; requests running with it finish) or list. Answered with ``LoraList`` (the
    adapters served afterwards) or an ``error`` naming the field, under ``request_id``."""

    request_id: str
    op: str  # load | unload | list
    lora_name: str = ""
    lora_path: str = ""


class Cancel(Msg, tag="cancel"):
    """A client abandons one of its own requests; the service aborts it everywhere and answers
    ``Final(abort)``. An id the client has no request in flight under is ignored."""

    request_id: str


class TokenEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """One generated token of one request, from one executor step."""

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


class PromptScores(msgspec.Struct, array_like=True, omit_defaults=True):
    """The logprobs of prompt tokens ``start``, ``start + 1``, ... of one request (``start`` >= 1:
    the first prompt token has none), from one prefill chunk: each token's logprob, its rank in
    its distribution (1: the most likely), and the ``prompt_logprobs`` most likely tokens."""

    request_id: str
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]] = []


class Pooled(msgspec.Struct, array_like=True):
    """The embedding of one request (``params.pooling``), from the step that completed its
    prefill: float32 values, little-endian, in ``vector``'s bytes."""

    request_id: str
    vector: bytes


class TokenBatch(Msg, tag="tokens"):
    """Executor -> tokenizer: the tokens one step produced, all requests at once; ``prompt``:
    the prompt logprobs its prefill chunks scored (requests with ``params.prompt_logprobs``);
    ``pooled``: the embeddings of the requests whose prefill it completed (``params.pooling``)."""

    events: list[TokenEvent]
    prompt: list[PromptScores] = []
    pooled: list[Pooled] = []


class RequestAdmitted(Msg, tag="admitted"):
    """Scheduler -> tokenizer: the request got its KV blocks (for usage and timings).
    ``recomputed`` (executor -> tokenizer): a correction: of the attempt's cached tokens only
    ``cached_tokens`` were usable (a disk-tier block file failed its check)."""

    request_id: str
    cached_tokens: int
    queue_s: float
    attempt: int = 0
    recomputed: bool = False


class RequestFailed(Msg, tag="failed"):
    """Scheduler -> tokenizer: the request ended without finishing normally."""

    request_id: str
    code: str
    message: str
    field: str | None = None


FromClient = Hello | Ping | Generate | Cancel | Lora
"""What the client endpoint accepts."""

TokenizerInbound = Hello | Ping | TokenBatch | RequestAdmitted | RequestFailed | Reconcile
"""What the tokenizer service's internal inbox accepts (from the scheduler and executor)."""
