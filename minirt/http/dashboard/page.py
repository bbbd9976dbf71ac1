"""The live dashboard: one page of static files and a server-sent-events stream of the run's
merged event log (the same source as ``minirt events --follow``).

Routes (``dashboard_routes``, mounted by the HTTP app or served alone by ``serve``):

- ``GET /`` redirects to ``/dashboard`` (the HTTP app leaves ``/`` to it);
- ``GET /dashboard``: the page; ``GET /dashboard/static/NAME``: its JS and CSS;
- ``GET /dashboard/events``: ``text/event-stream``. First ``event: hello`` (server clock),
  then the backlog as ``event: backlog`` messages, ``event: ready``, then ``event: events``
  messages as the log grows and ``event: tick`` (server clock) every second. Each backlog or
  events message is one file's new lines: the first data line is ``{"src": "events/NAME.jsonl"}``
  (``REPLICA/events/NAME.jsonl`` for a replica's log), each further data line one JSON event.

API key: when the server has one, every dashboard route needs it, given as
``Authorization: Bearer KEY``, as ``?key=KEY``, or as the ``minirt_dashboard`` cookie. Opening
``/dashboard?key=KEY`` (or the page with the header) sets that cookie (HttpOnly, SameSite=Strict,
an HMAC of the key, not the key itself) and redirects to ``/dashboard`` so the key does not stay
in the address bar; the page's EventSource, which cannot send headers, then sends the cookie.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from html import escape as html_escape
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
import trio
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import BaseRoute, Route

from minirt.http.dashboard.tail import LogTail

STATIC = Path(__file__).parent / "static"
COOKIE = "minirt_dashboard"
# The browser may load nothing but this server's own files (and talk only to it).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"
)
POLL_S = 0.25  # how often a stream looks for new lines
TICK_S = 1.0  # how often it sends the server's clock (the page's "now", and a liveness beat)
MAX_STREAMS = 16  # open dashboards per server; more are answered 503 (each costs a poll loop)
STREAMS = {"open": 0}


def cookie_token(api_key: str) -> str:
    """The cookie value for ``api_key``: proves the key without being it."""
    return hmac.new(api_key.encode(), b"minirt dashboard cookie v1", hashlib.sha256).hexdigest()


class DashboardAuth:
    """Which credential a request carries: ``open`` (no key configured), ``bearer``, ``query``,
    ``cookie``, or None (missing or wrong)."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key or None
        self.token = cookie_token(self.api_key) if self.api_key else ""

    def check(self, request: Request) -> str | None:
        if self.api_key is None:
            return "open"
        key = self.api_key.encode()
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and hmac.compare_digest(
            header[7:].strip().encode(), key
        ):
            return "bearer"
        query = request.query_params.get("key")
        if query is not None and hmac.compare_digest(query.encode(), key):
            return "query"
        cookie = request.cookies.get(COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), self.token.encode()):
            return "cookie"
        return None

    def remember(self, response: Response, path: str) -> Response:
        response.set_cookie(
            COOKIE, self.token, path=path, httponly=True, samesite="strict", max_age=7 * 86400
        )
        return response


