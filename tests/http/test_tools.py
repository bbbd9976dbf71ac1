"""Tool calling and reasoning in chat completions, against a real `minirt up` serving a model
with a Qwen-style tools template, driven by the official `openai` client (sync, async,
streaming): calls that a required or named ``tool_choice`` enforces validate against their
tool's schema even from random weights; tool round trips render as transformers renders them;
reasoning is split from the answer; streamed and whole answers are equal; bad tools are
refused naming the field."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio

from gpu.model.make_model import make_model
from tests.support.http_server import aclient, start_http_runtime

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "what is the weather in Paris"}]


def _required(server, **extra: Any) -> dict[str, Any]:
    """A chat request for a required call to one of TOOLS (or the one ``tool_choice`` names),
    sampled (temperature 1) unless ``extra`` says otherwise."""
    ask = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400}
    return {"model": str(server.model), **ask, "temperature": 1.0, **extra}


# Head size 32 (vLLM's CPU attention takes no smaller), so the same model serves a peer.
WIDER = {"hidden_size": 128, "intermediate_size": 256}


def make_tools_model(out: Path) -> Path:
    return make_model("qwen2", "tiny", out, template="tools", config_overrides=WIDER)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return make_tools_model(tmp_path_factory.mktemp("tools") / "m")


@dataclass
class Peer:
    """Another server already serving the same model (``MINIRT_PEER_URL``,
    ``MINIRT_PEER_MODEL``): these tests run against vLLM as they run against minirt."""

    url: str
    model: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(tools_model, tmp_path_factory):
    if os.environ.get("MINIRT_PEER_URL"):
        yield Peer(os.environ["MINIRT_PEER_URL"], Path(os.environ["MINIRT_PEER_MODEL"]))
        return
    flags = ("--num-blocks", "1024", "--chunk-cap", "256")
    with start_http_runtime(tools_model, tmp_path_factory.mktemp("run"), *flags) as h:
        yield h


@pytest.fixture
def client(server):
    return server.client()


def _valid_calls(message, names=tuple(SCHEMAS)) -> list:
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert "<tool_call>" not in (message.content or "")
    return message.tool_calls


def test_required_calls_validate_against_their_schema(server, client):
    for seed in range(4):
        out = client.chat.completions.create(**_required(server, seed=seed))
        [choice] = out.choices
        _valid_calls(choice.message)
        assert choice.finish_reason == "tool_calls"


def test_named_tool_and_one_call_without_parallel(server, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(**_required(server, tool_choice=named, seed=3))
    assert len(_valid_calls(out.choices[0].message, names=("get_time",))) == 1
    out = client.chat.completions.create(**_required(server, parallel_tool_calls=False, seed=5))
    assert len(_valid_calls(out.choices[0].message)) == 1


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str | None, str]:
    """Content, calls (name, arguments), finish reason and reasoning from chunks, checking
    OpenAI's order: a call's id, type and name first, its arguments in the chunks after."""
    content, reasoning, finish = "", "", None
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        if not ch.choices:
            continue
        [c] = ch.choices
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, [tuple(calls[i][1:]) for i in sorted(calls)], finish, reasoning


def test_streamed_calls_equal_the_whole_answer(server, client):
    kw = _required(server, seed=11)
    whole = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content, streamed, finish, _ = _streamed(chunks)
    assert streamed == calls
    assert content == (whole.message.content or "") and "<tool" not in content
    assert finish == whole.finish_reason == "tool_calls"
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > len(calls)  # the arguments arrive in pieces, not at once


def test_auto_parses_a_call_the_model_writes(server, client):
    """With ``auto`` the model writes what it likes and the hermes parser reads it: a call
    forced here by a regex is returned as a call, the text before it as content."""
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    kw = dict(
        model=str(server.model),
        messages=ASK,
        tools=TOOLS,
        max_tokens=100,
        extra_body={"structured_outputs": {"regex": _escape(text)}},
    )
    out = client.chat.completions.create(**kw).choices[0]
    assert out.message.content == "Let me check."
    [call] = _valid_calls(out.message)
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome", "days": 2},
    )
    content, calls, finish, _ = _streamed(client.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == (
        "Let me check.",
        [(call.function.name, call.function.arguments)],
        "tool_calls",
    )
    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert plain.message.content == text and not plain.message.tool_calls


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_round_trip_renders_as_transformers(server, client):
    from transformers import AutoTokenizer

    first = (
        client.chat.completions.create(
            **_required(server, parallel_tool_calls=False, temperature=0)
        )
        .choices[0]
        .message
    )
    [call] = _valid_calls(first)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(
        model=str(server.model), messages=history, tools=TOOLS, max_tokens=5, temperature=0
    )
    tok = AutoTokenizer.from_pretrained(server.model)
    ref = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    text = tok.apply_chat_template(ref, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert out.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_reasoning_is_split_from_the_answer(server, client):
    """The template knows <think>: reasoning goes to ``reasoning_content``, streamed apart;
    ``chat_template_kwargs`` reach the template."""
    kw = dict(
        model=str(server.model),
        messages=ASK,
        max_tokens=60,
        temperature=1.0,
        seed=2,
        extra_body={
            "structured_outputs": {
                "regex": r"<think>\nI [a-z]{2,8} it\n</think>\n\n(hello|world) [a-z]{1,6}"
            }
        },
    )
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content.startswith("I ") and msg.reasoning_content.endswith(" it")
    assert msg.content.split()[0] in ("hello", "world") and "think>" not in msg.content
    content, _, _, reasoning = _streamed(client.chat.completions.create(**kw, stream=True))
    assert (content, reasoning) == (msg.content, msg.reasoning_content)
    on = client.chat.completions.create(model=str(server.model), messages=ASK, max_tokens=1)
    off = client.chat.completions.create(
        model=str(server.model),
        messages=ASK,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed empty think block


@pytest.mark.parametrize(
    "change, param",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "strng"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "hi"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": "[1]"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].arguments",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(server, change, param):
    body = {"model": str(server.model), "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param)


async def test_async_client_calls_and_streams(server):
    """Concurrent async requests, streamed and not: every call valid, each stream equal to
    the same request answered whole."""
    client = aclient(server)
    results: dict[int, tuple] = {}

    async def one(seed: int) -> None:
        kw = _required(server, seed=seed)
        whole = (await client.chat.completions.create(**kw)).choices[0]
        stream = await client.chat.completions.create(**kw, stream=True)
        chunks = [c async for c in stream]
        calls = _valid_calls(whole.message)
        results[seed] = (
            [(c.function.name, c.function.arguments) for c in calls],
            _streamed(chunks)[1],
        )

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for seed in range(4):
                nursery.start_soon(one, seed)
    await client.close()
    assert len(results) == 4
    for whole_calls, streamed_calls in results.values():
        assert whole_calls == streamed_calls


@pytest.mark.skipif(bool(os.environ.get("MINIRT_PEER_URL")), reason="minirt only")
def test_smollm2_calls_a_tool_from_a_template_without_tools(smollm2, tmp_path):
    """SmolLM2's template shows no tools: the front door shows them (hermes format) and a
    required call from the real model validates; the round trip renders and answers."""
    with start_http_runtime(smollm2, tmp_path, "--num-blocks", "512") as srv:
        client = srv.client()
        kw = dict(model=str(srv.model), temperature=0, max_tokens=120)
        answer = client.chat.completions.create(
            messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw
        )
        first = answer.choices[0]
        [call] = _valid_calls(first.message)
        assert first.finish_reason == "tool_calls"
        history = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        out = client.chat.completions.create(messages=history, tools=TOOLS, **kw)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert out.usage.prompt_tokens > answer.usage.prompt_tokens
