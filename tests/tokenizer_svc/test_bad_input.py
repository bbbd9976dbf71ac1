"""Bad input on every socket: random bytes, wrong shapes and types, unknown tags, oversize frames and
out-of-range values. Each gets a clear error (or is dropped and logged); no actor dies; valid
requests sent alongside still finish exactly; nothing leaks."""

from __future__ import annotations

import collections
import math

import msgpack
import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.codec import BadFrame, Decoder
from messages.common import ErrorReply
from messages.executor import ExecutorInbound
from messages.kv import KVInbound
from messages.scheduler import SchedulerInbound
from messages.tokenizer import FromClient, TokenizerInbound
from minirt.client import RequestError, open_client
from tests.support.runtime import hf_greedy, kv_stats, start_runtime, wait_until

ACTORS = ("tokenizer", "scheduler", "kv_manager", "executor")
TAGS = [
    "hello",
    "ping",
    "generate",
    "cancel",
    "tokens",
    "admitted",
    "failed",
    "submit",
    "abort",
    "admit_result",
    "shortage",
    "freed",
    "done",
    "completed",
    "kv_admit",
    "kv_grow",
    "kv_cache_prefix",
    "kv_finish",
    "kv_release",
    "kv_match",
    "kv_stats",
    "x_run",
    "x_extend",
    "x_preempt",
    "x_stop",
    "x_stats",
    "nope",
    "",
]
MAX_MSG = 1 << 20


@pytest.fixture(scope="module")
def rt(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    cfg = d / "minirt.toml"
    cfg.write_text(f"max_msg_size = {MAX_MSG}\n")
    with start_runtime(
        tiny_model, d / "rt", "--config", str(cfg), "--num-blocks", "256"
    ) as runtime:
        yield runtime


junk_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
frames = st.one_of(
    st.binary(max_size=200),  # random bytes
    junk_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),  # msgpack of any shape
    st.builds(  # a known or unknown tag with junk fields
        lambda tag, fields: msgpack.packb({"t": tag, **fields}, use_bin_type=True),
        st.sampled_from(TAGS),
        st.dictionaries(
            st.sampled_from(
                [
                    "request_id",
                    "attempt",
                    "token_ids",
                    "prompt_ids",
                    "params",
                    "blocks",
                    "events",
                    "x",
                    "version",
                    "actor",
                ]
            ),
            junk_values,
            max_size=4,
        ),
    ),
)


