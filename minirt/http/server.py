"""What every route of the HTTP server shares: the ``Server`` (model, front-door connection,
actors' endpoints, limits) and the steps each request goes through (its body read within the
limits, its front-door id made unique while it runs)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from minirt.http.errors import ApiError, from_validation, invalid
from minirt.http.metrics import HttpMetrics
from minirt.http.model import ModelInfo
from minirt.http.upstream import Upstream

MAX_BODY = 32 * 1024 * 1024
B = TypeVar("B", bound=BaseModel)


@dataclass
class Server:
    """What the handlers share: the model, the front-door connection, the actors' endpoints."""

    model: ModelInfo
    upstream: Upstream
    endpoints: dict[str, str]
    log: Any
    curve: Any = None
    api_key: str = ""
    runtime_metrics: Callable[[], Awaitable[bytes]] | None = None
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    active: set[str] = field(default_factory=set)
    run_dir: str = ""  # the event log the dashboard shows (none: no dashboard)
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (else 408)
    responses_max_count: int = 1000  # stored /v1/responses (under run_dir/responses) kept
    responses_max_bytes: int = 64 * 1024 * 1024
    runner: str = "generate"  # --runner: pooling answers /v1/embeddings and nothing else
    pooler: tuple[str, bool] = ("last", True)  # --pooler-config: the pooling type, normalized


async def read_body(request: Request, model: type[B], timeout_s: float) -> B:
    """The request's JSON body as ``model``; 413 as soon as it is known to be over ``MAX_BODY``
    (its ``Content-Length``, else the bytes read so far): never buffered whole; 408 when it
    has not all arrived within ``timeout_s`` (a client trickling bytes holds nothing long)."""
    too_big = ApiError(413, f"request body over {MAX_BODY} bytes")
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise invalid("content-length", "the Content-Length header is not a number") from None
    if declared > MAX_BODY:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s) as late:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise too_big
            chunks.append(chunk)
    if late.cancelled_caught:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", code="timeout")
    raw = b"".join(chunks)
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise from_validation(e) from None


def unique_id(server: Server, rid: str) -> str:
    """The front-door id: the request id, unless another request in flight here uses it."""
    return rid if rid not in server.active else f"{rid}-{uuid.uuid4().hex[:8]}"


def in_flight(server: Server, base: str, response: Any) -> Any:
    """``response`` (an ASGI app) with ``base`` in the server's front-door ids in flight while
    it runs (``unique_id``)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        server.active.add(base)
        try:
            await response(scope, receive, send)
        finally:
            server.active.discard(base)

    return app
