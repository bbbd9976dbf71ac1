"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``DELETE /v1/responses/{id}``.

A request is converted into a chat completions request (``responses_convert``) and run as one:
the same plan, the same front door (which validates, renders the template and tokenizes), the
same refusals with their status codes (a stream starts only once the front door has accepted
the request and it has produced something), the same cancellation when the client goes away.
Its output is read as chat reads it (reasoning, text, tool calls: ``shapes.Choice.parsed``) and
answered as a Response object (``responses_shape``), whole or as events (``responses_stream``).
With ``store`` (the default) the response and its conversation are kept (``response_store``)
for ``GET`` and for a next turn's ``previous_response_id``; they belong to the API key that
made them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from messages import client as cm
from minirt.http.errors import ApiError
from minirt.http.openai.convert import Plan
from minirt.http.openai.respond import JSON, PlanResponse
from minirt.http.responses.convert import Turn, plan_turn, turn_of
from minirt.http.responses.schema import ResponsesRequest
from minirt.http.responses.shape import (
    Order,
    Shape,
    assistant_message,
    echo_of,
    new_id,
    output_items,
    status_of,
    usage_of,
)
from minirt.http.responses.store import ResponseStore
from minirt.http.responses.stream import EventWriter
from minirt.http.server import Server, in_flight, read_body, unique_id
from tokenizer_svc.agent.parse import Parsed

Items = AsyncIterator[tuple[int, Any]]  # a response's choices' messages (upstream.choice_messages)


def api_key_of(request: Request) -> str:
    """The bearer token the client sent ("" when none): whose stored responses it sees."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def not_found(rid: str, param: str | None = None) -> ApiError:
    if param == "previous_response_id":
        message, code = (
            f"Previous response with id {rid!r} not found.",
            "previous_response_not_found",
        )
    else:
        message, code = f"Response with id {rid!r} not found.", "not_found"
    return ApiError(404, message, param=param, code=code, type="invalid_request_error")


class ResponsesRun(PlanResponse):
    """Runs one Responses request's plan and answers it (JSON, or events when streamed)."""

    def __init__(
        self,
        server: Server,
        turn: Turn,
        plan: Plan,
        shape: Shape,
        store: Callable[[dict[str, Any]], None] | None,
        rid: str,
        info: dict[str, Any],
    ) -> None:
        super().__init__(plan, server.model, server.upstream, rid, info)
        self.turn = turn
        self.shape = shape
        self.store = store
        self.order = Order()

    def _choice_parsed(self, final: bool) -> Parsed:
        return self.choices.by_index[0].parsed(final)

    def _result(self, writer: EventWriter | None) -> tuple[list[bytes], dict[str, Any]]:
        """The whole response (and, streaming, the last events); stored when asked to be."""
        ch = self.choices.by_index[0]
        parsed = ch.parsed(True)
        status, incomplete = status_of(ch.finish_reason)
        usage = usage_of(self.choices)
        frames: list[bytes] = []
        if writer is not None:
            frames, response = writer.finish(parsed, status, usage, incomplete)
        else:
            output = output_items(self.shape, parsed, self.order.final(), status)
            response = self.shape.response(status, output, usage, incomplete)
        if self.store is not None:
            self.store(
                {
                    "response": response,
                    "messages": self.turn.history,
                    "output": assistant_message(self.shape, parsed),
                }
            )
        return frames, response

    def _see(self, msg: Any) -> None:
        """Follow which output item began first (only calls can come before the text)."""
        parser = self.choices.by_index[0].parser
        tools = parser is not None and parser.tools
        if isinstance(msg, cm.Delta) and tools and not self.order.decided:
            assert parser is not None
            self.order.see(parser.parsed(False))

    async def _collect(
        self, scope: Scope, receive: Receive, send: Send, items: Items, nursery: trio.Nursery
    ) -> ApiError | None:
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return self.turn.names.respell(msg)
            self.choices.feed(index, msg, trio.current_time())
            self._see(msg)
        watch.cancel()  # a disconnect from here on loses nothing
        _, response = self._result(None)
        await JSON(response)(scope, receive, send)
        return None

    async def _stream(
        self, scope: Scope, receive: Receive, send: Send, items: Items, nursery: trio.Nursery
    ) -> ApiError | None:
        writer = EventWriter(self.shape)
        ended = False
        watch = self._watching(receive, nursery)
        async for index, msg in items:
            if isinstance(msg, ApiError):
                return self.turn.names.respell(msg)  # nothing sent yet: its own status
            self.choices.feed(index, msg, trio.current_time())
            ended = isinstance(msg, cm.Final)
            if isinstance(msg, (cm.Delta, cm.Final)) and self.choices.accepted():
                break
        watch.cancel()  # the streaming response watches the connection from here on
        first = writer.start()
        if not ended:
            first += writer.step(self._choice_parsed(False))
        done: list[bool] = []
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = self._events(writer, first, items, ended, done)
        await StreamingResponse(body, media_type="text/event-stream", headers=headers)(
            scope, receive, send
        )
        if not done:
            self.info["disconnected"] = True
            nursery.cancel_scope.cancel()
        return None

    async def _events(
        self, writer: EventWriter, first: list[bytes], items: Items, ended: bool, done: list[bool]
    ) -> AsyncIterator[bytes]:
        yield b"".join(first)
        if not ended:
            async for index, msg in items:
                if isinstance(msg, ApiError):
                    error = self.turn.names.respell(msg)
                    self.info["error"] = error.code or error.type
                    done.append(True)
                    yield writer.error(error)
                    return
                self.choices.feed(index, msg, trio.current_time())
                if isinstance(msg, cm.Final):
                    ended = True
                    break
                if isinstance(msg, cm.Delta):
                    frames = writer.step(self._choice_parsed(False))
                    if frames:
                        yield b"".join(frames)
        if not ended:  # the front door's stream ended without a final message
            done.append(True)
            yield writer.error(ApiError(500, "the request ended without an answer"))
            return
        frames, _ = self._result(writer)
        done.append(True)  # everything is produced; only the last frames are left to send
        yield b"".join(frames)


