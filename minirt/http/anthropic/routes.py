"""``POST /v1/messages``: Anthropic's Messages API, run as a chat completions plan
(``convert``) and answered as a ``message``, whole or as Anthropic's events: ``message_start``,
per content block ``content_block_start`` / ``content_block_delta`` / ``content_block_stop``,
then ``message_delta`` (``stop_reason``, output tokens) and ``message_stop``. Plain text streams
as it is produced; an answer the model may turn into tool calls or reasoning (tools or a
reasoning template) is read whole (``Choice.parsed``) and its blocks sent at the end. Errors
come in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), the message
naming the field; the client's hang-up cancels the request, as on the other endpoints."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from messages import client as cm
from minirt.http.anthropic.convert import plan_messages
from minirt.http.anthropic.schema import MessagesRequest
from minirt.http.errors import ApiError
from minirt.http.openai.respond import JSON, PlanResponse
from minirt.http.openai.shapes import Choice
from minirt.http.server import Server, in_flight, read_body, unique_id
from tokenizer_svc.agent.parse import Parsed

_encode = msgspec.json.Encoder().encode
Items = AsyncIterator[tuple[int, Any]]
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: ApiError) -> JSON:
    return JSON(error_body(e), status_code=e.status, headers=e.headers())


def stop_of(c: Choice, parsed: Parsed) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if parsed.calls:
        return "tool_use", None
    if c.stop_reason:
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def blocks(c: Choice, parsed: Parsed, mid: str) -> list[dict[str, Any]]:
    """The answer's content blocks: thinking (a reasoning template's), text, tool uses."""
    out: list[dict[str, Any]] = []
    if c.parser is not None and c.parser.reasoning and parsed.reasoning:
        out.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        out.append({"type": "text", "text": parsed.content})
    for k, call in enumerate(parsed.calls):
        tid = f"toolu_{mid[4:]}{k}"
        out.append(
            {"type": "tool_use", "id": tid, "name": call.name, "input": tool_input(call.arguments)}
        )
    return out


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + b"\n\n"


class MessagesRun(PlanResponse):
    """One Messages request's plan, answered as Anthropic's ``message`` (or its events)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.mid = f"msg_{uuid.uuid4().hex[:24]}"

    def error_response(self, e: ApiError) -> JSON:
        return error_response(e)

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]):
        c = self.choices.by_index[0]
        return {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model.served_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": {"input_tokens": c.prompt_tokens or 0, "output_tokens": c.tokens},
        }

    async def _collect(
        self, scope: Scope, receive: Receive, send: Send, items: Items, nursery: trio.Nursery
    ) -> ApiError | None:
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return msg
            self.choices.feed(index, msg, trio.current_time())
        watch.cancel()  # a disconnect from here on loses nothing
        c = self.choices.by_index[0]
        parsed = c.parsed(final=True)
        body = self._message(blocks(c, parsed, self.mid), stop_of(c, parsed))
        await JSON(body)(scope, receive, send)
        return None

    async def _stream(
        self, scope: Scope, receive: Receive, send: Send, items: Items, nursery: trio.Nursery
    ) -> ApiError | None:
        texts: list[str] = []
        ended = False
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return msg  # nothing sent yet: its own status
            texts.append(self.choices.feed(index, msg, trio.current_time())[0])
            ended = isinstance(msg, cm.Final)
            if isinstance(msg, (cm.Delta, cm.Final)) and self.choices.accepted():
                break
        watch.cancel()  # the streaming response watches the connection from here on
        done: list[bool] = []
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = self._events("".join(texts), ended, items, done)
        await StreamingResponse(body, media_type="text/event-stream", headers=headers)(
            scope, receive, send
        )
        if not done:
            self.info["disconnected"] = True
            nursery.cancel_scope.cancel()
        return None

    async def _events(
        self, text: str, ended: bool, items: Items, done: list[bool]
    ) -> AsyncIterator[bytes]:
        c = self.choices.by_index[0]
        live = c.parser is None  # else read whole at the end (calls, reasoning)
        opened = False

        def text_events(text: str) -> bytes:
            nonlocal opened
            if not live or not text:
                return b""
            out = b""
            if not opened:
                opened = True
                block = {"type": "text", "text": ""}
                out = _event("content_block_start", index=0, content_block=block)
            return out + _event(
                "content_block_delta", index=0, delta={"type": "text_delta", "text": text}
            )

        start = self._message([], (None, None))
        yield _event("message_start", message=start) + text_events(text)
        if not ended:
            async for index, msg in items:
                if isinstance(msg, ApiError):
                    self.info["error"] = msg.code or msg.type
                    done.append(True)
                    yield _event("error", error=error_body(msg)["error"])
                    return
                new, _ = self.choices.feed(index, msg, trio.current_time())
                frames = text_events(new)
                if isinstance(msg, cm.Final):
                    ended = True
                    break
                if frames:
                    yield frames
        if not ended:  # the front door's stream ended without a final message
            done.append(True)
            yield _event("error", error={"type": "api_error", "message": "no answer"})
            return
        parsed = c.parsed(final=True)
        end: list[bytes] = []
        if live:
            if opened:
                end.append(_event("content_block_stop", index=0))
        else:
            for i, b in enumerate(blocks(c, parsed, self.mid)):
                end += _block_events(i, b)
        stop, seq = stop_of(c, parsed)
        delta = {"stop_reason": stop, "stop_sequence": seq}
        end.append(_event("message_delta", delta=delta, usage={"output_tokens": c.tokens}))
        end.append(_event("message_stop"))
        done.append(True)
        yield b"".join(end)


def _block_events(i: int, b: dict[str, Any]) -> list[bytes]:
    """A whole content block as its start, one delta and its stop."""
    start: dict[str, Any]
    if b["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": b["text"]}
    elif b["type"] == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        delta = {"type": "thinking_delta", "thinking": b["thinking"]}
    else:
        start = {**b, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
    return [
        _event("content_block_start", index=i, content_block=start),
        _event("content_block_delta", index=i, delta=delta),
        _event("content_block_stop", index=i),
    ]


def messages_routes(server: Server) -> list[BaseRoute]:
    async def create(request: Request) -> Any:
        rid = request.state.request_id
        base = unique_id(server, rid)
        try:
            req = await read_body(request, MessagesRequest, server.body_timeout_s)
            plan = plan_messages(req, server.model, base)
        except ApiError as e:
            return error_response(e)
        info = request.state.info
        info.update(kind="messages", stream=plan.stream, n=1)
        return in_flight(server, base, MessagesRun(plan, server.model, server.upstream, rid, info))

    return [Route("/v1/messages", create, methods=["POST"])]
