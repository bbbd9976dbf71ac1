"""The ASGI middleware every HTTP request passes: its request id, the API key, the
``http.request`` / ``http.response`` events and metrics, and a plain 500 for a bug.

The request id is ``X-Request-Id`` when the client sends one (echoed back in the response
headers), else a fresh hex id; handlers read it from ``scope["state"]["request_id"]`` and put what
``http.response`` should log into ``scope["state"]["info"]``.
"""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Any

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minirt.http.errors import ApiError
from minirt.http.openai.respond import error_response

MAX_REQUEST_ID = 256
OPEN_PATHS = frozenset({"/health"})  # routers probe it without a key, as vLLM allows


def _valid_request_id(rid: str) -> bool:
    return 0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable() and " " not in rid


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        log: Any,
        metrics: Any,
        api_key: str = "",
        own_auth: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.log = log
        self.metrics = metrics
        self.api_key = api_key.encode()
        self.own_auth = own_auth  # path prefixes whose routes check the key themselves

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or any(
            path == p or path.startswith(p.rstrip("/") + "/") for p in self.own_auth
        )

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.api_key:
            return True
        got = headers.get(b"authorization", b"")
        scheme, _, token = got.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        # Anthropic's clients send the key in x-api-key
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        headers = dict(scope.get("headers", []))
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _valid_request_id(given) else uuid.uuid4().hex
        info: dict[str, Any] = {"t0": trio.current_time()}
        state = scope.setdefault("state", {})
        state["request_id"], state["info"] = rid, info
        path, method = scope.get("path", ""), scope.get("method", "")
        self.log.info("http.request", request_id=rid, method=method, path=path)
        status = 0
        rid_header = (b"x-request-id", rid.encode("latin-1"))

        async def send_with_id(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg["headers"] = [*msg.get("headers", []), rid_header]
            await send(msg)

        self.metrics.in_flight.inc()
        try:
            if not self._open(path) and not self._authorized(headers):
                err = ApiError(401, "Invalid or missing API key", code="invalid_api_key")
                await error_response(err)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as e:
            # Starlette has already answered a plain 500 when it could; log the bug once.
            self.log.exception("http.error", request_id=rid, path=path, error=type(e).__name__)
            if not status:
                err = ApiError(500, "internal server error", code="internal_error")
                await error_response(err)(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            info.pop("t0", None)
            duration = time.monotonic() - t0
            route = scope.get("route")
            endpoint = getattr(route, "path", "other")
            self.metrics.observe(endpoint, status, duration, bool(info.get("disconnected")))
            self.log.info(
                "http.response",
                request_id=rid,
                status=status,
                path=path,
                duration_s=round(duration, 6),
                **info,
            )