def _ask(endpoint: str, frame: bytes, timeout_ms: int = 3000):
    """Send one frame on a fresh connection; the decoded reply or None."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(frame)
        if not s.poll(timeout_ms):
            return None
        return s.recv()
    finally:
        s.close(linger=0)


RECEIVERS = {
    "tokenizer": TokenizerInbound,
    "scheduler": SchedulerInbound,
    "kv_manager": KVInbound,
    "executor": ExecutorInbound,
    "client": FromClient,
}


def _decodes(target: str, frame: bytes) -> bool:
    """Whether ``frame`` is a valid message for ``target`` (its typed union)."""
    try:
        Decoder(RECEIVERS[target]).decode(frame)
    except BadFrame:
        return False
    return True


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frame=frames, target=st.sampled_from((*ACTORS, "client")))
def test_fuzzed_frames_get_errors_and_actors_survive(rt, frame, target):
    endpoint = rt.endpoint if target == "client" else rt.actor_endpoint(target)
    reply = _ask(endpoint, frame)
    if not _decodes(target, frame):
        # a frame the receiver cannot decode is always answered, with a typed error
        assert reply is not None, f"{target} did not answer a bad frame"
        msg = msgpack.unpackb(reply, raw=False)
        assert msg["t"] == "error" and msg["code"] == "bad_frame" and msg["message"], msg
    elif reply is not None:
        # a well-formed one (e.g. a ping) gets its normal answer; a stray but valid internal
        # message may be ignored (no reply)
        msg = msgpack.unpackb(reply, raw=False)
        assert isinstance(msg, dict) and "t" in msg
        if msg["t"] == "error":
            assert (
                msg["code"] in ("bad_frame", "invalid", "too_long", "internal") and msg["message"]
            )
    # and the receiver is alive: it answers a ping
    pong = _ask(endpoint, msgpack.packb({"t": "ping", "nonce": 7}))
    assert pong is not None, f"{target} stopped answering"
    answer = msgpack.unpackb(pong, raw=False)
    assert answer["t"] == "pong" and answer["nonce"] == 7, answer


def _generate_error(rt, **kwargs) -> RequestError:
    async def go():
        async with open_client(rt.endpoint) as c:
            with pytest.raises(RequestError) as info:
                await c.generate(**kwargs)
            return info.value

    return trio.run(go)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt_ids=[1, 2], max_tokens=-1), "params.max_tokens"),
        (dict(prompt_ids=[1, 2], temperature=math.nan), "params.temperature"),
        (dict(prompt_ids=[1, 2], top_p=2.0), "params.top_p"),
        (dict(prompt_ids=[1, 2], top_k=-3), "params.top_k"),
        (dict(prompt_ids=[1, 2], min_p=1.5), "params.min_p"),
        (dict(prompt_ids=[1, 2], logprobs=99), "params.logprobs"),
        (dict(prompt_ids=[1, 2, 10**9]), "prompt_ids"),
        (dict(prompt_ids=[-1]), "prompt_ids"),
        (dict(prompt_ids=[]), "prompt_ids"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="x " * 5000), "prompt"),
        (dict(prompt_ids=[1] * 1000, max_tokens=100), "params.max_tokens"),
        (dict(prompt="hi", stop=[""]), "stop"),
        (dict(prompt="hi", cache_salt="s" * 257), "cache_salt"),
        (dict(messages=[]), "messages"),
        (dict(prompt_ids=[1, 2], presence_penalty=2.5), "params.presence_penalty"),
        (dict(prompt_ids=[1, 2], repetition_penalty=0.0), "params.repetition_penalty"),
        (dict(prompt_ids=[1, 2], logit_bias={10**6: 1.0}), "params.logit_bias"),
        (dict(prompt_ids=[1, 2], logit_bias={5: 100.5}), "params.logit_bias"),
        (dict(prompt_ids=[1, 2], max_tokens=4, min_tokens=5), "params.min_tokens"),
        (dict(prompt_ids=[1, 2], structured={"regex": "a("}), "params.structured.regex"),
    ],
)
def test_out_of_range_values_name_the_field(rt, kwargs, field):
    err = _generate_error(rt, **kwargs)
    assert err.field == field, err
    assert err.code in ("invalid", "too_long")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"params": {"bogus": 1}}, "params.bogus"),
        ({"bogus": 1}, "bogus"),
        ({"prompt_ids": "1,2,3"}, "prompt_ids"),
        ({"params": {"max_tokens": "many"}}, "params.max_tokens"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"tools": [{"name": "f", "bogus": 1}]}, "tools[0].bogus"),
    ],
)
def test_a_generate_that_fails_decoding_names_the_field_and_its_request(rt, fields, field):
    """A client with many requests in flight can tell which one failed, and why."""
    frame = msgpack.packb({"t": "generate", "request_id": "req-7", **fields})
    reply = Decoder(ErrorReply).decode(_ask(rt.endpoint, frame))
    assert (reply.code, reply.field, reply.request_id) == ("bad_frame", field, "req-7"), reply


_HI = [{"role": "user", "content": "hi"}]
_F = {
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [{"name": "f", "parameters": {"type": 5}}]}, "tools[0].parameters"),
        ({"tools": [{"name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"tools": [_F, _F]}, "tools[1].name"),
        ({"tools": [_F], "tool_choice": "g"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        (
            {"messages": [*_HI, {"role": "tool", "content": "x", "tool_call_id": "c9"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *_HI,
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"id": "c", "name": "f", "arguments": "{oops"}],
                    },
                ]
            },
            "messages[1].tool_calls[0].arguments",
        ),
        ({"prompt": "hi", "messages": None, "tools": [_F]}, "tools"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(rt, fields, field):
    """Tools are checked at the front door, for ZeroMQ clients as for HTTP."""
    body = {"t": "generate", "request_id": "t-1", "messages": _HI, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    reply = Decoder(ErrorReply).decode(_ask(rt.endpoint, msgpack.packb(body)))
    assert (reply.code, reply.field, reply.request_id) == ("invalid", field, "t-1"), reply


def test_a_required_tool_call_over_zeromq(rt):
    """A ZeroMQ client gets the model's text; a required call in it is one the parser the
    front door names reads back, valid against the tool's schema."""
    import json

    import jsonschema

    from tokenizer_svc.agent.parse import OutputParser

    async def go():
        async with open_client(rt.endpoint) as c:
            return await c.generate(
                messages=_HI,
                tools=[_F],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=60,
                temperature=1.0,
                seed=1,
            )

    out = trio.run(go)
    p = OutputParser("hermes")
    p.feed(out.text)
    [call] = p.parsed(final=True).calls
    assert call.name == "f" and out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(call.arguments), _F["parameters"])


