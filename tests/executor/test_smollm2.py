"""SmolLM2-135M-Instruct, the model minirt serves by default, in float32 through the OpenAI HTTP
API, against transformers on the same weights: greedy tokens (chat with system and multi-turn
messages, and raw completions) equal transformers' greedy ``generate`` on the same rendered chat
template, stopping at the same EOS; ``usage.prompt_tokens`` equals the template's token count; and
every generated token's logprob is within 1e-4 of transformers' log-softmax at that step.

One runtime serves the whole module; every request is sent at once, so the server answers them
batched (prefill chunks and decode rows of different requests in the same steps), while the
reference decodes each prompt alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.http_server import HttpRuntime, start_http_runtime

pytestmark = pytest.mark.smollm2

MAX_NEW = 24
LOGPROB_TOL = 1e-4

SYSTEM_BRIEF = "You are a concise assistant. Answer in one or two sentences."

CHATS: list[list[dict[str, str]]] = [
    # plain user questions (the template adds SmolLM's default system message)
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [{"role": "user", "content": "Who wrote the play Romeo and Juliet?"}],
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [
        {
            "role": "user",
            "content": "Explain what this Python code does:\n\n"
            "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
        }
    ],
    [
        {
            "role": "user",
            "content": "What does this shell command do? `find . -name '*.py' | xargs wc -l`",
        }
    ],
    [{"role": "user", "content": "Summarize the water cycle in simple words."}],
    # with a system message
    [
        {"role": "system", "content": SYSTEM_BRIEF},
        {"role": "user", "content": "What is photosynthesis?"},
    ],
    [
        {"role": "system", "content": SYSTEM_BRIEF},
        {"role": "user", "content": "What is the boiling point of water at sea level?"},
    ],
    [
        {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
        {"role": "user", "content": "Where is the treasure buried?"},
    ],
    [
        {"role": "system", "content": "You are an expert Python programmer."},
        {
            "role": "user",
            "content": "Explain this function:\n\n"
            "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return a",
        },
    ],
    [
        {"role": "system", "content": "Reply only with a single word."},
        {"role": "user", "content": "What color is a ripe banana?"},
    ],
    [
        {"role": "system", "content": "You are a helpful travel guide."},
        {"role": "user", "content": "Suggest one thing to see in Rome."},
    ],
    # multi-turn: user / assistant / user
    [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name?"},
    ],
    [
        {"role": "user", "content": "What is the largest planet in the solar system?"},
        {"role": "assistant", "content": "The largest planet in the solar system is Jupiter."},
        {"role": "user", "content": "And the smallest?"},
    ],
    [
        {"role": "system", "content": SYSTEM_BRIEF},
        {"role": "user", "content": "Name a prime number greater than 10."},
        {"role": "assistant", "content": "11 is a prime number greater than 10."},
        {"role": "user", "content": "Name another one."},
    ],
    [
        {"role": "user", "content": "Can you recommend a book?"},
        {"role": "assistant", "content": "Sure! What kind of books do you like?"},
        {"role": "user", "content": "I like science fiction."},
    ],
    [
        {"role": "system", "content": "You are a math tutor."},
        {"role": "user", "content": "What is a fraction?"},
        {"role": "assistant", "content": "A fraction represents a part of a whole."},
        {"role": "user", "content": "Give me an example."},
    ],
    [
        {"role": "user", "content": "Write a Python function that adds two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now make it add three numbers."},
    ],
    [
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
        {"role": "assistant", "content": "Octopuses have three hearts."},
        {"role": "user", "content": "Why do they need three?"},
    ],
]

COMPLETIONS: list[str] = [
    "The capital of Germany is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water is made of two elements:",
    "import numpy as np\n\n# compute the mean of a list\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    "A good breakfast should include",
    "Q: What is the opposite of hot?\nA:",
]


@dataclass
class Case:
    kind: str  # "chat" or "completion"
    prompt: Any  # the messages, or the prompt text
    logprobs: bool  # ask the server for logprobs (the only way it tells token by token)


def cases() -> list[Case]:
    # most requests ask for logprobs, so their tokens are compared one by one; every fourth asks
    # for none (the plain path), compared by text and token count
    out = [Case("chat", m, i % 4 != 3) for i, m in enumerate(CHATS)]
    out += [Case("completion", p, i % 4 != 3) for i, p in enumerate(COMPLETIONS)]
    return out


CASES = cases()


@dataclass
class Ref:
    prompt_ids: list[int]
    output: list[int]  # transformers' greedy new tokens (EOS included when it stopped on one)
    logprobs: list[float]  # log-softmax (of float32 logits) of each output token at its step
    gaps: list[float]  # top-1 minus top-2 logit at each step


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def prompt_ids(tok, case: Case) -> list[int]:
    if case.kind == "chat":
        enc = tok.apply_chat_template(case.prompt, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5: a BatchEncoding
        return list(ids)
    return list(tok(case.prompt)["input_ids"])  # the server tokenizes with special tokens on


@pytest.fixture(scope="module")
def refs(smollm2: Path, tok) -> list[Ref]:
    """transformers float32, greedy, stopping at the model's EOS (generation_config.json) as the
    server does. The tokens come from one left-padded batched ``generate`` (five times faster
    than one prompt at a time on two cores); each prompt is then scored alone, unpadded, on its
    tokens (teacher forced), which gives the reference logprobs and checks that every token is
    that unpadded forward's argmax, i.e. the batch changed no greedy choice."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id
    prompts = [prompt_ids(tok, case) for case in CASES]
    width = max(map(len, prompts))
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = []
    with torch.inference_mode():
        gen = model.generate(
            x, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=pad
        )
        for i, ids in enumerate(prompts):
            new = gen[i, width:].tolist()
            ends = [j for j, t in enumerate(new) if t in eos_ids]
            new = new[: ends[0] + 1] if ends else new  # rows that stopped early are padded on
            logits = model(torch.tensor([ids + new[:-1]])).logits[0, len(ids) - 1 :]
            lps = torch.log_softmax(logits.double(), -1)
            top2 = torch.topk(logits, 2).values
            gaps = (top2[:, 0] - top2[:, 1]).tolist()
            for j, t in enumerate(new):
                assert int(logits[j].argmax()) == t or gaps[j] < 1e-5, (i, j)
            out.append(Ref(ids, new, [float(lps[j, t]) for j, t in enumerate(new)], gaps))
    return out


