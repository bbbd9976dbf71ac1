"""End to end: real actor processes over ZeroMQ on a tiny model, checked against transformers."""

from __future__ import annotations

import random
import uuid

import pytest
import trio
import zmq

from actors.runtime.transport import open_socket
from messages.codec import Decoder
from messages.common import ErrorReply
from minirt.client import RequestError, open_client
from tests.support.runtime import hf_greedy, kv_stats, start_runtime, stopped, wait_until

MAX_NEW = 12


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def runtime(tiny_model, tmp_path_factory):
    flags = ("--num-blocks", "2048", "--chunk-cap", "16", "--step-budget", "64")
    with start_runtime(tiny_model, tmp_path_factory.mktemp("rt"), *flags) as rt:
        yield rt


async def run_all(endpoint: str, prompts: list[list[int]], max_tokens: int = MAX_NEW, **params):
    results: list = [None] * len(prompts)
    async with open_client(endpoint) as client:

        async def one(i: int) -> None:
            results[i] = await client.generate(
                prompt_ids=prompts[i], max_tokens=max_tokens, **params
            )

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return results


async def test_32_concurrent_requests_match_transformers(runtime, tiny_model):
    prompts = random_prompts(32, 1, 120, seed=1)
    results = await run_all(runtime.endpoint, prompts)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.token_ids == exp, f"request {i} (prompt {len(prompts[i])} tokens)"
        assert res.usage["prompt_tokens"] == len(prompts[i])
        assert res.usage["completion_tokens"] == len(exp)
        assert res.finish_reason in ("stop", "length")
    steps = runtime.events("executor.step")
    assert any(e["prefill_tokens"] and e["decode_tokens"] for e in steps), "no mixed step seen"


async def test_shared_prefix_hits_cache_and_stays_exact(runtime, tiny_model):
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    first = [*shared, 11, 12, 13]
    second = [*shared, 21, 22, 23, 24, 25]
    [a] = await run_all(runtime.endpoint, [first])
    [b] = await run_all(runtime.endpoint, [second])
    matched = runtime.events("prefix.matched", request_id=b.request_id)
    assert matched and matched[0]["cached_tokens"] == 48
    assert b.usage["cached_tokens"] == 48
    assert [a.token_ids, b.token_ids] == hf_greedy(tiny_model, [first, second], MAX_NEW)


async def test_bad_frames_get_protocol_error_and_actors_keep_serving(runtime):
    ctx = zmq.Context.instance()
    decoder: Decoder = Decoder(ErrorReply)
    for actor in ("tokenizer", "scheduler", "kv_manager", "executor", "client"):
        endpoint = runtime.endpoint if actor == "client" else runtime.actor_endpoint(actor)
        sock = open_socket(ctx, zmq.DEALER, connect=[endpoint])
        try:
            for frame in (b"\xc1garbage", b"\x81\xa1t\xa7unknown", b"\x92\x01\x02"):
                await sock.send([frame])
                with trio.fail_after(5):
                    reply = decoder.decode((await sock.recv())[-1])
                assert reply.code == "bad_frame", (actor, reply)
        finally:
            sock.close()
    errors = runtime.events("protocol.error")
    assert {e["actor"] for e in errors} >= {"tokenizer", "scheduler", "kv_manager", "executor"}
    [res] = await run_all(runtime.endpoint, [[5, 6, 7]])
    assert len(res.token_ids) >= 1


async def test_invalid_request_names_the_field(runtime):
    async with open_client(runtime.endpoint) as client:
        cases = [
            (dict(prompt_ids=[1, 2, 10**6]), "prompt_ids"),
            (dict(prompt_ids=[1, 2], max_tokens=0), "params.max_tokens"),
            (dict(prompt_ids=[1, 2], temperature=float("nan")), "params.temperature"),
            (dict(prompt_ids=[1, 2], top_p=2.0), "params.top_p"),
            (dict(prompt=""), "prompt"),
            (dict(prompt_ids=[1] * 5000), "prompt"),
        ]
        for kwargs, field in cases:
            with pytest.raises(RequestError) as info:
                await client.generate(**kwargs)
            assert info.value.field == field, (kwargs, info.value)


def _of(events: list[dict], actor: str, rid: str) -> list[dict]:
    """``actor``'s events about the client's request ``rid`` (the runtime may scope the ids it
    uses inside, so match on the client's id being part of them)."""
    return [e for e in events if e.get("actor") == actor and rid in str(e.get("request_id", ""))]