def test_invalid_utf8_and_wrong_types_are_bad_frames(rt):
    dec: Decoder = Decoder(ErrorReply)
    bad_utf8 = b"\x82\xa1t\xa8generate\xa6prompt\xa3\xff\xfe\xfd"
    wrong_type = msgpack.packb({"t": "generate", "prompt_ids": "1,2,3"})
    for frame, field in ((bad_utf8, None), (wrong_type, "prompt_ids")):
        reply = dec.decode(_ask(rt.endpoint, frame))
        assert reply.code == "bad_frame"
        if field:
            assert reply.field == field


def test_oversize_frames_are_stopped_by_the_socket_limit(rt):
    for target in (*ACTORS, "client"):
        endpoint = rt.endpoint if target == "client" else rt.actor_endpoint(target)
        assert _ask(endpoint, b"\x00" * (MAX_MSG + 1), timeout_ms=1000) is None  # dropped by ZMQ


def test_actors_survived_and_valid_requests_still_exact(rt, tiny_model):
    def logged() -> collections.Counter:
        return collections.Counter(
            (e["actor"], e.get("socket")) for e in rt.events("protocol.error")
        )

    # one bad frame on every socket: each is answered and logged by the actor that got it
    before = logged()
    sockets = [(a, rt.actor_endpoint(a), "inbox") for a in ACTORS]
    sockets.append(("tokenizer", rt.endpoint, "client"))
    for actor, endpoint, _ in sockets:
        reply = _ask(endpoint, b"\xc1 not msgpack")
        assert reply is not None and Decoder(ErrorReply).decode(reply).code == "bad_frame", actor

    def all_logged():
        now = logged()
        return all(now[(a, sock)] > before[(a, sock)] for a, _, sock in sockets)

    trio.run(wait_until, all_logged, 10)

    prompts = [[7, 8, 9, 10], [11, 12], list(range(20, 60))]

    async def go():
        async with open_client(rt.endpoint) as c:
            return [await c.generate(prompt_ids=p, max_tokens=8) for p in prompts]

    results = trio.run(go)
    assert [r.token_ids for r in results] == hf_greedy(tiny_model, prompts, 8)
    for actor in ACTORS:
        starts = [e for e in rt.events("actor.started") if e["actor"] == actor]
        assert len(starts) == 1, f"{actor} restarted"

    async def clean():
        s = await kv_stats(rt)
        return s.check_ok and s.in_use == 0

    trio.run(wait_until, clean, 15)
