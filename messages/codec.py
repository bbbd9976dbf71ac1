"""Encoding and typed decoding. One ``Decoder`` per receiving socket, typed with that receiver's union."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of ``msg`` (its tag included)."""
    return _encoder.encode(msg)


class BadFrame(ValueError):
    """A frame that is not a valid message for this receiver. ``field`` is the offending path."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Decoder(Generic[T]):
    """Decodes frames into the receiver's union ``T``; raises ``BadFrame`` naming the field."""

    def __init__(self, union: Any) -> None:
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes) -> T:
        try:
            return self._dec.decode(frame)  # type: ignore[no-any-return]
        except msgspec.ValidationError as e:
            text = str(e)
            field = None
            if "at `$." in text:
                field = text.split("at `$.", 1)[1].rstrip("`").split("`")[0]
            raise BadFrame(f"invalid message: {text}", field) from None
        except msgspec.DecodeError as e:
            raise BadFrame(f"not a msgpack message: {e}") from None
