"""Anthropic's Messages API (``POST /v1/messages``) against a real `minirt up` (a model with a
tools template, an API key), driven by the official `anthropic` client: greedy text equal to
chat completions' for the same conversation, streamed and whole alike, tool use that validates
against the tool's schema, a tool round trip rendered as chat renders it, stop sequences and
the token limit as stop reasons, errors in Anthropic's shape naming the field."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.http.test_tools import SCHEMAS, TOOLS, make_tools_model
from tests.support.http_server import start_http_runtime

KEY = "sk-minirt-anthropic"
SYSTEM = "You answer briefly."
GREEDY = {"temperature": 0}  # (the anthropic client has no sampling arguments of its own)
ASK = [{"role": "user", "content": "what is the weather in Paris"}]
ATOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tools_model(tmp_path_factory.mktemp("tools") / "m")
    flags = ("--num-blocks", "1024", "--chunk-cap", "256")
    with start_http_runtime(model, tmp_path_factory.mktemp("run"), *flags, api_key=KEY) as h:
        yield h


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_greedy_text_equals_chat_completions_whole_and_streamed(server, claude, chat):
    kw = dict(model=str(server.model), max_tokens=12, extra_body=GREEDY)
    msg = claude.messages.create(system=SYSTEM, messages=ASK, **kw)
    ref = chat.chat.completions.create(messages=[{"role": "system", "content": SYSTEM}, *ASK], **kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert _text(msg) == ref.choices[0].message.content
    assert msg.usage.input_tokens == ref.usage.prompt_tokens
    assert msg.usage.output_tokens == ref.usage.completion_tokens
    want = {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert msg.stop_reason == want
    with claude.messages.stream(system=SYSTEM, messages=ASK, **kw) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events
    assert _text(streamed) == _text(msg) and streamed.stop_reason == msg.stop_reason
    assert streamed.usage.output_tokens == msg.usage.output_tokens


def test_stop_sequences_and_the_token_limit_are_stop_reasons(server, claude):
    kw = dict(model=str(server.model), extra_body=GREEDY, messages=ASK)
    free = _text(claude.messages.create(max_tokens=16, **kw))
    word = next(w for w in free.split() if len(w) > 2)
    stopped = claude.messages.create(max_tokens=16, stop_sequences=[word], **kw)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in _text(stopped)
    assert claude.messages.create(max_tokens=2, **kw).stop_reason == "max_tokens"


def test_tool_use_validates_against_its_schema_whole_and_streamed(server, claude):
    kw = dict(
        model=str(server.model), max_tokens=400, messages=ASK, tools=ATOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    msg = claude.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and msg.stop_reason == "tool_use"
    for b in uses:
        assert b.id.startswith("toolu_")
        jsonschema.validate(b.input, SCHEMAS[b.name])
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content if b.type == "tool_use"]
    named = claude.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_time"}})
    assert {b.name for b in named.content if b.type == "tool_use"} == {"get_time"}


def test_a_tool_round_trip_is_the_conversation_chat_completions_sees(server, claude, chat):
    call = {"city": "Paris", "days": 2}
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
        },
    ]
    msg = claude.messages.create(
        model=str(server.model), max_tokens=6, extra_body=GREEDY, messages=turns, tools=ATOOLS
    )
    ref = chat.chat.completions.create(
        model=str(server.model), max_tokens=6, temperature=0, tools=TOOLS,
        messages=[
            *ASK,
            {
                "role": "assistant", "content": None,
                "tool_calls": [{
                    "id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call)},
                }],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        ],
    )  # fmt: skip
    assert msg.usage.input_tokens == ref.usage.prompt_tokens
    assert _text(msg) == (ref.choices[0].message.content or "")


def test_errors_come_in_anthropic_shape_naming_the_field(server, claude):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=str(server.model), max_tokens=0, messages=ASK)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        claude.messages.create(
            model=str(server.model), max_tokens=4,
            messages=[{"role": "user", "content": [image]}],
        )  # fmt: skip
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=str(server.model), max_tokens=4, messages=ASK)
    r = httpx.post(
        server.url + "/v1/messages", headers={"x-api-key": KEY},
        json={"model": str(server.model), "max_tokens": 4, "messages": []},
    )  # fmt: skip
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages" in body["error"]["message"]
