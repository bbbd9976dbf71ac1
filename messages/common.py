"""Wire basics shared by every receiver: the protocol version, handshake, health and errors.

Every message is a ``msgspec.Struct`` tagged with a short ``t`` field and encoded as msgpack.
Each receiver has one tagged union (see the per-receiver modules) and decodes every frame with
a typed decoder for it, so a frame of the wrong shape is rejected before any actor code sees it.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 1


class Msg(msgspec.Struct, tag_field="t", omit_defaults=True, forbid_unknown_fields=True):
    """Base of every wire message; the subclass's ``tag`` names it on the wire."""


class ErrorCode(enum.StrEnum):
    """Why a request or frame was refused; clients switch on these strings."""

    BAD_FRAME = "bad_frame"  # not msgpack, or not a message this receiver accepts
    INVALID = "invalid"  # a field has a bad value; ``field`` names it
    VERSION = "version_mismatch"
    OVERLOADED = "overloaded"
    TOO_LONG = "too_long"  # prompt longer than the model's context or the KV pool
    ACTOR_DEAD = "actor_dead"
    INTERNAL = "internal"


class Hello(Msg, tag="hello"):
    """First message on every connection: who is speaking and which protocol it speaks."""

    actor: str
    version: int
    pid: int = 0


class HelloAck(Msg, tag="hello_ack"):
    """Answer to ``Hello``: ``ok`` false with ``reason`` on a version mismatch."""

    actor: str
    version: int
    ok: bool = True
    reason: str = ""


class Ping(Msg, tag="ping"):
    """Liveness probe; the receiver answers ``Pong`` on the same connection."""

    nonce: int = 0


class Reconcile(Msg, tag="reconcile"):
    """Scheduler -> tokenizer, executor, KV manager, once at its start: answered on the same
    connection with what the receiver holds (``live_requests``, ``x_held``, ``kv_held``), from
    which a restarted scheduler rebuilds its state (empty at a first start)."""


class Pong(Msg, tag="pong"):
    actor: str
    nonce: int = 0
    pid: int = 0
    boot_id: str = ""  # changes when the actor restarts
    ready: bool = True  # false while the actor settles after a (re)start
    host: str = ""  # actors.runtime.liveness.host_id(): a peer with the same one watches its pid
    busy_ms: float = 0.0  # the longest it recently could not answer: event-loop lag, a step


class ErrorReply(Msg, tag="error"):
    """A refusal. ``field`` names the offending field when there is one."""

    code: ErrorCode
    message: str
    request_id: str | None = None
    field: str | None = None


