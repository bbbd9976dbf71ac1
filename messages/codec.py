"""Encoding and typed decoding. One ``Decoder`` per receiving socket, typed with that receiver's union."""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_lenient = msgspec.msgpack.Decoder()  # any msgpack value: to read a failed frame's request_id
_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]*)`")
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of ``msg`` (its tag included)."""
    return _encoder.encode(msg)


class BadFrame(ValueError):
    """A frame that is not a valid message for this receiver. ``field`` is the offending path
    (``params.top_p``, ``messages[0].role``, ``bogus``); ``request_id`` is the frame's
    ``request_id`` when it could be read, so the sender can tell which request failed."""

    def __init__(
        self, message: str, field: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.field = field
        self.request_id = request_id


def field_path(error: str) -> str | None:
    """The field a msgspec validation error is about: the path after ``at `$.``, with the name of
    an unknown or missing field appended (``params: {bogus: 1}`` -> ``params.bogus``)."""
    at = _AT.search(error)
    path = at.group(1) if at else ""
    named = _NAMED.search(error)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


def readable_request_id(frame: bytes) -> str | None:
    """The ``request_id`` of a frame that failed typed decoding, if it is a map holding a string one."""
    try:
        value = _lenient.decode(frame)
    except (msgspec.DecodeError, ValueError):
        return None
    rid = value.get("request_id") if isinstance(value, dict) else None
    return rid if isinstance(rid, str) and rid else None


class Decoder(Generic[T]):
    """Decodes frames into the receiver's union ``T``; raises ``BadFrame`` naming the field."""

    def __init__(self, union: Any) -> None:
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes) -> T:
        try:
            return self._dec.decode(frame)  # type: ignore[no-any-return]
        except msgspec.ValidationError as e:
            text = str(e)
            raise BadFrame(
                f"invalid message: {text}", field_path(text), readable_request_id(frame)
            ) from None
        except msgspec.DecodeError as e:
            raise BadFrame(f"not a msgpack message: {e}") from None
