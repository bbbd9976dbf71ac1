"""Structured output through the OpenAI HTTP API with the official ``openai`` client:
``response_format`` (json_schema, json_object) and vLLM's ``structured_outputs`` (json, regex,
choice, grammar) for chat and completions, streaming too; bad constraints are 400s naming the
field; the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.structured.test_structured import SCHEMAS

pytest_plugins = (
    "tests.support.http_fixture",
)  # the runtime test_http_api and test_http_stream share

MSGS = [{"role": "user", "content": "give me JSON"}]


@pytest.fixture(scope="module")
def server(http_runtime):
    return http_runtime


@pytest.fixture
def client(server):
    return server.client()


def _format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


def test_chat_json_schema_answers_validate(server, client):
    for i, schema in enumerate(SCHEMAS):
        out = client.chat.completions.create(
            model=str(server.model),
            messages=MSGS,
            max_tokens=256,
            temperature=0.9,
            seed=i,
            n=2,
            response_format=_format(schema),  # type: ignore[arg-type]
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
        assert out.usage.completion_tokens > 0


def test_streamed_json_schema_answer_validates(server, client):
    stream = client.chat.completions.create(
        model=str(server.model),
        messages=MSGS,
        max_tokens=256,
        temperature=0,
        stream=True,
        response_format=_format(SCHEMAS[2]),  # type: ignore[arg-type]
    )
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMAS[2])


def test_completions_structured_outputs_and_json_object(server, client, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = str(server.model)

    def complete(structured_outputs: dict, **kw):
        out = client.completions.create(
            model=model,
            prompt="answer:",
            max_tokens=96,
            temperature=0,
            extra_body={"structured_outputs": structured_outputs},
            **kw,
        )
        [c] = out.choices
        assert c.finish_reason == "stop", c.text
        return c.text

    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", complete({"regex": r"[a-z]{2,5}-[0-9]{3}"}))
    assert complete({"choice": ["north", "south", "east"]}) in ("north", "south", "east")
    g = complete(
        {"grammar": 'root ::= "<" [0-9] ("+" [0-9])* ">"'},
        logit_bias={str(tok.convert_tokens_to_ids(">")): 5},
    )
    assert re.fullmatch(r"<[0-9](\+[0-9])*>", g)
    jsonschema.validate(json.loads(complete({"json": SCHEMAS[0]})), SCHEMAS[0])
    jsonschema.validate(json.loads(complete({"json": json.dumps(SCHEMAS[3])})), SCHEMAS[3])
    # any JSON object; the random model rarely closes a free string, so favour `"` and `}`
    bias = {str(tok.convert_tokens_to_ids(c)): 6 for c in ('"', "}")}
    out = client.chat.completions.create(
        model=model,
        messages=MSGS,
        max_tokens=96,
        temperature=0,
        logit_bias=bias,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


BAD = [
    (
        {"response_format": _format({"type": "string", "not": {"const": "a"}})},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": _format({"type": "integer", "minimum": 9, "maximum": 1})},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
    ),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    (
        {"structured_outputs": {"json": {"type": "object", "uniqueItems": True}}},
        "structured_outputs.json",
    ),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_constraints_are_400_naming_the_field(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=str(server.model), messages=MSGS, max_tokens=8, extra_body=extra
        )
    err = info.value.body
    assert isinstance(err, dict) and err.get("param") == param, err
    ok = client.chat.completions.create(
        model=str(server.model),
        messages=MSGS,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["fine"]}},
    )
    assert ok.choices[0].message.content == "fine"
