"""OpenAI's Responses API (/v1/responses) against a real `minirt up`, driven by the official
`openai` package (sync, async, streaming) and the OpenAI Agents SDK: its answers equal chat
completions' for the same conversation (greedy, exact), streamed equals whole, stored responses
continue a conversation (previous_response_id), GET / DELETE, 404s, key scoping, refusals naming
the field as the client spelled it, and function tools (items in, items out)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from minirt.http.openai.shapes import call_id
from tests.support.http_server import MAX_NEW, aclient, hf_chat_ids
from tests.support.runtime import hf_greedy, poll_until

pytest_plugins = ("tests.support.http_fixture",)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "today's weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}


def chat(client, server, messages, max_tokens=MAX_NEW, **kw):
    return client.chat.completions.create(
        model=str(server.model), messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def respond(client, server, max_output_tokens=MAX_NEW, **kw):
    return client.responses.create(
        model=str(server.model), max_output_tokens=max_output_tokens, temperature=0, **kw
    )


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def comparable(r: Any) -> dict[str, Any]:
    """A response without what differs between two runs of it: ids, times, cache hits."""
    d = r if isinstance(r, dict) else r.model_dump(exclude_none=True)
    d = {k: v for k, v in d.items() if k not in ("id", "created_at")}
    d["usage"] = {k: v for k, v in d["usage"].items() if k != "input_tokens_details"}
    d["output"] = [
        {k: v for k, v in it.items() if k not in ("id", "call_id")} for it in d["output"]
    ]
    return d


def test_text_input_equals_chat_completions_and_transformers(server, client, tok):
    out = respond(client, server, input="hello there")
    messages = [{"role": "user", "content": "hello there"}]
    ref = chat(client, server, messages)
    ids = hf_chat_ids(server.model, messages)
    [hf] = hf_greedy(server.model, [ids], MAX_NEW)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.model == str(server.model)
    assert (
        out.output_text
        == ref.choices[0].message.content
        == tok.decode(hf, skip_special_tokens=True)
    )
    [msg] = out.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [c.type for c in msg.content] == ["output_text"]
    assert out.usage.input_tokens == ref.usage.prompt_tokens == len(ids)
    assert out.usage.output_tokens == ref.usage.completion_tokens == len(hf)
    assert out.usage.total_tokens == len(ids) + len(hf)
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.status == status_of(ref.choices[0].finish_reason)
    assert out.store is True and out.error is None and out.tools == []
    assert out.temperature == 0 and out.max_output_tokens == MAX_NEW


def test_items_and_instructions_equal_the_chat_messages(server, client):
    items = [
        {"role": "developer", "content": "answer in French"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hello"},
                {"type": "input_text", "text": "world"},
            ],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "bonjour"}]},
        {"role": "user", "content": "again"},
    ]
    out = respond(client, server, input=items, instructions="be brief")
    ref = chat(
        client,
        server,
        [
            {"role": "system", "content": "be brief"},
            {"role": "system", "content": "answer in French"},
            {"role": "user", "content": "hello\nworld"},
            {"role": "assistant", "content": "bonjour"},
            {"role": "user", "content": "again"},
        ],
    )
    assert out.output_text == ref.choices[0].message.content
    assert out.usage.input_tokens == ref.usage.prompt_tokens
    assert out.instructions == "be brief"


def test_max_output_tokens_leaves_it_incomplete(server, client):
    out = respond(client, server, input="count to ten", max_output_tokens=2)
    ref = chat(client, server, [{"role": "user", "content": "count to ten"}], max_tokens=2)
    assert ref.choices[0].finish_reason == "length"
    assert out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2 and out.output[0].status == "incomplete"
    assert out.output_text == ref.choices[0].message.content


def test_json_schema_text_format_gives_valid_json(server, client):
    out = respond(client, server, input="a JSON answer", max_output_tokens=64, text=JSON_FORMAT)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema" and out.text.format.name == "answer"
    ref = chat(
        client,
        server,
        [{"role": "user", "content": "a JSON answer"}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    assert out.output_text == ref.choices[0].message.content

    class Answer(BaseModel):
        ok: bool
        n: Literal[1, 2, 3]

    parsed = client.responses.parse(
        model=str(server.model),
        input="a JSON answer",
        max_output_tokens=64,
        temperature=0,
        text_format=Answer,
    )
    assert isinstance(parsed.output_parsed, Answer)
    plain = respond(
        client,
        server,
        input="an object",
        max_output_tokens=64,
        text={"format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(plain.output_text), dict)


def test_stream_events_add_up_to_the_response_answered_whole(server, client):
    kw = dict(input="tell me a story", max_output_tokens=MAX_NEW)
    whole = respond(client, server, **kw)
    events = list(respond(client, server, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == whole.output_text
    assert {d.item_id for d in deltas} == {final.output[0].id}
    assert comparable(final) == comparable(whole)
    # the SDK's own accumulator agrees (it wants a completed response: a bounded JSON answer)
    kw = dict(input="a JSON answer", max_output_tokens=64, text=JSON_FORMAT)
    whole = respond(client, server, **kw)
    with client.responses.stream(model=str(server.model), temperature=0, **kw) as s:
        for _ in s:
            pass
        assert comparable(s.get_final_response()) == comparable(whole)


def test_sse_framing(server):
    body = {"input": "hi", "max_output_tokens": 2, "stream": True}
    r = httpx.post(server.base_url + "/responses", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-1] == ""
    for frame in frames[:-1]:
        event, data = frame.split("\n")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name
    assert "[DONE]" not in r.text


async def test_async_client_and_stream(server):
    c = aclient(server)
    kw = dict(model=str(server.model), input="hello", max_output_tokens=64, temperature=0)
    kw["text"] = JSON_FORMAT  # the SDK's stream helper wants a completed response
    whole = await c.responses.create(**kw)
    text = ""
    async for ev in await c.responses.create(stream=True, **kw):
        if ev.type == "response.output_text.delta":
            text += ev.delta
    assert text == whole.output_text
    async with c.responses.stream(**kw) as s:
        final = await s.get_final_response()
    assert comparable(final) == comparable(whole)
    await c.close()


def test_previous_response_id_continues_the_stored_conversation(server, client):
    r1 = respond(client, server, input="hello", instructions="be brief", max_output_tokens=6)
    r2 = respond(client, server, input="and again", previous_response_id=r1.id, max_output_tokens=6)
    turn = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "and again"},
    ]
    ref2 = chat(client, server, turn, max_tokens=6)  # instructions are not carried over
    assert r2.output_text == ref2.choices[0].message.content
    assert r2.usage.input_tokens == ref2.usage.prompt_tokens > r1.usage.input_tokens
    assert r2.previous_response_id == r1.id and r2.instructions is None
    r3 = respond(
        client, server, input="third", previous_response_id=r2.id, instructions="new rules"
    )
    ref3 = chat(
        client,
        server,
        [
            {"role": "system", "content": "new rules"},
            *turn,
            {"role": "assistant", "content": r2.output_text},
            {"role": "user", "content": "third"},
        ],
    )
    assert r3.output_text == ref3.choices[0].message.content
    assert r3.usage.input_tokens == ref3.usage.prompt_tokens


def test_get_delete_and_not_found(server, client):
    r = respond(client, server, input="keep me", max_output_tokens=4)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    url = f"{server.base_url}/responses/{r.id}"
    auth = {"Authorization": "Bearer unused"}  # the client's key: the response is its own
    assert httpx.delete(url, timeout=30).status_code == 404  # no key: another's response
    deleted = httpx.delete(url, headers=auth, timeout=30)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: respond(client, server, input="x", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.status_code == 404
    err = info.value.body
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert httpx.get(f"{server.base_url}/responses/resp_nope", timeout=30).status_code == 404
    unstored = respond(client, server, input="forget me", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_belongs_to_the_key_that_made_it(server):
    alice, bob = server.client("alice"), server.client("bob")
    r = respond(alice, server, input="secret", max_output_tokens=2)
    for call in (
        lambda: bob.responses.retrieve(r.id),
        lambda: bob.responses.delete(r.id),
        lambda: respond(bob, server, input="x", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(r.id).id == r.id
    respond(alice, server, input="x", previous_response_id=r.id, max_output_tokens=2)


BAD = [
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference"}]}, "input[1].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": ["x"]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "model": "other"}, "model"),
    # refused by the front door, named back as the client spelled them
    (
        {
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "nope", "output": "y"},
            ]
        },
        "input[1].call_id",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "let me see"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[1]"},
            ]
        },
        "input[3].arguments",
    ),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}]},
        "tools[0].parameters",
    ),
    (
        {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
    ),
    ({"input": "x " * 100_000}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_refusals_name_the_field_as_the_client_spelled_it(server, body, param):
    r = httpx.post(server.base_url + "/responses", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param) or err["code"], err


def test_refusal_keeps_its_status_when_streamed(server):
    body = {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}]}
    r = httpx.post(server.base_url + "/responses", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters"


def test_function_calls_out_and_back_in(server, client):
    ask = [{"role": "user", "content": "weather in rome?"}]
    tools = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    r1 = respond(client, server, input=ask, max_output_tokens=64, **tools)
    assert r1.status == "completed"
    [call] = r1.output
    assert call.type == "function_call" and call.name == "weather" and call.status == "completed"
    assert call.call_id == call_id(r1.id, 0) and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("paris", "rome")
    ref1 = chat(
        client,
        server,
        ask,
        max_tokens=64,
        tools=[CHAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    [ref_call] = ref1.choices[0].message.tool_calls
    assert (ref_call.function.name, ref_call.function.arguments) == (call.name, call.arguments)
    assert r1.usage.input_tokens == ref1.usage.prompt_tokens
    # streamed: the same call, its arguments in pieces
    events = list(respond(client, server, input=ask, max_output_tokens=64, stream=True, **tools))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    assert comparable(events[-1].response) == comparable(r1)
    # the tool's answer: as items, and as a continuation of the stored response: the same prompt
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = dict(tools=[WEATHER], max_output_tokens=64, text=JSON_FORMAT)
    items = [*ask, call.model_dump(exclude_none=True), answer]
    r2 = respond(client, server, input=items, **after)
    r3 = respond(client, server, input=[answer], previous_response_id=r1.id, **after)
    ref2 = chat(
        client,
        server,
        [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [ref_call.model_dump()]},
            {"role": "tool", "tool_call_id": ref_call.id, "content": "sunny"},
        ],
        max_tokens=64,
        tools=[CHAT_WEATHER],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    assert r2.status == r3.status == "completed"
    assert r2.output_text == r3.output_text == ref2.choices[0].message.content
    assert r2.usage.input_tokens == r3.usage.input_tokens == ref2.usage.prompt_tokens
    jsonschema.validate(json.loads(r2.output_text), SCHEMA)


def test_a_disconnected_stream_is_cancelled_upstream(server):
    body = {"input": "go on", "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "responses-hang-up"}
    with httpx.stream(
        "POST", server.base_url + "/responses", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break

    def gone() -> dict | None:
        for e in server.rt.events("http.response", "responses-hang-up"):
            if e.get("disconnected"):
                return e
        return None

    e = poll_until(gone, 30, "the disconnected response's http.response event")
    assert e["kind"] == "responses" and e["response_id"].startswith("resp_")
    assert e["completion_tokens"] < 900
    aborted = lambda: server.rt.events("request.aborted", "responses-hang-up")  # noqa: E731
    poll_until(aborted, 30, "the scheduler's request.aborted")


def test_the_agents_sdk_runs_a_tool_to_a_final_output(server):
    import agents
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def weather(city: Literal["paris", "rome"]) -> str:
        """Today's weather in a city."""
        asked.append(city)
        return "sunny"

    class Model(OpenAIResponsesModel):
        """Once the tool has answered (tool_choice back to auto), a bounded JSON answer: the
        random-weight model ends it, so the run completes."""

        def _build_response_create_kwargs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            out = super()._build_response_create_kwargs(*args, **kwargs)
            if any(
                isinstance(i, dict) and i.get("type") == "function_call_output"
                for i in out["input"]
            ):
                out["text"] = JSON_FORMAT
            return out

    def agent() -> agents.Agent:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        return agents.Agent(
            name="forecaster",
            instructions="Answer with the weather.",
            tools=[weather],
            model=Model(model=str(server.model), openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
            ),
        )

    result = agents.Runner.run_sync(agent(), "weather in rome?")
    assert asked and asked[0] in ("paris", "rome")
    jsonschema.validate(json.loads(result.final_output), SCHEMA)
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds

    async def streamed() -> str:
        run = agents.Runner.run_streamed(agent(), "weather in rome?")
        async for _ in run.stream_events():
            pass
        return str(run.final_output)

    assert asyncio.run(streamed()) == result.final_output
    assert len(asked) == 2
