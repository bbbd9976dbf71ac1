"""What a client receives from the tokenizer service (the replies on its DEALER socket)."""

from __future__ import annotations

import msgspec

from messages.common import ErrorReply, HelloAck, Msg, Pong


class Welcome(Msg, tag="welcome"):
    """Answer to a client's ``Hello``: the server's version and what it serves.

    ``ok`` false refuses the connection (version mismatch, ``reason`` says why). ``ready`` false
    means the runtime does not serve yet (an actor is missing or restarting, or the scheduler is
    not admitting); ``reason`` names what it waits for. A client sends ``hello`` again (or
    ``ping``: the ``pong`` carries ``ready`` too) until it is ready. ``boot_id`` changes when the
    service restarts (the Python clients then resume their requests in flight, sending
    ``Generate.resume_ids``)."""

    version: int
    model: str
    max_model_len: int
    boot_id: str = ""
    ok: bool = True
    ready: bool = True
    reason: str = ""
    pid: int = 0  # the front door's process, and where it runs (actors.runtime.liveness.host_id):
    host: str = ""  # a client on the same host tells a slow front door from a dead one by its pid


class Accepted(Msg, tag="accepted"):
    """The request passed validation and was queued; ``prompt_tokens`` is its tokenized length.
    How to read its output (chat): ``tool_parser`` names the tool-call format to parse ("": no
    tools asked for), ``reasoning_parser`` the reasoning format ("": none), ``thinking``: the
    prompt ended inside a reasoning block (the output starts in it)."""

    request_id: str
    prompt_tokens: int
    tool_parser: str = ""
    reasoning_parser: str = ""
    thinking: bool = False


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class Delta(Msg, tag="delta"):
    """Newly generated text and token ids of one request (streamed as they are produced)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None


class PromptLogprobs(Msg, tag="prompt_logprobs"):
    """The prompt's tokens scored by the prefill (``params.prompt_logprobs``), sent once, before
    the request's first ``delta``: per prompt token its logprob (the first token's is null),
    its rank (1: the most likely; null first) and the most likely tokens (``[]`` first)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[list[TokenLogprob]] = []


class Embedding(Msg, tag="embedding"):
    """The request's embedding (``params.pooling``), sent once, before its ``final``: float32
    values, little-endian, in ``data``'s bytes (``len(data) // 4`` of them)."""

    request_id: str
    data: bytes


class LoraInfo(msgspec.Struct, array_like=True):
    """A LoRA adapter the server serves: its name (a request's ``lora``, an HTTP ``model``), its
    PEFT directory and rank."""

    name: str
    path: str
    rank: int


class LoraList(Msg, tag="loras"):
    """Answer to a ``lora`` message: the adapters served after it."""

    request_id: str
    adapters: list[LoraInfo]


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(msgspec.Struct, omit_defaults=True):
    """Seconds: queue = waiting for admission, ttft = arrival to first token, tpot = mean time per
    output token after the first, total = arrival to finish."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    total_s: float = 0.0


class Final(Msg, tag="final"):
    """The last message of a request. ``finish_reason``: ``stop`` (EOS, a stop token or a stop
    string: ``stop_reason`` names the string), ``length`` (``max_tokens``) or ``abort`` (the client's
    ``cancel``). A request that fails ends with an ``error`` instead."""

    request_id: str
    finish_reason: str
    usage: Usage
    timings: Timings
    stop_reason: str | None = None  # the stop string that ended it
    preemptions: int = 0


class Batch(Msg, tag="batch"):
    """Several messages for one connection in one frame, in the order they were produced: what
    one executor step made for that connection's requests (their ``delta``s, and the ``final``
    of each that ended). Sent only for requests that asked (``Generate.batch``), and only when
    a step has two or more messages for the connection."""

    items: list[PromptLogprobs | Embedding | Delta | Final]


ClientInbound = (
    Welcome
    | Accepted
    | PromptLogprobs
    | Embedding
    | Delta
    | Final
    | Batch
    | LoraList
    | ErrorReply
    | Pong
    | HelloAck
)
