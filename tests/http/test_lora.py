"""Multi-LoRA: `minirt up --enable-lora` on SmolLM2 (float32) with random-factor PEFT adapters of
rank 8 and 16 on all seven linears (made with ``peft`` here, nothing downloaded), driven by the
official ``openai`` client and over ZMQ.

Each request, whatever its neighbours in a step run with (three adapters and the base model in
one batch), gets token for token what transformers + ``PeftModel`` give it alone; speculative
decoding (n-gram drafts verified with the adapter) and structured output work with adapters;
adapters load and unload at run time (vLLM's routes), ``/v1/models`` lists them with their base
as parent; an adapter of the wrong rank, modules or base is refused naming the field; the prefix
cache never shares KV across adapters; the executor's bounded cache evicts and reloads; a server
without ``--enable-lora`` refuses all of it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from actors.runtime.config import RuntimeConfig
from minirt.client import RequestError, open_client
from tests.support.http_server import start_http_runtime
from tests.support.lora import make_adapter, peft_greedy
from tests.support.runtime import kv_stats, start_runtime

N = 12  # new tokens per request
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
TEXTS = [
    "The capital of France is",
    "one two three four one two three four one two three four one two",  # drafts from itself
]


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(smollm2, d / "a", 8, 1),
        "b": make_adapter(smollm2, d / "b", 16, 2),
        "c": make_adapter(smollm2, d / "c", 8, 3),
        "d": make_adapter(smollm2, d / "d", 16, 4, targets=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(smollm2)
    return [list(tok(t)["input_ids"]) for t in TEXTS]


@pytest.fixture(scope="module")
def want(smollm2, adapters, prompts) -> dict[str, list[list[int]]]:
    """PEFT's greedy tokens per model name ("": the base), each prompt alone."""
    out = {"": peft_greedy(smollm2, None, prompts, N)}
    for name, path in adapters.items():
        out[name] = peft_greedy(smollm2, path, prompts, N)
    assert all(out[n] != out[""] for n in adapters)  # the adapters change the answers
    return out


@pytest.fixture(scope="module")
def served(smollm2, adapters, tmp_path_factory):
    flags = (
        "--dtype", "float32",
        "--enable-lora",
        "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
        "--max-loras", "3",
        "--max-lora-rank", "16",
        "--max-cpu-loras", "3",
        "--speculative-config", json.dumps(SPEC),
        "--spec-max-rows", "64",  # drafts in every step (not priced on timed forwards)
    )  # fmt: skip
    with start_http_runtime(smollm2, tmp_path_factory.mktemp("lora"), *flags) as h:
        yield h


def complete(h, model: str, ids: list[int], **kw) -> openai.types.Completion:
    return h.client().completions.create(
        model=model, prompt=ids, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}, **kw
    )


def load(h, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(h.url + "/v1/load_lora_adapter", json=body, timeout=60)


def test_a_batch_of_three_adapters_and_the_base_gives_each_row_its_own(
    served, want, prompts, adapters
):
    """Loaded at run time, ``c`` joins ``a`` and ``b`` from the start: eight requests (two
    prompts under each of three adapters and the base) sent at once share steps, and each gets
    PEFT's tokens for its own adapter; one drafts from its prompt, verified with its adapter."""
    r = load(served, "c", adapters["c"])
    assert r.status_code == 200, r.text
    assert "added successfully" in r.text
    base = str(served.model)
    jobs = [(m, i) for m in ("", "a", "b", "c") for i in range(len(prompts))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = list(pool.map(lambda j: complete(served, j[0] or base, prompts[j[1]]), jobs))
    tok = AutoTokenizer.from_pretrained(served.model)
    for (m, i), res in zip(jobs, done, strict=True):
        assert res.choices[0].text == tok.decode(want[m][i], skip_special_tokens=True), (
            m or "base",
            i,
        )
    steps = served.rt.events("executor.step")
    assert max(e.get("loras", 0) for e in steps) == 3  # three adapters in one step
    mixed = [e for e in steps if e.get("loras") == 3 and e["requests"] > 3]
    assert mixed, "the base model's rows never shared a step with three adapters"
    assert sum(e.get("spec_accepted", 0) for e in steps if e.get("loras")) > 0
    used = {e.get("lora") for e in served.rt.events("executor.running")}
    assert {"a", "b", "c", None} <= used


def test_structured_output_with_an_adapter(served):
    res = served.client().completions.create(
        model="a",
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert res.choices[0].text in ("yes", "no", "maybe")
    assert res.model == "a"


def test_models_lists_the_adapters_with_their_base_as_parent(served, adapters):
    data = httpx.get(served.url + "/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in data}
    base = data[0]["id"]
    assert by_id[base]["parent"] is None
    for name in ("a", "b"):
        assert by_id[name]["parent"] == base
        assert by_id[name]["root"] == str(adapters[name])


def test_adapters_that_do_not_fit_are_refused_naming_the_field(
    served, smollm2, tiny_model, tmp_path
):
    cases = [
        (make_adapter(smollm2, tmp_path / "r32", 32, 5), "r"),
        (make_adapter(smollm2, tmp_path / "head", 8, 6, targets=["q_proj", "lm_head"]), "target_modules"),
        (make_adapter(tiny_model, tmp_path / "tiny", 8, 7), "base_model_name_or_path"),
        (tmp_path / "nothing-here", "lora_path"),
    ]  # fmt: skip
    for path, field in cases:
        r = load(served, f"bad-{field}", path)
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
    r = load(served, "a", cases[0][0].parent / "r32")  # a taken name: refused before its files
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = load(served, str(served.model), cases[0][0])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    names = {m["id"] for m in httpx.get(served.url + "/v1/models", timeout=30).json()["data"]}
    assert not any(n.startswith("bad-") for n in names)


def test_unloaded_adapter_is_gone_and_its_name_free(served, adapters, want, prompts):
    assert load(served, "tmp", adapters["d"]).status_code == 200
    assert complete(served, "tmp", prompts[0]).choices[0].text == decode(served, want["d"][0])
    r = httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "tmp"}, timeout=30)
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError) as e:
        complete(served, "tmp", prompts[0])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "tmp"}, timeout=30)
    assert r.status_code == 404, r.text
    assert load(served, "tmp", adapters["a"]).status_code == 200  # the name is free again
    assert complete(served, "tmp", prompts[0]).choices[0].text == decode(served, want["a"][0])


