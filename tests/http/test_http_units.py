"""The HTTP layer's pure parts (request conversion, error naming) and the app in-process: a bug
answers a plain 500 in OpenAI's shape and logs ``http.error``, never a traceback."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from actors.runtime.events import configure
from minirt.http.app import build_app
from minirt.http.errors import ApiError, from_upstream, from_validation, param_of
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import plan_chat, plan_completion
from minirt.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from minirt.http.server import Server
from minirt.http.upstream import Upstream
from tokenizer_svc.requests import Invalid, Prompts, check_request


@pytest.fixture(scope="module")
def model(tiny_model) -> ModelInfo:
    return ModelInfo.load(str(tiny_model))


def test_error_locations_are_named_as_openai_spells_them():
    assert param_of(("messages", 1, "content", "str")) == "messages[1].content"
    assert param_of(("messages", 0, "content", "list[ContentPart]", 2, "type")) == (
        "messages[0].content[2].type"
    )
    assert param_of(("prompt", "list[list[int]]", 0, 3)) == "prompt[0][3]"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 3}]})
    e = from_validation(info.value)
    assert (e.status, e.param) == (400, "messages[0].content")


def test_n_choices_get_seed_streams_and_ids(model):
    req = CompletionRequest.model_validate({"prompt": [[5, 6], [7, 8, 9]], "n": 2, "seed": 40})
    plan = plan_completion(req, model, "rid")
    assert [c.generate.request_id for c in plan.choices] == ["rid-0", "rid-1", "rid-2", "rid-3"]
    assert [c.generate.params.seed for c in plan.choices] == [40, 41, 40, 41]
    assert [c.generate.prompt_ids for c in plan.choices] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    assert [c.prompt_index for c in plan.choices] == [0, 0, 1, 1]
    single = plan_completion(CompletionRequest.model_validate({"prompt": "hi"}), model, "x")
    assert single.choices[0].generate.request_id == "x"
    assert single.choices[0].generate.params.max_tokens == 16  # OpenAI's completions default


def _front_door(model: ModelInfo, gen):
    """What the front door makes of a planned request (the tokenizer loaded here, as there)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.path)
    return tok, check_request(gen, tok, model.vocab_size, model.max_model_len, Prompts())


def test_chat_defaults_to_the_rest_of_the_context_and_joins_text_parts(model):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "developer", "content": "sys"}, {"role": "user", "content": parts}]}
    )
    plan = plan_chat(req, model, "r")
    gen = plan.choices[0].generate
    assert gen.fill_context and gen.params.temperature == 1.0  # OpenAI's default
    assert [(m.role, m.content) for m in gen.messages] == [("system", "sys"), ("user", "a\nb")]
    tok, checked = _front_door(model, gen)
    text = tok.decode(checked.ids)
    assert "<|im_start|>system\nsys<|im_end|>" in text and "a\nb" in text
    assert checked.params.max_tokens == model.max_model_len - len(checked.ids)
    assert model._tokenizer is None  # the HTTP server did not tokenize, nor load the tokenizer


def test_refusals_name_the_field(model):
    here = [  # the HTTP server's own refusals: its API's shape
        ({"prompt": [1, 2], "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "model": "other"}, "model"),
    ]
    for body, param in here:
        with pytest.raises(ApiError) as info:
            plan_completion(CompletionRequest.model_validate(body), model, "r")
        assert info.value.param == param, body
    front_door = [  # the front door's refusals, named as the client spelled the field
        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", None),
        ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens", None),
        ({"prompt": [[5], [1, 99999]]}, "prompt[1]", None),
        ({"prompt": "x", "max_tokens": 5000}, "prompt", "context_length_exceeded"),
        (
            {
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "patternProperties": {"(": {}}}},
                },
            },
            "response_format.json_schema.schema",
            None,
        ),
        ({"prompt": "x", "structured_outputs": {"regex": "a("}}, "structured_outputs.regex", None),
    ]
    for body, param, code in front_door:
        plan = plan_completion(CompletionRequest.model_validate(body), model, "r")
        errors = []
        for c in plan.choices:
            try:
                _front_door(model, c.generate)
            except Invalid as e:
                errors.append(
                    from_upstream(e.code, e.field, str(e), c.prompt_param, plan.spelling.param)
                )
        assert errors, body
        assert (errors[0].status, errors[0].param, errors[0].code) == (400, param, code), body
        assert errors[0].message.startswith(param) or code, errors[0].message


async def test_a_bug_is_a_plain_500_and_an_http_error_event(model, tmp_path, monkeypatch):
    configure("http", tmp_path, stdout=False)
    from actors.runtime.events import get_logger

    log = get_logger()
    server = Server(
        model=model, upstream=Upstream("ipc:///nowhere", None, log), endpoints={}, log=log
    )

    def broken(name):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(model, "check_model", broken)
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "bug-1"})
        assert r.status_code == 500
        assert r.json() == {
            "error": {
                "message": "internal server error",
                "type": "internal_server_error",
                "param": None,
                "code": "internal_error",
            }
        }
        assert "secret" not in r.text and "Traceback" not in r.text
        monkeypatch.undo()
        down = await c.post("/v1/completions", json={"prompt": "hi"})
        assert down.status_code == 503  # no front door: named, not a 500
        assert "tokenizer" in down.json()["error"]["message"]
    events = [
        json.loads(line) for line in (tmp_path / "events" / "http.jsonl").read_text().splitlines()
    ]
    [err] = [e for e in events if e["event"] == "http.error"]
    assert err["request_id"] == "bug-1" and err["error"] == "RuntimeError"
    [resp] = [e for e in events if e["event"] == "http.response" and e["request_id"] == "bug-1"]
    assert resp["status"] == 500


async def test_the_key_guards_every_route_but_health(model, tmp_path):
    from actors.runtime.events import get_logger

    log = get_logger()
    server = Server(
        model=model,
        upstream=Upstream("ipc:///nowhere", None, log),
        endpoints={},
        log=log,
        api_key="k1",
    )
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        for path in ("/v1/models", "/version", "/metrics", "/nope"):
            r = await c.get(path)
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
            assert (await c.get(path, headers={"Authorization": "Bearer k2"})).status_code == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == model.served_name
        r = await c.post(
            "/detokenize", json={"tokens": [1, 2]}, headers={"Authorization": "bearer k1"}
        )
        assert r.status_code == 200
