"""OpenAI's error shape, and the translation of every refusal into it.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status that goes with it: 400 for
bad values (``param`` names the field as OpenAI spells it), 401 for a wrong key, 404 for an unknown
model or path, 429 (with ``Retry-After``) when the scheduler is overloaded, 503 when an actor is
down, 500 with a plain message for a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def param_of(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as OpenAI names a field: ``messages[1].content``.

    Union members and wrappers that pydantic adds to the location (``str``, ``list[int]``,
    ``function-after[...]``) are not fields and are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _NOT_FIELDS:
            out += f".{part}" if out else part
    return out


_NOT_FIELDS = {"str", "int", "float", "bool", "list", "dict", "none", "model"}


def from_validation(e: ValidationError) -> ApiError:
    """The first validation error, naming its field."""
    errors = e.errors(include_url=False)
    first = errors[0]
    param = param_of(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return invalid(param, f"{param}: field required")
    value = first.get("input")
    shown = repr(value) if isinstance(value, (int, float, str, bool)) or value is None else ""
    got = f", got {shown}" if shown else ""
    return invalid(param or None, f"{param or 'body'}: {first.get('msg', 'invalid')}{got}")


def from_upstream(
    code: str,
    field: str | None,
    message: str,
    prompt_param: str,
    structured: Callable[[str], str] | None = None,
    rename: Callable[[str], str] | None = None,
) -> ApiError:
    """A refusal from the front door (``minirt.client.RequestError``) in OpenAI's shape, its
    field named as the client spelled it: the prompt as ``prompt_param`` (``prompt[1]``,
    ``messages``), ``params.x`` as ``x``, the constraint's fields through ``structured``."""
    if code == "overloaded":
        return ApiError(429, message, code="overloaded")
    if code == "actor_dead":
        return ApiError(503, message, code="actor_dead")
    if code not in ("too_long", "invalid"):
        return ApiError(500, f"internal error: {message}", code="internal_error")
    name = field or ""
    reason = message.removeprefix(f"{name}: ") if name else message
    if code == "too_long":
        return invalid(prompt_param, reason, code="context_length_exceeded")
    if name == "lora":  # the model named no adapter served (--enable-lora)
        return ApiError(
            404, f"The model does not exist: {reason}", param="model", code="model_not_found"
        )
    if name.startswith("params.structured") and structured is not None:
        param = structured(name)
    else:
        param = _HTTP_NAMES.get(name, name.removeprefix("params."))
    if param in ("prompt", "prompt_ids", "messages"):
        param = prompt_param
    elif rename is not None and param:
        param = rename(param)
    return invalid(param or None, f"{param}: {reason}" if param else reason)


_HTTP_NAMES = {"params.logprobs": "logprobs", "stop": "stop"}