def _denied(request: Request, html: bool) -> Response:
    reason = (
        "missing or wrong API key"
        if request.headers.get("authorization")
        or ("key" in request.query_params or COOKIE in request.cookies)
        else "this server needs its API key"
    )
    headers = {"WWW-Authenticate": "Bearer"}
    if html:
        return HTMLResponse(
            "<!doctype html><title>minirt dashboard: API key needed</title>"
            f"<p>{reason}. Open <code>{html_escape(request.url.path)}?key=YOUR_KEY</code> once; the page "
            "then remembers it in a cookie.</p>",
            status_code=401,
            headers=headers,
        )
    error = {
        "message": f"{reason}: send Authorization: Bearer KEY, ?key=KEY or the dashboard cookie",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    return JSONResponse({"error": error}, status_code=401, headers=headers)


def _sse(event: str, lines: list[str]) -> bytes:
    return (f"event: {event}\n" + "".join(f"data: {ln}\n" for ln in lines) + "\n").encode()


def _clock(extra: dict[str, Any] | None = None) -> list[str]:
    return [json.dumps({"now": time.time(), **(extra or {})})]


async def event_stream(
    run_dir: Path, poll_s: float = POLL_S, tick_s: float = TICK_S, backlog_bytes: int = 4 << 20
) -> AsyncIterator[bytes]:
    """The SSE body: hello, backlog, ready, then new lines as they are written, until the
    client goes away (the framework then cancels it; ``STREAMS`` counts the open ones)."""
    tail = LogTail(run_dir, backlog_bytes=backlog_bytes)
    STREAMS["open"] += 1
    try:
        yield _sse("hello", _clock({"run_dir": str(run_dir), "poll_s": poll_s}))
        for src, lines in await anyio.to_thread.run_sync(tail.backlog):
            yield _sse("backlog", [json.dumps({"src": src}), *lines])
        yield _sse("ready", _clock())
        last_tick = time.monotonic()
        while True:
            await anyio.sleep(poll_s)
            for src, lines in tail.poll():  # a stat per file and the new bytes: cheap, inline
                yield _sse("events", [json.dumps({"src": src}), *lines])
            if time.monotonic() - last_tick >= tick_s:
                last_tick = time.monotonic()
                yield _sse("tick", _clock())
    finally:
        STREAMS["open"] -= 1


def dashboard_routes(
    run_dir: str | Path, api_key: str | None = None, *, poll_s: float = POLL_S
) -> list[BaseRoute]:
    """The dashboard's routes for ``run_dir``'s event log, guarded by ``api_key`` if set."""
    run = Path(run_dir)
    auth = DashboardAuth(api_key)
    files = {p.name for p in STATIC.iterdir() if p.is_file()}

    async def root(request: Request) -> Response:
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"dashboard{query}", status_code=307)  # relative: works mounted

    async def page(request: Request) -> Response:
        how = auth.check(request)
        if how is None:
            return _denied(request, html=True)
        if how == "query":  # set the cookie, then drop the key from the address bar
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
            clean = request.url.replace(query=urlencode(rest))
            return auth.remember(RedirectResponse(clean, status_code=303), request.url.path)
        resp = FileResponse(
            STATIC / "dashboard.html",
            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP},
        )
        return auth.remember(resp, request.url.path) if how == "bearer" else resp

    async def static(request: Request) -> Response:
        if auth.check(request) is None:
            return _denied(request, html=False)
        name = request.path_params["name"]
        if name not in files:
            return JSONResponse(
                {
                    "error": {
                        "message": f"no dashboard file {name!r}",
                        "type": "not_found",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=404,
            )
        return FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

    async def events(request: Request) -> Response:
        if auth.check(request) is None:
            return _denied(request, html=False)
        if STREAMS["open"] >= MAX_STREAMS:
            error = {
                "message": f"{MAX_STREAMS} dashboards are open already; close one",
                "type": "server_error",
                "param": None,
                "code": "too_many_dashboards",
            }
            return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "5"})
        return StreamingResponse(
            event_stream(run, poll_s=poll_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return [
        Route("/", root, methods=["GET"]),
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/static/{name}", static, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
    ]


async def serve(
    run_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8001,
    api_key: str | None = None,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve only the dashboard (for a finished or replayed run's directory) under hypercorn's
    trio worker, until cancelled; ready (``nursery.start``) once it listens."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hyper_serve
    from starlette.applications import Starlette

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    app = Starlette(routes=dashboard_routes(run_dir, api_key))
    await hyper_serve(app, config, mode="asgi", task_status=task_status)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minirt.http.dashboard.page",
        description="Serve the dashboard alone for a run directory (live or finished).",
    )
    p.add_argument("--run-dir", default=".minirt")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--api-key", help="require this key (Bearer, ?key= or the page's cookie)")
    args = p.parse_args(argv)
    if not (Path(args.run_dir) / "events").is_dir():
        p.error(f"--run-dir: no events/ under {args.run_dir}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        p.error("--host: a non-loopback host needs --api-key")
    import trio

    print(f"minirt dashboard on http://{args.host}:{args.port}/dashboard", flush=True)
    try:
        trio.run(serve, args.run_dir, args.host, args.port, args.api_key)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
