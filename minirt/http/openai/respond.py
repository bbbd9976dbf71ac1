"""Answering one completion request: run its choices against the front door and reply, as one
JSON body or as a stream of server-sent events.

A streamed reply starts (status 200, headers) with its first content once the front door has
accepted every choice, so a refusal (overloaded, actor down, invalid: the front door validates)
still gets its own status code. The client's
connection is watched the whole time: when it goes away, the request's choices are cancelled,
which cancels them in the front door and frees their KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
import trio
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from messages import client as cm
from minirt.http.errors import ApiError
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import Plan
from minirt.http.openai.embeddings import embedding_body
from minirt.http.openai.shapes import Choices, chat_body, completion_body
from minirt.http.openai.sse import StreamWriter, body
from minirt.http.upstream import Upstream, choice_messages

_encode = msgspec.json.Encoder().encode


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return bytes(_encode(content))


def error_response(e: ApiError) -> JSON:
    return JSON(e.body(), status_code=e.status, headers=e.headers())


class PlanResponse:
    """An ASGI app that runs ``plan`` and answers; ``info`` collects what ``http.response`` logs."""

    def __init__(
        self, plan: Plan, model: ModelInfo, upstream: Upstream, rid: str, info: dict[str, Any]
    ) -> None:
        self.plan = plan
        self.model = model
        self.upstream = upstream
        self.rid = rid
        self.info = info
        self.choices = Choices(plan)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.info["upstream_ids"] = [c.generate.request_id for c in self.plan.choices]
        error: ApiError | None = None
        try:
            async with self.upstream.use() as client, trio.open_nursery() as nursery:
                async with aclosing(choice_messages(client, self.plan, nursery)) as items:
                    run = self._stream if self.plan.stream else self._collect
                    error = await run(scope, receive, send, items, nursery)
                nursery.cancel_scope.cancel()
        except ApiError as e:
            error = e
        if error is not None:
            self.info["error"] = error.code or error.type
            await self.error_response(error)(scope, receive, send)
        self._summarize()

    def error_response(self, e: ApiError) -> Response:
        """The answer to a refusal (OpenAI's error shape; another API's in a subclass)."""
        return error_response(e)

    def _summarize(self) -> None:
        ch = self.choices
        self.info["prompt_tokens"] = ch.prompt_tokens()
        self.info["completion_tokens"] = sum(c.tokens for c in ch.by_index.values())
        self.info["finish_reasons"] = [c.finish_reason for c in ch.by_index.values()]
        read = [c for c in ch.by_index.values() if c.parser is not None]
        if read:  # how the output was read: the parsers, the calls found, the tools' grammar
            first = read[0].parser
            assert first is not None
            gen = self.plan.choices[0].generate
            self.info["parsers"] = {"tools": first.tools, "reasoning": first.reasoning}
            self.info["tool_calls"] = [len(c.parsed(final=True).calls) for c in read]
            self.info["tool_grammar"] = bool(gen.tools) and gen.tool_choice not in ("auto", "none")
        firsts = [c.first_token_t for c in ch.by_index.values() if c.first_token_t]
        if firsts and "t0" in self.info:
            self.info["ttft_s"] = round(min(firsts) - self.info["t0"], 6)

    async def _watch(self, receive: Receive, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client disconnects."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.info["disconnected"] = True
                scope.cancel()
                return

    def _watching(self, receive: Receive, nursery: trio.Nursery) -> trio.CancelScope:
        """Watch the connection in ``nursery`` (a disconnect cancels it) until the returned
        scope is cancelled."""
        watch = trio.CancelScope()

        async def run() -> None:
            with watch:
                await self._watch(receive, nursery.cancel_scope)

        nursery.start_soon(run)
        return watch

    async def _collect(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        items: AsyncIterator[tuple[int, Any]],
        nursery: trio.Nursery,
    ) -> ApiError | None:
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return msg
            self.choices.feed(index, msg, trio.current_time())
        watch.cancel()  # a disconnect from here on loses nothing
        make = {"chat": chat_body, "completion": completion_body, "embedding": embedding_body}
        body = make[self.plan.kind](self.plan, self.choices, self.model, self.rid)
        await JSON(body)(scope, receive, send)
        return None

    async def _stream(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        items: AsyncIterator[tuple[int, Any]],
        nursery: trio.Nursery,
    ) -> ApiError | None:
        writer = StreamWriter(self.plan, self.choices, self.model, self.rid)
        first: list[bytes] = []
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return msg  # nothing was sent yet: answer with the error's own status
            first += writer.feed(index, msg, trio.current_time())
            # started by the first content, once no choice can still be refused
            if isinstance(msg, (cm.Delta, cm.Final)) and first and self.choices.accepted():
                break
        watch.cancel()  # the streaming response watches the connection from here on
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        response = StreamingResponse(
            body(writer, first, items), media_type="text/event-stream", headers=headers
        )
        await response(scope, receive, send)
        if not writer.completed:
            self.info["disconnected"] = True
            nursery.cancel_scope.cancel()
        if writer.error is not None:
            self.info["error"] = writer.error.code or writer.error.type
        return None