@pytest.fixture(scope="module")
def server(smollm2: Path, tmp_path_factory: pytest.TempPathFactory):
    flags = ("--dtype", "float32", "--num-blocks", "2048")
    with start_http_runtime(smollm2, tmp_path_factory.mktemp("smollm2"), *flags) as h:
        yield h


def ask(server: HttpRuntime, case: Case) -> Any:
    # all requests finish together: give a loaded two-core machine longer than the usual 60 s
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    kw: dict[str, Any] = dict(model=str(server.model), max_tokens=MAX_NEW, temperature=0)
    if case.kind == "chat":
        if case.logprobs:
            kw.update(logprobs=True, top_logprobs=1)
        return client.chat.completions.create(messages=case.prompt, **kw)
    if case.logprobs:
        kw.update(logprobs=1)
    return client.completions.create(prompt=case.prompt, **kw)


@pytest.fixture(scope="module")
def answers(server: HttpRuntime, refs: list[Ref]) -> list[Any]:
    """Every case's response, all requests in flight at once (the runtime batches them)."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        return list(pool.map(lambda c: ask(server, c), CASES))


def served_tokens(case: Case, answer: Any) -> list[tuple[str, float]]:
    """(token string, logprob) of each generated token, from the response's logprobs."""
    [choice] = answer.choices
    if case.kind == "chat":
        return [(e.token, e.logprob) for e in choice.logprobs.content]
    lp = choice.logprobs
    return list(zip(lp.tokens, lp.token_logprobs, strict=True))


def test_enough_real_prompts_of_every_kind(smollm2):
    assert len(CASES) >= 32
    chats = [c.prompt for c in CASES if c.kind == "chat"]
    assert any(m[0]["role"] == "system" for m in chats)
    assert any(m[0]["role"] != "system" for m in chats)
    assert any([r["role"] for r in m][-3:] == ["user", "assistant", "user"] for m in chats)
    assert sum(c.kind == "completion" for c in CASES) >= 8


def test_greedy_tokens_equal_transformers(tok, refs, answers):
    stopped = 0
    for i, (case, ref, ans) in enumerate(zip(CASES, refs, answers, strict=True)):
        what = f"case {i} ({case.kind}): {case.prompt!r}"
        [choice] = ans.choices
        if case.logprobs:
            got = [s for s, _ in served_tokens(case, ans)]
            want = [tok.decode([t]) for t in ref.output]
            j = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            gap = "" if j is None else f"; first difference at token {j}, gap {ref.gaps[j]:.2e}"
            assert got == want, what + gap
        text = choice.message.content if case.kind == "chat" else choice.text
        assert text == tok.decode(ref.output, skip_special_tokens=True), what
        assert ans.usage.completion_tokens == len(ref.output), what
        hit_eos = len(ref.output) < MAX_NEW or ref.output[-1] == tok.eos_token_id
        assert choice.finish_reason == ("stop" if hit_eos else "length"), what
        stopped += hit_eos
    assert stopped, "no prompt ended on EOS within MAX_NEW tokens: EOS handling went unchecked"


def test_prompt_tokens_equal_the_templates_count(tok, refs, answers):
    for i, (case, ref, ans) in enumerate(zip(CASES, refs, answers, strict=True)):
        assert ans.usage.prompt_tokens == len(ref.prompt_ids), f"case {i}: {case.prompt!r}"
        total = len(ref.prompt_ids) + len(ref.output)
        assert ans.usage.total_tokens == total, i


def test_chat_template_is_rendered_as_transformers_renders_it(server, tok):
    import httpx

    for i, case in enumerate(c for c in CASES if c.kind == "chat"):
        r = httpx.post(server.url + "/tokenize", json={"messages": case.prompt}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == prompt_ids(tok, case), f"chat {i}: {case.prompt!r}"


def test_logprobs_equal_transformers_log_softmax(refs, answers):
    worst = 0.0
    checked = 0
    for i, (case, ref, ans) in enumerate(zip(CASES, refs, answers, strict=True)):
        if not case.logprobs:
            continue
        got = served_tokens(case, ans)
        assert len(got) == len(ref.logprobs), i
        for j, ((_, lp), want) in enumerate(zip(got, ref.logprobs, strict=True)):
            assert abs(lp - want) <= LOGPROB_TOL, f"case {i} token {j}: {lp} vs {want}"
            worst = max(worst, abs(lp - want))
            checked += 1
        if case.kind == "chat":  # top_logprobs=1: the greedy token itself
            for e in ans.choices[0].logprobs.content:
                [top] = e.top_logprobs
                assert top.token == e.token and abs(top.logprob - e.logprob) <= LOGPROB_TOL
    assert checked >= 200, checked
    print(f"max |logprob diff| over {checked} tokens: {worst:.2e}")
