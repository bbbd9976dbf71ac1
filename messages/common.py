"""Wire basics shared by every receiver: the protocol version, handshake, health and errors.

Every message is a ``msgspec.Struct`` tagged with a short ``t`` field and encoded as msgpack.
Each receiver has one tagged union (see the per-receiver modules) and decodes every frame with
a typed decoder for it, so a frame of the wrong shape is rejected before any actor code sees it.
"""

from __future__ import annotations

import enum

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


class Pong(Msg, tag="pong"):
    actor: str
    nonce: int = 0
    pid: int = 0
    boot_id: str = ""  # changes when the actor restarts
    ready: bool = True  # false while the actor settles after a (re)start


class ErrorReply(Msg, tag="error"):
    """A refusal. ``field`` names the offending field when there is one."""

    code: ErrorCode
    message: str
    request_id: str | None = None
    field: str | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling settings, as sent by clients and forwarded to the executor.

    ``temperature`` 0 means greedy. ``top_k`` 0 and ``top_p`` 1 disable those filters.
    ``logprobs``: None for none, 0 for the sampled token's logprob, n <= 20 for top-n too.
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


MAX_LOGPROBS = 20


def validate_params(p: SamplingParams) -> tuple[str, str] | None:
    """Return ``(field, reason)`` for the first invalid field of ``p``, or None if all are valid."""
    checks: list[tuple[bool, str, str]] = [
        (p.max_tokens >= 1, "max_tokens", f"must be >= 1, got {p.max_tokens}"),
        (
            p.temperature == p.temperature and 0.0 <= p.temperature <= 100.0,
            "temperature",
            f"must be a number in [0, 100], got {p.temperature}",
        ),
        (p.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {p.top_k}"),
        (
            p.top_p == p.top_p and 0.0 < p.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {p.top_p}",
        ),
        (
            p.min_p == p.min_p and 0.0 <= p.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {p.min_p}",
        ),
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
            all(t >= 0 for t in p.stop_token_ids),
            "stop_token_ids",
            "token ids must be >= 0",
        ),
    ]
    for ok, field, reason in checks:
        if not ok:
            return field, reason
    return None
