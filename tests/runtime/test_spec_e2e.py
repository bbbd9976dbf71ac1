"""Speculative decoding end to end: `minirt up --speculative-config` on real actor processes,
with a KV pool small enough that requests are preempted; greedy outputs stay those of
transformers, drafts are accepted, vLLM's spec-decode counters count them, and the pool is whole
afterwards."""

from __future__ import annotations

import json
import random
import re

import pytest
import trio

from messages.common import StructuredOutput
from messages.scheduler import MetricsQuery, MetricsText
from minirt.client import open_client
from tests.support.runtime import hf_greedy, kv_stats, query, start_runtime, wait_until

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
MAX_NEW = 40


@pytest.fixture(scope="module")
def runtime(tiny_model, tmp_path_factory):
    flags = (
        "--num-blocks", "80", "--chunk-cap", "32", "--step-budget", "128",
        "--speculative-config", json.dumps(SPEC),
        # drafts priced flat in steps of up to 64 rows, not on forwards timed at
        # start: whether drafts run must not hang on the machine's speed at that moment
        "--spec-max-rows", "64",
    )  # fmt: skip
    with start_runtime(tiny_model, tmp_path_factory.mktemp("spec"), *flags) as rt:
        yield rt


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (what prompt lookup drafts from), of varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(3, 8))]
        out.append((motif * 12)[: rng.randint(30, 70)])
    return out


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


async def test_speculating_runtime_is_exact_under_preemption(runtime, tiny_model):
    prompts = _prompts(16, seed=3)
    results: list = [None] * len(prompts)
    async with open_client(runtime.endpoint) as client:

        async def one(i: int) -> None:
            results[i] = await client.generate(
                prompt_ids=prompts[i], max_tokens=MAX_NEW, temperature=0
            )

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.token_ids == exp, f"request {i}"
    steps = runtime.events("executor.step")
    accepted = sum(e.get("spec_accepted", 0) for e in steps)
    assert accepted > 0, "no draft was accepted"
    assert sum(e.get("spec_draft_tokens", 0) for e in steps) >= accepted
    text = (await query(runtime.actor_endpoint("scheduler"), MetricsQuery(), MetricsText)).text
    assert _counter(text, "vllm:spec_decode_num_accepted_tokens_total") > 0
    drafts = _counter(text, "vllm:spec_decode_num_draft_tokens_total")
    assert drafts >= _counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert _counter(text, "vllm:spec_decode_num_drafts_total") > 0
    # every block back in the pool or the prefix cache; the KV manager's own check passes
    stats = await wait_until(lambda: _idle(runtime), timeout=30)
    assert stats.in_use == 0
    # 16 requests of up to 110 tokens (7 blocks) do not fit 80 blocks: some were preempted
    assert runtime.events("request.preempted")


async def _idle(runtime):
    s = await kv_stats(runtime)
    return s if s.in_use == 0 else None


async def test_structured_requests_speculate_through_the_runtime(runtime):
    """A constrained request speculates within its grammar end to end (the front door compiles
    the constraint, the executor drafts what the grammar accepts): a grammar that repeats itself
    gets drafts accepted, and every answer matches its grammar."""
    pattern = r"(ab-){12}end"
    reqs = [
        dict(prompt_ids=p, max_tokens=64, temperature=t, seed=i, request_id=f"rx-{i}")
        for i, (p, t) in enumerate(zip(_prompts(4, seed=9), (0.0, 0.0, 1.0, 0.7), strict=True))
    ]
    results: dict = {}
    async with open_client(runtime.endpoint) as client:

        async def one(r: dict) -> None:
            results[r["request_id"]] = await client.generate(
                **r, structured=StructuredOutput(regex=pattern)
            )

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for r in reqs:
                    nursery.start_soon(one, r)
    for rid, res in results.items():
        assert res.finish_reason == "stop" and re.fullmatch(pattern, res.text), (rid, res.text)
    sped: dict[str, int] = {}
    for e in runtime.events("executor.step"):
        for rid, _, acc in e.get("spec") or []:
            rid = rid.split("@")[0]  # the executor's id: the request's, then its run's
            sped[rid] = sped.get(rid, 0) + acc
    assert all(sped.get(f"rx-{i}", 0) > 0 for i in range(4)), sped
    stats = await wait_until(lambda: _idle(runtime), timeout=30)
    assert stats.in_use == 0