class StructuredOutput(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Constrained decoding: the answer must match exactly one of ``json_schema`` (a JSON
    Schema, as a map), ``json_object`` (true: any JSON object), ``regex``, ``choice`` (one of
    these strings, verbatim) or ``grammar`` (a context-free grammar: GBNF ``root ::= ...`` or
    Lark). ``whitespace`` (JSON kinds only): ``compact`` (none between tokens, ``,`` and ``:``),
    ``spaces`` (``, `` and ``: ``, as Python's ``json.dumps``) or ``flexible`` (any JSON
    whitespace, at most ``MAX_FLEXIBLE_WHITESPACE`` characters at each place)."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace: Literal["compact", "spaces", "flexible"] = "compact"

    def kinds(self) -> list[str]:
        """The constraint kinds set (valid: exactly one)."""
        set_ = {
            "json_schema": self.json_schema is not None,
            "json_object": self.json_object,
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
        }
        return [k for k, on in set_.items() if on]


MAX_FLEXIBLE_WHITESPACE = 4
MAX_STRUCTURED_BYTES = 256 * 1024  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 1024


def validate_structured(s: StructuredOutput) -> tuple[str, str] | None:
    """``(field, reason)`` (field relative to ``structured``) for a malformed constraint, or
    None. Whether the engine can compile it is checked where the tokenizer is known."""
    kinds = s.kinds()
    if len(kinds) != 1:
        return "structured", f"exactly one of {_KINDS} must be set (got {kinds or 'none'})"
    kind = kinds[0]
    field = f"structured.{kind}"
    if kind == "choice":
        choice = s.choice or []
        if not choice or len(choice) > MAX_CHOICES or any(not c for c in choice):
            return field, f"must be 1 to {MAX_CHOICES} non-empty strings"
        size = sum(len(c.encode()) for c in choice)
    elif kind == "json_object":
        size = 0
    else:
        text = getattr(s, kind)
        if kind == "json_schema":
            try:
                text = canonical_json(text)
            except (TypeError, ValueError) as e:
                return field, f"not a JSON value: {e}"
        if not text and kind == "regex":
            return field, "must not be empty"
        size = len(text.encode())
    if size > MAX_STRUCTURED_BYTES:
        return field, f"{size} bytes; at most {MAX_STRUCTURED_BYTES}"
    if s.whitespace != "compact" and kind not in ("json_schema", "json_object"):
        return "structured.whitespace", "applies to json_schema and json_object only"
    return None


_KINDS = "json_schema, json_object, regex, choice, grammar"


def canonical_json(value: Any) -> str:
    """One text per JSON value (compact; key order kept: it is the order of the output); raises TypeError/ValueError for what
    JSON cannot hold (bytes, non-string keys, NaN)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class LoraRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A LoRA adapter as the front door checked it (``actors/shared/lora.py``): its name, its
    PEFT directory, ``digest`` (of its files: what the executor's cache and the prefix cache key
    it by), its rank and the scale of its product (``lora_alpha / r``, or ``/ sqrt(r)`` with
    rsLoRA)."""

    name: str
    path: str
    digest: str
    rank: int
    scaling: float


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling settings, as sent by clients and forwarded to the executor.

    ``temperature`` 0 means greedy. ``top_k`` 0 and ``top_p`` 1 disable those filters.
    ``logprobs``: None for none, 0 for the sampled token's logprob, n <= 20 for top-n too.
    The penalties, ``logit_bias`` and ``min_tokens`` change the raw logits before temperature
    and the filters (in that order: bias, min_tokens, repetition, frequency/presence):
    ``frequency_penalty``/``presence_penalty`` subtract ``f * count + p * (count > 0)`` for tokens
    generated so far (OpenAI); ``repetition_penalty`` divides positive and multiplies negative
    logits of tokens in the prompt or the output (transformers/vLLM); ``min_tokens`` forbids EOS
    and ``stop_token_ids`` until that many tokens were generated. Their defaults do nothing.
    ``structured`` constrains the answer (``StructuredOutput``); its token mask applies first,
    before all of the above. ``allowed_token_ids`` and ``bad_words`` (vLLM's) mask tokens out
    before the bias: every id but the allowed ones; a bad word's last token wherever the output
    ends with the rest of it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    # vLLM's: only these ids may be sampled (empty: any)
    allowed_token_ids: list[int] = []
    # vLLM's: words never generated, as text; the front door tokenizes them into bad_words_ids
    bad_words: list[str] = []
    # token sequences never generated: a sequence's last token is banned wherever the output so
    # far ends with the rest of it (a one-token sequence: everywhere)
    bad_words_ids: list[list[int]] = []
    # vLLM's: each prompt token's logprob (and this many top ones) from the prefill; the
    # request's prompt is then computed whole, not taken from the prefix cache
    prompt_logprobs: int | None = None
    # an embedding (a server started with --runner pooling): the prompt's final hidden states
    # pooled, "last" (its last token's) or "mean" (the mean over its tokens, computed whole, not
    # from the prefix cache), L2-normalized when ``normalize``; the request ends with its prefill
    pooling: str | None = None
    normalize: bool = True
    # the LoRA adapter the request runs with (None: the base model); set by the front door from
    # ``Generate.lora``, never by a client
    lora: LoraRef | None = None


MAX_LOGPROBS = 20
POOLING = (None, "last", "mean")  # SamplingParams.pooling: vLLM's LAST and MEAN pooling types
MAX_BAD_WORDS = 256
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0


def _in(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def validate_params(p: SamplingParams, vocab_size: int | None = None) -> tuple[str, str] | None:
    """Return ``(field, reason)`` for the first invalid field of ``p``, or None if all are valid.

    With ``vocab_size``, token ids (``stop_token_ids``, ``logit_bias`` keys) must lie below it.
    """
    vocab = vocab_size if vocab_size is not None else 2**63
    bias = p.logit_bias
    bad_bias_id = next((t for t in bias if not 0 <= t < vocab), None)
    bad_bias = next((v for v in bias.values() if not _in(v, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)), None)
    checks: list[tuple[bool, str, str]] = [
        (p.max_tokens >= 1, "max_tokens", f"must be >= 1, got {p.max_tokens}"),
        (
            _in(p.temperature, 0.0, 100.0),
            "temperature",
            f"must be a number in [0, 100], got {p.temperature}",
        ),
        (p.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {p.top_k}"),
        (
            _in(p.top_p, 0.0, 1.0) and p.top_p > 0.0,
            "top_p",
            f"must be in (0, 1], got {p.top_p}",
        ),
        (_in(p.min_p, 0.0, 1.0), "min_p", f"must be in [0, 1], got {p.min_p}"),
        (
            p.seed is None or 0 <= p.seed < 2**63,
            "seed",
            f"must be in [0, 2**63), got {p.seed}",
        ),
        (
            p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {p.logprobs}",
        ),
        (
            p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}",
        ),
        (
            p.pooling in POOLING,
            "pooling",
            f"must be one of {', '.join(x for x in POOLING if x)} or absent, got {p.pooling!r}",
        ),
        (
            all(0 <= t < vocab for t in p.stop_token_ids),
            "stop_token_ids",
            "token ids must be >= 0"
            + (f" and below the vocabulary size {vocab_size}" if vocab_size else ""),
        ),
        (
            _in(p.presence_penalty, -MAX_PENALTY, MAX_PENALTY),
            "presence_penalty",
            f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {p.presence_penalty}",
        ),
        (
            _in(p.frequency_penalty, -MAX_PENALTY, MAX_PENALTY),
            "frequency_penalty",
            f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {p.frequency_penalty}",
        ),
        (
            math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be a finite number > 0 (1 disables), got {p.repetition_penalty}",
        ),
        (
            bad_bias_id is None,
            "logit_bias",
            f"token id {bad_bias_id} outside the vocabulary"
            + (f" [0, {vocab_size})" if vocab_size else " (ids are >= 0)"),
        ),
        (
            bad_bias is None,
            "logit_bias",
            f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad_bias}",
        ),
        (
            0 <= p.min_tokens <= p.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}",
        ),
    ]
    for ok, field, reason in checks:
        if not ok:
            return field, reason
    outside = " outside the vocabulary" + (
        f" [0, {vocab_size})" if vocab_size else " (ids are >= 0)"
    )
    for name, ids in (
        ("allowed_token_ids", p.allowed_token_ids),
        ("bad_words_ids", [t for seq in p.bad_words_ids for t in seq]),
    ):
        out = next((t for t in ids if not 0 <= t < vocab), None)
        if out is not None:
            return name, f"token id {out}{outside}"
    if len(p.bad_words) + len(p.bad_words_ids) > MAX_BAD_WORDS:
        return "bad_words", f"at most {MAX_BAD_WORDS} words"
    if any(not w.strip() for w in p.bad_words) or any(not s for s in p.bad_words_ids):
        return "bad_words", "words must not be empty"
    if p.structured is not None:
        return validate_structured(p.structured)
    return None
