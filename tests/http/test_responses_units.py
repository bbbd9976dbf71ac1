"""The Responses API's pure parts, and its routes in-process: input items folded into chat
messages, refusals named as the client spelled them, the events of a stream (each one validated
by the `openai` package's own types, and accumulated by its stream helper into the response
answered whole, reasoning and calls included), and stored responses served after a restart."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from actors.runtime.events import get_logger
from minirt.http.app import build_app
from minirt.http.errors import ApiError
from minirt.http.model import ModelInfo
from minirt.http.responses.convert import turn_of
from minirt.http.responses.schema import ResponsesRequest
from minirt.http.responses.shape import Order, Shape, new_id, output_items
from minirt.http.responses.store import ResponseStore
from minirt.http.responses.stream import EventWriter
from minirt.http.server import Server
from minirt.http.upstream import Upstream
from tokenizer_svc.agent.parse import OutputParser

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def turn(body: dict[str, Any], previous=None):
    return turn_of(ResponsesRequest.model_validate(body), previous)


def call(cid: str, args: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": args}


def test_items_fold_into_chat_messages():
    t = turn(
        {
            "instructions": "rules",
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "a"},
                        {"type": "output_text", "text": "b"},
                    ],
                },
                call("c1"),
                call("c2", '{"x": 1}'),
                {"type": "function_call_output", "call_id": "c1", "output": "r1"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "r2"}],
                },
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "lost"}]},
                {"role": "user", "content": "next"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "kept"}]},
                call("c3"),
            ],
        }
    )
    got = [m.model_dump(exclude_none=True) for m in t.chat.messages]
    assert got == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a\nb",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                },
            ],
        },
        {"role": "tool", "content": "r1", "tool_call_id": "c1"},
        {"role": "tool", "content": "r2", "tool_call_id": "c2"},
        {"role": "user", "content": "next"},  # the reasoning before a user message: dropped
        {
            "role": "assistant",
            "reasoning_content": "kept",
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]
    assert len(t.history) == len(got) - 1
    assert t.history[0] == {"role": "user", "content": "q"}  # instructions are not history


def test_previous_conversation_comes_after_the_instructions_only():
    prev = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "ans"}]
    t = turn({"input": "new", "instructions": "now"}, prev)
    assert [(m.role, m.content) for m in t.chat.messages] == [
        ("system", "now"),
        ("user", "old"),
        ("assistant", "ans"),
        ("user", "new"),
    ]
    assert t.history == [*prev, {"role": "user", "content": "new"}]
    # errors in the stored part name previous_response_id; the new part the input
    e = ApiError(400, "messages[2].content: bad", param="messages[2].content")
    assert t.names.respell(e).param == "previous_response_id"
    assert t.names.respell(ApiError(400, "x", param="messages[0]")).param == "instructions"
    e = t.names.respell(ApiError(400, "messages[3].content: bad", param="messages[3].content"))
    assert (e.param, e.message) == ("input", "input: bad")  # a string input is all one


@pytest.mark.parametrize(
    ("front_door", "client"),
    [
        ("messages[1].tool_calls[1].arguments", "input[3].arguments"),
        ("messages[1].tool_calls[0].function.name", "input[2].name"),
        ("messages[1].tool_calls[0].id", "input[2].call_id"),
        ("messages[1].tool_calls", "input[2]"),
        ("messages[1].content", "input[1].content"),
        ("messages[1].reasoning_content", "input[0].content"),
        ("messages[2].tool_call_id", "input[4].call_id"),
        ("messages[2].content", "input[4].output"),
        ("messages[0].content", "previous_response_id"),
        ("messages[9]", "input"),
        ("messages", "input"),
        ("tools[0].function.parameters", "tools[0].parameters"),
        ("tools[1].parameters", "tools[1].parameters"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format", "text.format"),
        ("max_completion_tokens", "max_output_tokens"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
    ],
)
def test_refusals_name_the_input_item(front_door, client):
    t = turn(
        {
            "input": [
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
                {"role": "assistant", "content": "a"},
                call("c1"),
                call("c2"),
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ]
        },
        [{"role": "user", "content": "old"}],
    )
    assert t.names.spell(front_door) == client


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [call("")]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0].name"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [3]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}
                ]
            },
            "input[0].output[0].type",
        ),
        ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ],
)
def test_malformed_requests_are_refused_naming_the_field(body, param, tiny_model):
    from minirt.http.responses.convert import plan_turn

    model = ModelInfo.load(str(tiny_model))
    with pytest.raises(ApiError) as info:
        plan_turn(turn(body), model, "rid")
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(param)


def stream_of(text: str, chunk: int = 3) -> tuple[list[dict[str, Any]], dict[str, Any], Shape]:
    """The events of ``text`` read by hermes + qwen3 parsers, and the response answered whole."""
    shape = Shape(
        new_id(), 1, "m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    )
    writer = EventWriter(shape)
    parser = OutputParser("hermes", "qwen3")
    order = Order()
    frames = writer.start()
    for i in range(0, len(text), chunk):
        parser.feed(text[i : i + chunk])
        frames += writer.step(parser.parsed(False))
        if not order.decided:
            order.see(parser.parsed(False))
    usage = {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 3,
    }
    last, streamed = writer.finish(parser.parsed(True), "completed", usage, None)
    frames += last
    whole = shape.response(
        "completed", output_items(shape, parser.parsed(True), order.final(), "completed"), usage
    )
    assert streamed == whole
    events = []
    for f in frames:
        head, data = f.decode().rstrip("\n").split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        events.append(ev)
    return events, whole, shape


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        (
            "<think>\nplan it\n</think>\n\nHello there " + CALL,
            ["reasoning", "message", "function_call"],
        ),
        ("plain words", ["message"]),
        (CALL + CALL, ["function_call", "function_call"]),
        (CALL + " and after", ["function_call", "message"]),  # text after a call: held, then last
        ("<think>x</think>" + CALL + " tail", ["reasoning", "function_call", "message"]),
    ],
)
def test_stream_events_are_valid_and_add_up_to_the_whole(text, kinds):
    for chunk in (1, 3, 1000):
        events, whole, shape = stream_of(text, chunk)
        if chunk == 1000:  # begun in the same delta: reasoning, text, calls
            rank = {"reasoning": 0, "message": 1, "function_call": 2}
            kinds = sorted(kinds, key=rank.__getitem__)
        assert [it["type"] for it in whole["output"]] == kinds
        Response.model_validate(whole)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        state: ResponseStreamState = ResponseStreamState(input_tools=omit, text_format=omit)
        out = []
        for e in events:
            out += state.handle_event(EVENT.validate_python(e))
        assert out[-1].type == "response.completed"
        assert out[-1].response.model_dump(exclude_none=True) == Response.model_validate(
            whole
        ).model_dump(exclude_none=True)
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == list(range(len(kinds)))  # announced in output order
        for i, item in enumerate(whole["output"]):
            if item["type"] == "function_call":
                pieces = [
                    e["delta"]
                    for e in events
                    if e["type"] == "response.function_call_arguments.delta"
                    and e["output_index"] == i
                ]
                assert "".join(pieces) == item["arguments"] and json.loads(item["arguments"])
                assert item["call_id"] == shape.call_id(
                    sum(1 for x in whole["output"][:i] if x["type"] == "function_call")
                )


async def test_stored_responses_are_served_after_a_restart(tiny_model, tmp_path):
    model = ModelInfo.load(str(tiny_model))
    log = get_logger()
    before = ResponseStore(tmp_path / "responses", 10, 1 << 20, log)
    response = {"id": "resp_abc", "object": "response", "output": [], "status": "completed"}
    history = [{"role": "user", "content": "q"}]
    record = {"response": response, "messages": history, "output": {"role": "assistant"}}
    before.put("resp_abc", "k1", record)

    def app(api_key: str = "", run_dir: str = str(tmp_path)) -> httpx.AsyncClient:
        server = Server(
            model=model,
            upstream=Upstream("ipc:///nowhere", None, log),
            endpoints={},
            log=log,
            api_key=api_key,
            run_dir=run_dir,
        )
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(server)), base_url="http://test"
        )

    k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    async with app() as c:  # a new app over the same run directory: a restart
        assert (await c.get("/v1/responses/resp_abc", headers=k1)).json() == response
        r = await c.get("/v1/responses/resp_abc", headers=k2)
        assert r.status_code == 404 and r.json()["error"]["param"] is None
        r = await c.post(
            "/v1/responses", json={"input": "x", "previous_response_id": "resp_abc"}, headers=k2
        )
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "previous_response_id"
        # the request is converted and planned before the front door is asked
        r = await c.post("/v1/responses", json={"input": [call("")]}, headers=k1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id"
        r = await c.post(
            "/v1/responses", json={"input": "x", "previous_response_id": "resp_abc"}, headers=k1
        )
        assert r.status_code == 503  # found: it went on to the (absent) front door
        r = await c.delete("/v1/responses/resp_abc", headers=k1)
        assert r.json() == {"id": "resp_abc", "object": "response.deleted", "deleted": True}
        assert (await c.get("/v1/responses/resp_abc", headers=k1)).status_code == 404
    async with app(api_key="k1") as c:  # the gate still guards these routes
        assert (await c.get("/v1/responses/resp_abc")).status_code == 401
    async with app(run_dir="") as c:  # no run directory: nothing is stored
        assert (await c.get("/v1/responses/resp_abc")).status_code == 404