def responses_routes(server: Server, store: ResponseStore | None) -> list[BaseRoute]:
    """The routes of the Responses API; ``store`` None: nothing is stored (no run directory)."""

    async def create(request: Request) -> Any:
        rid = request.state.request_id
        base = unique_id(server, rid)
        req = await read_body(request, ResponsesRequest, server.body_timeout_s)
        key = api_key_of(request)
        previous = None
        if req.previous_response_id is not None:
            record = store.get(req.previous_response_id, key) if store is not None else None
            if record is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            previous = [*record["messages"], record["output"]]
        turn = turn_of(req, previous)
        plan = plan_turn(turn, server.model, base)
        stored = req.store and store is not None
        shape = Shape(new_id(), int(time.time()), server.model.served_name, echo_of(req, stored))
        info = request.state.info
        info.update(kind="responses", stream=plan.stream, n=1, response_id=shape.id)

        def keep(record: dict[str, Any]) -> None:
            assert store is not None
            try:
                store.put(shape.id, key, record)
            except OSError as e:  # a full disk, say: the answer still goes out, unstored
                server.log.warning("http.response_store_failed", id=shape.id, error=str(e))

        run = ResponsesRun(server, turn, plan, shape, keep if stored else None, rid, info)
        return in_flight(server, base, run)

    def stored(request: Request) -> tuple[str, dict[str, Any]]:
        rid = request.path_params["response_id"]
        request.state.info.update(kind="responses", response_id=rid)
        record = store.get(rid, api_key_of(request)) if store is not None else None
        if record is None:
            raise not_found(rid)
        return rid, record

    async def get(request: Request) -> JSON:
        return JSON(stored(request)[1]["response"])

    async def delete(request: Request) -> JSON:
        rid, _ = stored(request)
        assert store is not None
        store.delete(rid, api_key_of(request))
        return JSON({"id": rid, "object": "response.deleted", "deleted": True})

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", get, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    ]
