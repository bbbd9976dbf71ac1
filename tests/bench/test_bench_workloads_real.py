"""The real-text bench workloads (docs-qa, code-edit): deterministic, rendered by the model's chat
template, shared system prompts in docs-qa, token lengths within their bounds. On the tiny model's
tokenizer (it has a ChatML template), with bounds small enough for its 1,024 positions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from minirt.bench import workloads as w

SYSTEM = (300, 500)
CODE = (150, 400)


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return w.load_tokenizer(tiny_model)


def _system_ids(tok, job: w.Job) -> list[int]:
    """The rendered system message of a docs-qa job (its text taken back out of the prompt)."""
    text = tok.decode(job.prompt)
    system = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    return w.render(tok, [{"role": "system", "content": system}], generation_prompt=False)


def test_docs_qa_is_deterministic_for_a_seed(tok):
    a = w.docs_qa(tok, seed=0, groups=3, per_group=4, system=SYSTEM)
    b = w.docs_qa(tok, seed=0, groups=3, per_group=4, system=SYSTEM)
    c = w.docs_qa(tok, seed=1, groups=3, per_group=4, system=SYSTEM)
    assert [(j.rid, j.prompt, j.max_tokens) for j in a] == [
        (j.rid, j.prompt, j.max_tokens) for j in b
    ]
    assert [j.prompt for j in a] != [j.prompt for j in c]
    assert len(a) == 12 and all(j.max_tokens == 64 and j.at == 0.0 for j in a)


def test_docs_qa_groups_share_their_system_prompt(tok):
    jobs = w.docs_qa(tok, seed=0, groups=3, per_group=4, system=SYSTEM)
    groups: dict[str, list[w.Job]] = {}
    for j in jobs:
        groups.setdefault(j.rid.rsplit("-", 1)[0], []).append(j)
    assert len(groups) == 3 and all(len(g) == 4 for g in groups.values())
    heads = []
    for group in groups.values():
        head = _system_ids(tok, group[0])
        assert SYSTEM[0] <= len(head) <= SYSTEM[1]
        for j in group:  # the same system tokens first, then a different question each
            assert j.prompt[: len(head)] == head
        assert len({tuple(j.prompt[len(head) :]) for j in group}) == len(group)
        heads.append(tuple(head))
    assert len(set(heads)) == len(heads)  # one topic per group


def test_docs_qa_prompts_are_the_chat_template_rendering(tok, tiny_model):
    vocab = len(tok)
    for j in w.docs_qa(tok, seed=0, groups=2, per_group=2, system=SYSTEM):
        text = tok.decode(j.prompt)
        assert text.startswith("<|im_start|>system\n")
        assert "<|im_start|>user\n" in text
        assert text.endswith("<|im_start|>assistant\n")
        assert all(0 <= t < vocab for t in j.prompt)
        # what minirt's front door would make of the same chat request
        system = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        assert j.prompt == w.render(tok, messages)


def test_code_edit_is_deterministic_and_its_code_within_bounds(tok):
    a = w.code_edit(tok, seed=0, n=12, code=CODE)
    assert [j.prompt for j in a] == [j.prompt for j in w.code_edit(tok, seed=0, n=12, code=CODE)]
    assert [j.prompt for j in a] != [j.prompt for j in w.code_edit(tok, seed=1, n=12, code=CODE)]
    codes = []
    for j in a:
        assert j.max_tokens == 128 and j.at == 0.0
        text = tok.decode(j.prompt)
        assert text.startswith("<|im_start|>system\n" + w.CODE_EDIT_SYSTEM + "<|im_end|>")
        assert text.endswith("<|im_start|>assistant\n")
        code = text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert CODE[0] <= len(tok(code, add_special_tokens=False)["input_ids"]) <= CODE[1]
        assert code.lstrip().startswith(("def ", "class ", "@"))
        codes.append(code)
    assert len(set(codes)) == len(codes)  # each request a different snippet


def test_serve_fits_the_workloads_to_the_model_context(tok):
    from minirt.bench.serve import real_jobs

    context = 1024  # the tiny model's positions
    jobs = real_jobs("docs-qa", tok, seed=0, requests=6, context=context)
    assert len(jobs) == 6 and len({tuple(_system_ids(tok, j)) for j in jobs}) == 1
    assert all(len(j.prompt) + j.max_tokens <= context for j in jobs)
    jobs = real_jobs("code-edit", tok, seed=0, requests=5, context=context)
    assert len(jobs) == 5 and all(len(j.prompt) + j.max_tokens <= context for j in jobs)


def test_vllm_env_preloads_tcmalloc_and_binds_threads(monkeypatch, tmp_path):
    from benchmarks.vllm_row import vllm_env

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setenv("MINIRT_TCMALLOC", str(lib))
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = vllm_env("0-3")
    assert env["LD_PRELOAD"] == f"{lib}:/x/libother.so"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and "OMP_NUM_THREADS" not in env
    monkeypatch.setenv("MINIRT_TCMALLOC", "off")
    assert vllm_env("0")["LD_PRELOAD"] == "/x/libother.so"
    assert os.environ["LD_PRELOAD"] == "/x/libother.so"  # the caller's own is left alone