async def test_abort_and_disconnect_free_every_block(runtime):
    prompts = random_prompts(4, 20, 40, seed=3)
    tag = uuid.uuid4().hex[:8]
    cancelled, vanished = f"cancel-{tag}", f"vanish-{tag}"

    def admitted(rid: str) -> bool:
        return bool(_of(runtime.events("request.admitted"), "scheduler", rid))

    # the executor is stopped while each client leaves: its request is admitted (it holds
    # blocks) and cannot end first, however fast the model or loaded the machine
    with stopped(runtime, "executor"):
        async with open_client(runtime.endpoint) as client:
            stream = client.stream(
                prompt_ids=prompts[0], max_tokens=900, ignore_eos=True, request_id=cancelled
            )
            async for _ in stream:  # accepted
                break
            await wait_until(lambda: admitted(cancelled), timeout=15)
            await stream.aclose()  # leaving the stream cancels the request
    # a client that vanishes mid-request (the executor runs in between: the first abort ends)
    with stopped(runtime, "executor"):
        async with open_client(runtime.endpoint) as client:
            # the stream is kept: an abandoned one is finalized at the next checkpoint, which
            # cancels its request (a "cancel", not the "disconnect" this case is about)
            stream = client.stream(
                prompt_ids=prompts[1], max_tokens=900, ignore_eos=True, request_id=vanished
            )
            async for _ in stream:
                break
            await wait_until(lambda: admitted(vanished), timeout=15)
            client.close()  # gone without a word: a closed connection sends no cancel
            await stream.aclose()

    def aborted_by_scheduler() -> bool:  # the scheduler's event, once per request
        evs = runtime.events("request.aborted")
        return all(_of(evs, "scheduler", rid) for rid in (cancelled, vanished))

    await wait_until(aborted_by_scheduler, timeout=15)

    async def drained():
        s = await kv_stats(runtime)
        return s.in_use == 0 and s.running == 0 and s.check_ok

    await wait_until(drained, timeout=15)
    aborted = runtime.events("request.aborted")
    assert [e["reason"] for e in _of(aborted, "scheduler", cancelled)] == ["cancel"]
    assert [e["reason"] for e in _of(aborted, "scheduler", vanished)] == ["disconnect"]
    # both were stopped while admitted and their blocks dropped, neither ran on to the end
    released = runtime.events("kv.released")
    for rid in (cancelled, vanished):
        assert [e["reason"] for e in _of(released, "kv_manager", rid)] == ["aborted"], rid
        assert not _of(runtime.events("request.finished"), "scheduler", rid), rid


async def test_stop_string_ends_request(runtime, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = random_prompts(1, 10, 20, seed=5)[0]
    [full] = await run_all(runtime.endpoint, [prompt], max_tokens=24, ignore_eos=True)
    text = tok.decode(full.token_ids, skip_special_tokens=True)
    assert full.text == text
    # a 3-character stop string from the middle of the text on (else from its start) that is
    # not all whitespace: the greedy run is deterministic, so there must be one, never a skip
    mid = len(text) // 2
    starts = [*range(mid, len(text) - 2), *range(0, mid)]
    stop = next((text[i : i + 3] for i in starts if text[i : i + 3].strip()), "")
    assert stop, f"the model generated no text to stop on: {text!r}"
    async with open_client(runtime.endpoint) as client:
        res = await client.generate(prompt_ids=prompt, max_tokens=24, ignore_eos=True, stop=[stop])
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == text[: text.index(stop)]


@pytest.mark.deadline(240)
async def test_small_pool_refuses_then_admits_with_evictions(tiny_model, tmp_path):
    # 24 blocks of 16 = 384 tokens; each request reserves prompt + max_tokens - 1 up front (the
    # last token is never fed back) and is never grown past that.
    prompts = random_prompts(10, 60, 100, seed=11)
    with start_runtime(
        tiny_model, tmp_path / "rt", "--num-blocks", "24", "--kv-mode", "full"
    ) as rt:
        results = await run_all(rt.endpoint, prompts)
        assert rt.events("admission.refused"), "the pool was never short"
        assert rt.events("kv.evicted"), "nothing was evicted"
        assert not rt.events("kv.extended"), "a full reservation grew"
        expected = hf_greedy(tiny_model, prompts, MAX_NEW)
        assert [r.token_ids for r in results] == expected
        s = await wait_until(lambda: kv_stats(rt))
        assert s.check_ok and s.in_use == 0


@pytest.mark.deadline(240)
async def test_decode_shortage_preempts_and_stays_exact(tiny_model, tmp_path):
    # 12 blocks; prompts of 40 tokens (3 blocks) grow to 40 + 100 = 140 tokens (9 blocks) each:
    # one fits alone, two running together cannot both finish without a preemption.
    prompts = random_prompts(4, 40, 40, seed=13)
    flags = ("--num-blocks", "12", "--kv-mode", "on_demand")
    with start_runtime(tiny_model, tmp_path / "rt", *flags) as rt:
        results = await run_all(rt.endpoint, prompts, max_tokens=100, ignore_eos=True)
        preempted = [e for e in rt.events("request.preempted") if e["actor"] == "scheduler"]
        assert preempted, "no preemption happened"
        expected = hf_greedy(tiny_model, prompts, 100, ignore_eos=True)
        assert [r.token_ids for r in results] == expected
        assert any(r.preemptions for r in results)
        s = await wait_until(lambda: kv_stats(rt))
        assert s.check_ok and s.in_use == 0


async def test_handshake_refuses_a_protocol_version_mismatch(runtime):
    from messages import client as cm
    from messages.common import PROTOCOL_VERSION, Hello, HelloAck
    from tests.support.runtime import query

    bad = Hello(actor="test", version=PROTOCOL_VERSION + 1)
    welcome = await query(runtime.endpoint, bad, cm.Welcome)
    assert not welcome.ok and "not supported" in welcome.reason
    ack = await query(runtime.actor_endpoint("scheduler"), bad, HelloAck)
    assert not ack.ok and str(PROTOCOL_VERSION) in ack.reason
    assert any(e.get("code") == "version_mismatch" for e in runtime.events("protocol.error"))
    [res] = await run_all(runtime.endpoint, [[9, 8, 7]])
    assert res.token_ids
