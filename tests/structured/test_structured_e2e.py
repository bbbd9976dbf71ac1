"""Structured output end to end, through the ZMQ client against real actor processes: answers
parse and validate, bad constraints are refused naming the field before queuing, the runtime
keeps serving and no KV block leaks; a preempted constrained request still validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import trio

from messages.common import StructuredOutput
from minirt.client import RequestError, open_client
from tests.structured.test_structured import SCHEMAS, _prompt
from tests.support.runtime import kv_stats, start_runtime, wait_until


@pytest.fixture(scope="module")
def runtime(tiny_model, tmp_path_factory):
    flags = ("--num-blocks", "2048", "--chunk-cap", "32", "--step-budget", "256")
    with start_runtime(tiny_model, tmp_path_factory.mktemp("rt"), *flags) as rt:
        yield rt


async def _all(endpoint: str, requests: list[dict]) -> list:
    results: list = [None] * len(requests)
    async with open_client(endpoint) as client:

        async def one(i: int) -> None:
            results[i] = await client.generate(**requests[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
    return results


async def _drained(rt) -> None:
    async def idle():
        s = await kv_stats(rt)
        return s.in_use == 0 and s.running == 0 and s.check_ok

    await wait_until(idle, timeout=15)


async def test_schemas_regex_and_choice_through_the_zmq_client(runtime):
    reqs = [
        dict(
            prompt_ids=_prompt(i),
            max_tokens=256,
            temperature=1.0 if i % 2 else 0.0,
            seed=i,
            structured=StructuredOutput(json_schema=SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(20)
    ]
    reqs += [
        dict(
            prompt="hello", max_tokens=32, structured=StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}")
        ),
        dict(prompt="pick", max_tokens=32, structured=StructuredOutput(choice=["left", "right"])),
        dict(prompt="free text", max_tokens=8),  # an unconstrained neighbour
    ]
    results = await _all(runtime.endpoint, reqs)
    for i, res in enumerate(results[:20]):
        assert res.finish_reason == "stop", (i, res.text)
        jsonschema.validate(json.loads(res.text), SCHEMAS[i % len(SCHEMAS)])
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", results[20].text)
    assert results[21].text in ("left", "right")
    assert results[22].finish_reason in ("stop", "length")
    compiled = runtime.events("executor.structured_compiled")
    assert False in {e["cache_hit"] for e in compiled}  # 7 distinct among 22 constrained
    assert len({e["hash"] for e in compiled}) == len(SCHEMAS) + 2
    # (requests that arrive together may all start before the cache holds their constraint);
    # one that comes later finds it in the cache
    [again] = await _all(runtime.endpoint, [dict(reqs[0], seed=99)])
    jsonschema.validate(json.loads(again.text), SCHEMAS[0])
    assert runtime.events("executor.structured_compiled")[-1]["cache_hit"] is True
    steps = [e for e in runtime.events("executor.step") if e.get("constrained")]
    assert steps and all("mask_s" in e for e in steps)
    await _drained(runtime)


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        (
            StructuredOutput(json_schema={"type": "string", "not": {"const": "x"}}),
            "params.structured.json_schema",
        ),
        (
            StructuredOutput(json_schema={"type": "integer", "minimum": 3, "maximum": 1}),
            "params.structured.json_schema",
        ),
        (StructuredOutput(regex="(unclosed"), "params.structured.regex"),
        (StructuredOutput(grammar="root ::= ("), "params.structured.grammar"),
        (StructuredOutput(choice=[]), "params.structured.choice"),
        (StructuredOutput(regex="a", choice=["a"]), "params.structured"),
    ],
)
async def test_bad_constraints_are_refused_before_queuing(runtime, structured, field):
    async with open_client(runtime.endpoint) as client:
        with pytest.raises(RequestError) as info:
            await client.generate(prompt="x", max_tokens=8, structured=structured)
        assert info.value.code == "invalid" and info.value.field == field, info.value
        ok = await client.generate(
            prompt="x", max_tokens=8, structured=StructuredOutput(choice=["ok"])
        )
        assert ok.text == "ok"
    rid = info.value.request_id
    assert rid and not runtime.events("request.queued", request_id=rid)  # refused at the door
    await _drained(runtime)


@pytest.mark.deadline(240)
async def test_preempted_constrained_requests_still_validate(tiny_model, tmp_path):
    schema = {
        "type": "array",
        "items": {"type": "string", "minLength": 3, "maxLength": 6},
        "minItems": 12,
        "maxItems": 12,
    }
    flags = ("--num-blocks", "14", "--kv-mode", "on_demand")
    reqs = [
        dict(
            prompt_ids=[(7 * i + 13 * j) % 500 + 3 for j in range(40)],
            max_tokens=150,
            structured=StructuredOutput(json_schema=schema),
        )
        for i in range(4)
    ]
    with start_runtime(tiny_model, tmp_path / "rt", *flags) as rt:
        results = await _all(rt.endpoint, reqs)
        assert [e for e in rt.events("request.preempted") if e["actor"] == "scheduler"]
        assert any(r.preemptions for r in results)
        for r in results:
            assert r.finish_reason == "stop", r.text
            jsonschema.validate(json.loads(r.text), schema)
        await _drained(rt)