def test_the_prefix_cache_never_shares_kv_across_adapters(served, smollm2, adapters):
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = list(tok("A long shared system prompt about rivers, " * 6)["input_ids"])  # 3+ blocks
    assert len(ids) >= 48
    [[base_want], [a_want]] = (peft_greedy(smollm2, p, [ids], N) for p in (None, adapters["a"]))

    def cached(model: str, expect: list[int]) -> int:
        res = complete(served, model, ids)
        assert res.choices[0].text == tok.decode(expect, skip_special_tokens=True), model
        return res.usage.prompt_tokens_details.cached_tokens

    base = str(served.model)
    cached(base, base_want)
    assert cached(base, base_want) > 0  # the base's own prefix is reused
    assert cached("a", a_want) == 0  # ... never by an adapter
    assert cached("a", a_want) > 0  # whose own is
    assert cached("b", peft_greedy(smollm2, adapters["b"], [ids], N)[0]) == 0


def test_the_resident_adapters_are_bounded_evicted_and_reloaded(served, adapters, want, prompts):
    """--max-cpu-loras 3: using a fourth adapter evicts the one used longest ago, which loads
    again when next used; every answer stays PEFT's."""
    assert load(served, "d", adapters["d"]).status_code == 200
    for name in ("a", "b", "c", "d", "a", "d", "b"):
        assert complete(served, name, prompts[0]).choices[0].text == decode(served, want[name][0])
    evicted = served.rt.events("executor.lora_evicted")
    loaded = served.rt.events("executor.lora_loaded")
    assert evicted, "nothing was evicted"
    assert len(loaded) > len({e["digest"] for e in loaded})  # some loaded twice
    assert max(e["resident"] for e in loaded) <= 3


def decode(h, ids: list[int]) -> str:
    return AutoTokenizer.from_pretrained(h.model).decode(ids, skip_special_tokens=True)


async def test_adapters_over_zmq_and_refusals_naming_the_field(served, want, prompts):
    async with open_client(served.rt.endpoint) as c:
        listing = await c.lora("list")
        assert {"a", "b"} <= {a.name for a in listing.adapters}
        res = await c.generate(
            prompt_ids=prompts[1], max_tokens=N, temperature=0, ignore_eos=True, lora="b"
        )
        assert res.token_ids == want["b"][1]
        with pytest.raises(RequestError) as e:
            await c.generate(prompt_ids=prompts[1], max_tokens=2, lora="nope")
        assert e.value.field == "lora" and "nope" in e.value.message
        with pytest.raises(RequestError) as e:
            await c.lora("unload", "nope")
        assert e.value.field == "lora_name"
    s = await kv_stats(served.rt)
    assert s.check_ok


async def test_a_server_without_enable_lora_refuses_adapters(tiny_model, tmp_path, adapters):
    with start_runtime(tiny_model, tmp_path / "rt") as rt:
        async with open_client(rt.endpoint) as c:
            with pytest.raises(RequestError) as e:
                await c.lora("load", "a", str(adapters["a"]))
            assert e.value.field == "lora_name" and "--enable-lora" in e.value.message
            with pytest.raises(RequestError) as e:
                await c.generate(prompt="hi", max_tokens=2, lora="a")
            assert e.value.field == "lora" and "--enable-lora" in e.value.message


def test_start_refuses_an_adapter_that_does_not_fit(smollm2, tiny_model, tmp_path):
    from minirt.launch.supervisor import prepare

    bad = make_adapter(tiny_model, tmp_path / "tiny", 8, 9)
    cfg = RuntimeConfig(model=str(smollm2), run_dir=str(tmp_path / "run"))
    cfg.lora.enable_lora = True
    cfg.lora.lora_modules = f"x={bad}"
    with pytest.raises(ValueError, match=r"lora_modules x=.*base_model_name_or_path"):
        prepare(cfg)
    cfg.lora.enable_lora = False
    with pytest.raises(ValueError, match="lora_modules: adapters need --enable-lora"):
        prepare(cfg)


async def test_a_client_cannot_hand_the_executor_an_adapter_of_its_own(served, adapters):
    """``params.lora`` is the front door's to set: a client's is refused naming it."""
    from messages.common import LoraRef, SamplingParams
    from messages.tokenizer import Generate

    ref = LoraRef("a", str(adapters["a"]), "0" * 32, 8, 2.0)
    req = Generate(params=SamplingParams(max_tokens=2, lora=ref), prompt="hi", request_id="x")
    async with open_client(served.rt.endpoint) as c:
        with pytest.raises(RequestError) as e:
            await c.generate(req)
    assert e.value.field == "params.lora"
