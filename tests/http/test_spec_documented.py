"""Speculative decoding as users configure it: vLLM's documented n-gram example (k 4, lookup 4
down to 1) on SmolLM2 through the OpenAI API, one request at a time, drafts priced on the
forwards the server timed at start (no ``--spec-max-rows``). A request that copies its prompt
verifies drafts and has them accepted (vLLM's counters move; fewer forward passes than
tokens), greedy and seeded sampling alike; greedy answers are transformers' own; each step
says why its other decodes verified none, and the replay of the run carries its explorations.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from minirt.replay import sim, stepmodel, workload
from tests.support.http_server import hf_chat_ids, start_http_runtime
from tests.support.runtime import hf_greedy

DOCUMENTED = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
N = 48


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    flags = ("--dtype", "float32", "--speculative-config", json.dumps(DOCUMENTED))
    with start_http_runtime(smollm2, tmp_path_factory.mktemp("spec"), *flags) as h:
        yield h


def _quote_prompt(served) -> list[int]:
    from pydoc_data.topics import topics

    text = " ".join(topics["assignment"].split()[:90])
    ask = [{"role": "user", "content": f"Quote this passage back exactly:\n\n{text}"}]
    return hf_chat_ids(served.model, ask)


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total ([0-9.e+]+)$", text, re.M)
        assert m, f"vllm:spec_decode_{name}_total not exported"
        out[name] = float(m.group(1))
    return out


def test_documented_settings_speculate_one_request_at_a_time(served):
    prompt = _quote_prompt(served)
    client = served.client()
    before = _counters(served.url)
    greedy = client.completions.create(
        model=str(served.model), prompt=prompt, max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after_greedy = _counters(served.url)
    sampled = [
        client.completions.create(
            model=str(served.model), prompt=prompt, max_tokens=N, temperature=0.7, seed=11,
            extra_body={"ignore_eos": True},
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    after = _counters(served.url)
    for a, b in ((before, after_greedy), (after_greedy, after)):  # greedy, then sampled
        assert b["num_drafts"] > a["num_drafts"], "no drafts verified"
        assert b["num_accepted_tokens"] > a["num_accepted_tokens"], "no draft accepted"
    assert sampled[0] == sampled[1]  # a seeded request's tokens do not depend on its drafts
    (want,) = hf_greedy(served.model, [prompt], N, ignore_eos=True)
    tok = AutoTokenizer.from_pretrained(served.model)
    assert greedy.choices[0].text == tok.decode(want, skip_special_tokens=True)

    rec = workload.load(served.rt.run_dir)
    tokens = sum(r["completion_tokens"] for r in rec.records)
    assert tokens == 3 * N
    assert len(rec.steps) < tokens - 10, "as many forward passes as tokens: nothing accepted"
    spec_steps = [e for e in rec.steps if "spec_why" in e]
    assert spec_steps and all(
        sum(e["spec_why"].values()) == e["decode_tokens"] - e["spec_drafts"] for e in spec_steps
    )  # every decode that verified none has its reason
    # the replay verifies each recorded step's drafts, explorations as explorations
    res = sim.replay(rec, stepmodel.fit(rec.steps))

    def explored(events) -> int:
        return sum(len(e.get("spec_explore", ())) for e in events if e["event"] == "executor.step")

    assert explored(res.events) == explored(rec.steps)
