"""What ``--model`` takes (gpu/model/sources.py): an HF directory, a .gguf file, a hub id from the local
Hugging Face cache, the default SmolLM2 (or, offline, the built-in tiny model); a tied head
stored under either name; and what the runtime refuses at once (a hub id not cached, a request
that could never fit the KV pool)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from gpu.model import sources
from gpu.model_runner import ModelRunner
from messages.common import SamplingParams
from minirt.client import RequestError, open_client
from tests.support.http_server import start_http_runtime
from tests.support.runtime import hf_greedy, kv_stats, start_runtime, wait_until

MAX_NEW = 10


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def _greedy(ex: ModelRunner, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """minirt's executor, all prompts in one batch, greedy."""
    per = -(-(max(map(len, prompts)) + max_new) // ex.block_size)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        table = list(range(i * per, (i + 1) * per))
        ex.add_request(f"r{i}", p, SamplingParams(max_tokens=max_new), table)
        outs[f"r{i}"] = []
    while ex.has_work():
        for t in ex.step().outputs:
            if t.token_id is not None:
                outs[t.request_id].append(t.token_id)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _hub_cache(root: Path, repo: str, model_dir: Path, revision: str = "main") -> Path:
    """A Hugging Face cache holding ``model_dir`` as ``repo`` at ``revision``, in
    huggingface_hub's layout: models--ORG--NAME/{refs/REV, snapshots/COMMIT/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(model_dir, snap)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / revision).write_text(commit)
    return snap


def test_lm_head_only_tied_checkpoint_serves_like_transformers(tiny_model, tmp_path):
    """A tied model whose shared tensor is stored only as lm_head.weight (what
    safetensors.torch.save_model writes) loads and decodes exactly like transformers."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "lmhead-only"
    shutil.copytree(tiny_model, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(4, seed=3)
    got = _greedy(ModelRunner(out, num_blocks=64), prompts, MAX_NEW)
    assert got == hf_greedy(out, prompts, MAX_NEW)


def test_untied_checkpoint_without_embedding_is_refused(tiny_models, tmp_path):
    """An untied model (llama tiny) missing its embedding: refused, never the head reused."""
    from safetensors.torch import load_file, save_file

    from gpu.model.loader import UnsupportedModelError

    out = tmp_path / "no-embed"
    shutil.copytree(tiny_models["llama"], out)
    weights = load_file(str(out / "model.safetensors"))
    del weights["model.embed_tokens.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"model\.embed_tokens\.weight"):
        ModelRunner(out, num_blocks=8)


def test_hub_id_resolves_from_the_local_cache_only(tiny_model, tmp_path, monkeypatch):
    snap = _hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    got = sources.resolve("acme/tiny-chat")
    assert (got.path, got.name, got.source) == (snap, "acme/tiny-chat", "hub")
    assert sources.resolve("acme/tiny-chat@main").path == snap
    with pytest.raises(
        sources.ModelNotFound, match=r"acme/nothing.*" + re.escape(str(tmp_path / "hub"))
    ):
        sources.resolve("acme/nothing")
    with pytest.raises(sources.ModelNotFound, match="revision v9"):
        sources.resolve("acme/tiny-chat@v9")
    with pytest.raises(sources.ModelNotFound, match=r"no such directory or \.gguf file"):
        sources.resolve(str(tmp_path / "missing-dir"))


async def test_hub_id_serves_the_same_tokens_as_transformers(tiny_model, tmp_path, monkeypatch):
    """``minirt up --model org/name``: the cached snapshot, served under the id as given."""
    _hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    prompts = _prompts(3, seed=5)
    with start_runtime("acme/tiny-chat", tmp_path / "rt", "--num-blocks", "128") as rt:
        async with open_client(rt.endpoint) as c:
            assert c.welcome.model == "acme/tiny-chat"
            got = [(await c.generate(prompt_ids=p, max_tokens=MAX_NEW)).token_ids for p in prompts]
    assert got == hf_greedy(tiny_model, prompts, MAX_NEW)


def test_a_missing_hub_id_fails_at_once_naming_it(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty-hub"), "PATH": "/usr/bin:/bin"}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "minirt.cli", "up", "--model", "nobody/no-such-model"]
        + ["--run-dir", str(tmp_path / "rt"), "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    took = time.monotonic() - t0
    assert done.returncode == 2, done.stderr
    assert "nobody/no-such-model" in done.stderr and str(tmp_path / "empty-hub") in done.stderr
    assert took < 30, f"took {took:.1f}s to refuse"
    assert not (tmp_path / "rt" / "sock").exists()  # nothing was started


def test_a_file_that_is_not_a_gguf_is_refused_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(sources.ModelNotFound, match=r"model.gguf: not a readable GGUF"):
        sources.resolve(str(bad))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(sources.ModelNotFound, match=r"a file must be a .gguf"):
        sources.resolve(str(other))


def test_offline_default_falls_back_to_the_builtin_model_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(sources.NO_FETCH_ENV, "1")
    said: list[str] = []
    got = sources.resolve("", say=said.append)
    assert got.source == "builtin" and (got.path / "config.json").exists()
    assert got.name == "tiny-qwen2"
    assert any(sources.DEFAULT_NAME in line and "random-weight" in line for line in said), said


@pytest.mark.smollm2
def test_gguf_file_serves_like_transformers_reading_the_gguf(smollm2, tmp_path, monkeypatch):
    """``--model FILE.gguf``: converted once (a second resolve reuses it), then decoded exactly
    as transformers decodes the same GGUF (its own dequantization, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = sources.cache_root() / "gguf" / Path(sources.DEFAULT_MEMBER).name
    link = tmp_path / "SmolLM2.gguf"
    link.symlink_to(gguf)
    monkeypatch.setenv("MINIRT_CACHE", str(tmp_path / "cache"))
    got = sources.resolve(str(link), say=lambda line: None)
    assert got.source == "gguf" and got.name == str(link)
    t0 = time.monotonic()
    assert sources.resolve(str(link), say=pytest.fail).path == got.path  # converted once
    assert time.monotonic() - t0 < 1.0
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=link.name)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Name a primary colour."},
        ],
    ]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=link.name, dtype=torch.float32
    )
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16)
            want.append(out[0, len(p) :].tolist())
    del ref
    ex = ModelRunner(got.path, num_blocks=64, dtype="float32")
    eos = set(ex.eos_token_ids)
    got_ids = _greedy(ex, prompts, 16)
    for g, w in zip(got_ids, want, strict=True):  # transformers pads past EOS: compare up to it
        w = w[: next((i + 1 for i, t in enumerate(w) if t in eos), len(w))]
        assert g == w
    assert "Paris" in tok.decode(got_ids[0])


@pytest.mark.parametrize("mode", ["on_demand", "full"])
async def test_a_request_bigger_than_the_pool_is_refused_at_once(tiny_model, tmp_path, mode):
    """8 blocks of 16 = 128 tokens: max_model_len is capped at the pool; prompt + max_tokens past
    it is too_long at once (ZMQ and HTTP), naming both numbers; nothing is admitted or leaked."""
    flags = ("--num-blocks", "8", "--kv-mode", mode)
    with start_http_runtime(tiny_model, tmp_path / "rt", *flags) as h:
        models = httpx.get(h.base_url + "/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 128
        async with open_client(h.rt.endpoint) as c:
            assert c.welcome.max_model_len == 128
            with pytest.raises(RequestError) as info:
                await c.generate(prompt_ids=[5] * 100, max_tokens=64)
            err = info.value
            assert (err.code, err.field) == ("too_long", "params.max_tokens")
            assert "100" in str(err) and "64" in str(err) and "128" in str(err)
            ok = await c.generate(prompt_ids=[5] * 100, max_tokens=20)
            assert len(ok.token_ids) == 20
        r = httpx.post(
            h.base_url + "/completions",
            json={"model": h.model.name, "prompt": [5] * 100, "max_tokens": 64},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        body = r.json()["error"]
        assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
        assert "128" in body["message"] and "100" in body["message"] and "64" in body["message"]
        assert len(h.rt.events("request.admitted")) == 1  # only the one that fits
        s = await wait_until(lambda: kv_stats(h.rt))
        assert s.check_ok and s.in_use == 0


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.deadline(600)
async def test_64_concurrent_192_token_requests_fit_the_default_pool(smollm2, tmp_path):
    """SmolLM2 with default settings: 64 requests of 192 prompt tokens at once all run without a
    preemption or a refusal (the pool is sized from the memory left after the weights)."""
    prompts = [[(i * 7 + j * 13) % 40000 + 100 for j in range(192)] for i in range(64)]
    with start_runtime(smollm2, tmp_path / "rt", timeout=180) as rt:
        async with open_client(rt.endpoint) as c:
            import trio

            results: list = [None] * 64

            async def one(i: int) -> None:
                results[i] = await c.generate(prompt_ids=prompts[i], max_tokens=32, ignore_eos=True)

            async with trio.open_nursery() as n:
                for i in range(64):
                    n.start_soon(one, i)
        assert all(len(r.token_ids) == 32 for r in results)
        assert not rt.events("request.preempted") and not rt.events("admission.refused")
        blocks = rt.events("kv.config")[0]["num_blocks"]
        assert blocks * 16 >= 64 * (192 + 32)
