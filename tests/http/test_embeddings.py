"""Embeddings: ``POST /v1/embeddings`` on a `minirt up --runner pooling`, driven by the official
`openai` client, equal to transformers' final hidden states pooled the same way (last token,
normalized: vLLM's default for a causal LM; mean over the prompt, across prefill chunks,
unnormalized), many inputs batched into the same steps, a prefix-cache hit giving the same
vector; the same over ZMQ (``params.pooling``); a generating server refuses embeddings and a
pooling one refuses generation, each naming ``--runner pooling``; nothing leaks."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from array import array
from pathlib import Path

import httpx
import openai
import pytest
import torch
import trio

from minirt.client import RequestError, open_client
from tests.support.http_server import random_ids, start_http_runtime
from tests.support.runtime import kv_stats, wait_until

TEXTS = [
    "The capital of France is Paris.",
    "Bees make honey.",
    "A recipe for bread needs only four things: flour, water, salt and yeast. Mix them, knead "
    "the dough until it is smooth, and leave it covered in a warm place until it has doubled.",
    "Rivers carry water from the mountains to the sea.",
]


def reference(model_dir: Path, prompts: list[list[int]], kind: str, normalize: bool) -> list:
    """transformers' final hidden states (after the last norm), pooled, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model.model(torch.tensor([ids])).last_hidden_state[0]
            v = h[-1] if kind == "last" else h.mean(dim=0)
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def close(got: list[float], want: torch.Tensor, tol: float) -> float:
    diff = (torch.tensor(got) - want).abs().max().item()
    assert len(got) == want.numel() and diff < tol, diff
    return diff


@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    """SmolLM2 served for embeddings with the defaults (last token, normalized), prompts in
    chunks of 16 tokens."""
    flags = ("--dtype", "float32", "--runner", "pooling", "--chunk-cap", "16")
    with start_http_runtime(smollm2, tmp_path_factory.mktemp("pool"), *flags) as h:
        yield h


def test_last_token_embeddings_equal_transformers_through_the_openai_client(smol, smollm2):
    from transformers import AutoTokenizer

    client = smol.client()
    ids = [AutoTokenizer.from_pretrained(smollm2)(t)["input_ids"] for t in TEXTS]
    want = reference(smollm2, ids, "last", normalize=True)
    got = client.embeddings.create(model=str(smollm2), input=TEXTS)  # base64, as it asks
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, w in zip(got.data, want, strict=True):
        close(d.embedding, w, 1e-4)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model=str(smollm2), input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in got.data]
    # token ids in, and the same text again (its full blocks are in the prefix cache now)
    again = client.embeddings.create(model=str(smollm2), input=ids[2])
    assert again.data[0].embedding == pytest.approx(got.data[2].embedding, abs=1e-5)
    raw = httpx.post(
        smol.base_url + "/embeddings",
        json={"input": TEXTS[0], "encoding_format": "base64", "unknown_field": 1},
        timeout=60,
    ).json()
    decoded = array("f", base64.b64decode(raw["data"][0]["embedding"])).tolist()
    assert decoded == got.data[0].embedding and raw["object"] == "list"


def test_a_pooling_server_refuses_generation_and_unsupported_fields(smol, smollm2):
    client = smol.client()
    for call in (
        lambda: client.completions.create(model=str(smollm2), prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(
            model=str(smollm2), messages=[{"role": "user", "content": "hi"}]
        ),
    ):
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            call()
    for body, param in (
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ):
        r = httpx.post(smol.base_url + "/embeddings", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.deadline(240)
async def test_mean_pooling_across_chunks_batched_over_http_and_zmq(tiny_model, tmp_path):
    pooler = json.dumps({"pooling_type": "MEAN", "normalize": False})
    flags = ("--runner", "pooling", "--pooler-config", pooler, "--chunk-cap", "8")
    prompts = random_ids(12, 9, 40, seed=7)  # every one in several chunks of 8
    want = reference(tiny_model, prompts, "mean", normalize=False)
    with start_http_runtime(tiny_model, tmp_path / "rt", *flags) as server:
        client = server.client()
        got = await trio.to_thread.run_sync(
            lambda: client.embeddings.create(model=str(tiny_model), input=prompts)
        )
        for d, w in zip(got.data, want, strict=True):
            close(d.embedding, w, 1e-4)
        steps = server.rt.events("executor.step")
        assert max(e["requests"] for e in steps) > 1  # inputs share steps, as prefills do
        # the request's own normalize overrides the server's
        unit = await trio.to_thread.run_sync(
            lambda: client.embeddings.create(
                model=str(tiny_model), input=prompts[0], extra_body={"normalize": True}
            )
        )
        close(unit.data[0].embedding, torch.nn.functional.normalize(want[0], dim=0), 1e-5)

        async with open_client(server.rt.endpoint) as zmq:
            r = await zmq.generate(prompt_ids=prompts[1], pooling="mean", normalize=False)
            close(r.embedding, want[1], 1e-4)
            with pytest.raises(RequestError, match="--runner pooling") as e:
                await zmq.generate(prompt_ids=prompts[1], max_tokens=2)
            assert e.value.field == "params.pooling"
            with pytest.raises(RequestError) as e:
                await zmq.generate(prompt_ids=prompts[1], pooling="cls")
            assert e.value.field == "params.pooling"

        async def clean():
            s = await kv_stats(server.rt)
            return s.check_ok and s.in_use == 0

        await wait_until(clean, timeout=15)


@pytest.mark.deadline(120)
async def test_a_generating_server_refuses_embeddings_naming_the_flag(tiny_model, tmp_path):
    with start_http_runtime(tiny_model, tmp_path / "rt") as server:
        r = await trio.to_thread.run_sync(
            lambda: httpx.post(server.base_url + "/embeddings", json={"input": "x"}, timeout=30)
        )
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
        async with open_client(server.rt.endpoint) as zmq:
            with pytest.raises(RequestError, match="--runner pooling") as e:
                await zmq.generate(prompt_ids=[5, 6, 7], pooling="last")
            assert e.value.field == "params.pooling"


def test_a_bad_pooler_config_stops_the_start_naming_the_key(tiny_model, tmp_path):
    bad = json.dumps({"pooling_type": "CLS"})
    argv = ["up", "--model", str(tiny_model), "--run-dir", str(tmp_path / "rt")]
    out = subprocess.run(
        [sys.executable, "-m", "minirt.cli", *argv, "--runner", "pooling", "--pooler-config", bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pooler_config.pooling_type" in out.stderr
