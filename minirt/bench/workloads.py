"""Workloads: lists of jobs (prompt ids, max tokens, arrival offset, dependencies). Deterministic
for a seed. Token ids are drawn from [16, vocab) so no special token appears by accident.

- ``w1``: 64 requests, prompts uniform 32..256 tokens, 64 new tokens, all at t=0.
- ``w2``: prefix sharing: 8 system prompts of 768 tokens, each shared by 8 requests with a unique
  16..64-token suffix, 64 new tokens, all at t=0 (what a chat service with system prompts sees).
- ``mix``: long + short: 64 requests arriving evenly over one second, 4 of them (the first, the
  17th, ...) with 2,000-token prompts, the rest 50 tokens; 32 new tokens. Shows head-of-line
  blocking of short requests behind long ones.
- ``chat``: multi-turn: 16 conversations x 4 turns; each turn's prompt is the previous prompt +
  the previous answer + 32 new user tokens, sent when the previous turn finished.
- ``poisson``: W1-like requests (fewer new tokens) arriving as a Poisson process at ``rate``/s.

Real-text workloads (for a real model such as SmolLM2-135M-Instruct; the prompts are text from
this machine's Python, rendered by the model's own chat template and tokenizer, as minirt's front
door renders a chat request, so minirt and vLLM get the same token ids). Deterministic for a seed
and a Python version (the text is that version's ``pydoc_data.topics`` and standard library);
nothing is downloaded. All requests arrive at t=0, each with a fixed output length:

- ``docs-qa``: 8 system prompts, each a Python reference topic from ``pydoc_data.topics``
  rendered to 600..1,000 tokens (chat-template markers included), each shared by 8 requests that
  ask different questions about it (prefix sharing, as ``w2``, on real text); 64 new tokens. On
  SmolLM2-135M-Instruct's tokenizer (seed 0) the prompts are 713..1,000 tokens.
- ``code-edit``: 64 functions, methods or classes of 150..600 tokens from standard-library
  modules, each with an editing instruction (rename X to Y, add type hints, add docstrings, ...)
  under one short shared system prompt; 128 new tokens. On SmolLM2's tokenizer (seed 0)
  the prompts are 213..657 tokens.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the start
    after: str | None = None  # multi-turn: wait for this job, then extend its prompt + output
    extra: list[int] = field(default_factory=list)  # tokens appended after the previous turn
    tags: tuple[str, ...] = ()


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def w1(vocab: int, seed: int = 0, n: int = 64, new_tokens: int = 64) -> list[Job]:
    rng = random.Random(seed)
    return [Job(f"w1-{i}", _ids(rng, rng.randint(32, 256), vocab), new_tokens) for i in range(n)]


def w2(
    vocab: int,
    seed: int = 0,
    groups: int = 8,
    per_group: int = 8,
    system: int = 768,
    new_tokens: int = 64,
) -> list[Job]:
    rng = random.Random(seed)
    heads = [_ids(rng, system, vocab) for _ in range(groups)]
    jobs = [
        Job(f"w2-{g}-{j}", heads[g] + _ids(rng, rng.randint(16, 64), vocab), new_tokens)
        for j in range(per_group)
        for g in range(groups)
    ]
    return jobs


def mix(
    vocab: int,
    seed: int = 0,
    n: int = 64,
    longs: int = 4,
    long_len: int = 2000,
    short_len: int = 50,
    new_tokens: int = 32,
    spread_s: float = 1.0,
) -> list[Job]:
    """``n`` requests arriving evenly over ``spread_s``; ``longs`` of them (evenly placed, the
    first at t=0) have ``long_len``-token prompts, the rest ``short_len``."""
    rng = random.Random(seed)
    every = n // longs
    jobs = []
    for i in range(n):
        long = i % every == 0 and i // every < longs
        kind = "long" if long else "short"
        jobs.append(
            Job(
                f"{kind}-{i}",
                _ids(rng, long_len if long else short_len, vocab),
                new_tokens,
                spread_s * i / n,
                tags=(kind,),
            )
        )
    return jobs


def chat(
    vocab: int,
    seed: int = 0,
    conversations: int = 16,
    turns: int = 4,
    first: int = 96,
    follow: int = 32,
    new_tokens: int = 32,
) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for c in range(conversations):
        jobs.append(Job(f"chat-{c}-0", _ids(rng, first, vocab), new_tokens))
        for t in range(1, turns):
            jobs.append(
                Job(
                    f"chat-{c}-{t}",
                    [],
                    new_tokens,
                    after=f"chat-{c}-{t - 1}",
                    extra=_ids(rng, follow, vocab),
                )
            )
    return jobs


def poisson(vocab: int, rate: float, seed: int = 0, n: int = 64, new_tokens: int = 32) -> list[Job]:
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(rate)
        jobs.append(Job(f"p{rate:g}-{i}", _ids(rng, rng.randint(32, 256), vocab), new_tokens, t))
    return jobs


WORKLOADS: dict[str, Callable[..., list[Job]]] = {"w1": w1, "w2": w2, "mix": mix, "chat": chat}


# --- real-text workloads ---------------------------------------------------------------------

DOCS_QA_SYSTEM = (600, 1000)  # tokens of the rendered system message (template markers included)
CODE_EDIT_CODE = (150, 600)  # tokens of the code taken from the standard library

DOCS_QA_PREAMBLE = (
    "You are a Python documentation assistant. Answer the user's question using the reference "
    "text below; say so when the reference does not cover it. Be concise.\n\n"
)
DOCS_QA_QUESTIONS = (
    "Summarize the reference above in three sentences.",
    'What is the main point of the section "{title}"? Answer in one paragraph.',
    'Give a short, complete Python example of what "{title}" describes, and explain it.',
    "What are two common mistakes people make with what the reference describes, and how do "
    "they avoid them?",
    "Explain the reference to someone who is new to Python.",
    "List the key terms the reference defines, with a one-line definition of each.",
    "Which details in the reference would surprise a programmer who knows C or Java?",
    "Write three quiz questions, with answers, that test an understanding of the reference.",
    'What does the reference say about "{phrase}"?',
    "Rewrite the first paragraph of the reference in plain language.",
    "Does the reference mention any change between Python versions? Quote it if so.",
    "How would you test code that relies on what the reference describes? Give concrete steps.",
)

CODE_EDIT_SYSTEM = (
    "You are a careful Python programmer. Reply with the edited code in one Python code block, "
    "then at most two sentences about what changed."
)
CODE_EDIT_INSTRUCTIONS = (
    "Rename `{old}` to `{new}` throughout this code.",
    "Add type hints to every function signature in this code.",
    "Add a Google-style docstring to every function and class in this code that lacks one.",
    "Add input validation to `{name}` that raises ValueError with a clear message on bad "
    "arguments.",
    "Refactor this code to be easier to read without changing its behaviour.",
    "Write pytest unit tests for `{name}` that cover its main branches.",
    "Find a possible bug or unhandled edge case in this code and fix it.",
    "Replace string formatting with f-strings and os.path calls with pathlib where it applies.",
)
# Pure-Python standard-library modules the code is taken from (paths under the stdlib dir).
CODE_EDIT_MODULES = (
    "argparse.py", "base64.py", "bisect.py", "calendar.py", "colorsys.py", "configparser.py",
    "csv.py", "dataclasses.py", "difflib.py", "fnmatch.py", "fractions.py", "functools.py",
    "glob.py", "heapq.py", "ipaddress.py", "json/decoder.py", "json/encoder.py", "pprint.py",
    "shlex.py", "shutil.py", "statistics.py", "string.py", "textwrap.py", "urllib/parse.py",
)  # fmt: skip


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str | Path) -> Any:
    """The model directory's tokenizer (``transformers``), chat template included."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def render(tok: Any, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, as minirt's front door
    makes them for a chat request (tokenizer_svc/requests.py): the template renders text, which is
    tokenized without adding special tokens."""
    text = tok.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _fit(
    pieces: list[str], length: Callable[[str], int], lo: int, target: int, hi: int
) -> str | None:
    """The longest ``"".join(pieces[:k])`` whose ``length`` is at most ``target`` (or, when that
    is under ``lo``, the next one if it is at most ``hi``); None if no prefix lands in [lo, hi]."""
    a, b = 1, len(pieces)  # the answer k lies in [a - 1, b]
    if length("".join(pieces)) <= target:
        a = b + 1
    while a <= b:  # find the largest k with length <= target
        k = (a + b) // 2
        if length("".join(pieces[:k])) <= target:
            a = k + 1
        else:
            b = k - 1
    for k in (b, b + 1):
        if 0 < k <= len(pieces):
            text = "".join(pieces[:k])
            if lo <= length(text) <= hi:
                return text
    return None


def _title(key: str, text: str) -> str:
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first if 3 <= len(first) <= 60 else key


def docs_qa(
    tok: Any,
    seed: int = 0,
    groups: int = 8,
    per_group: int = 8,
    system: tuple[int, int] = DOCS_QA_SYSTEM,
    new_tokens: int = 64,
) -> list[Job]:
    """``groups`` system prompts, each a ``pydoc_data.topics`` topic cut (at a word) to a length
    drawn from ``system`` (tokens of the rendered system message), each followed by
    ``per_group`` different questions; every request of a group starts with the same tokens."""
    from pydoc_data.topics import topics

    if per_group > len(DOCS_QA_QUESTIONS):
        raise ValueError(f"docs-qa: at most {len(DOCS_QA_QUESTIONS)} questions per group")
    lo, hi = system
    rng = random.Random(seed)
    keys = sorted(topics)
    rng.shuffle(keys)
    heads: list[tuple[str, str, str]] = []  # (title, system text, body used)
    for key in keys:
        if len(heads) == groups:
            break
        body = topics[key].strip()
        title = _title(key, body)
        pre = DOCS_QA_PREAMBLE

        def length(b: str, pre: str = pre) -> int:
            return len(render(tok, [{"role": "system", "content": pre + b.rstrip()}], False))

        text = _fit(re.split(r"(?<=\s)(?=\S)", body), length, lo, rng.randint(lo, hi), hi)
        if text is not None:
            heads.append((title, pre + text.rstrip(), text))
    if len(heads) < groups:
        raise ValueError(f"docs-qa: only {len(heads)} topics fit {lo}..{hi} tokens")
    asks: list[list[str]] = []
    for title, _, body in heads:
        lines = [ln.strip() for ln in body.splitlines() if 4 <= len(ln.split()) <= 14]
        phrase = " ".join(rng.choice(lines).split()[:8]) if lines else title
        picked = rng.sample(DOCS_QA_QUESTIONS, per_group)
        asks.append([q.format(title=title, phrase=phrase) for q in picked])
    jobs = []
    for j in range(per_group):
        for g in range(groups):
            messages = [
                {"role": "system", "content": heads[g][1]},
                {"role": "user", "content": asks[g][j]},
            ]
            jobs.append(Job(f"docs-qa-{g}-{j}", render(tok, messages), new_tokens))
    return jobs


@functools.lru_cache(maxsize=8)
def _stdlib_snippets(tok: Any, code: tuple[int, int]) -> list[tuple[str, str, list[str]]]:
    """Every top-level function and class, and every method, of ``CODE_EDIT_MODULES`` whose
    source is ``code`` tokens long: (name, source, renameable names), in file order."""
    lo, hi = code
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in CODE_EDIT_MODULES:
        try:
            src = (root / mod).read_text(encoding="utf-8")
        except OSError:
            continue
        lines = src.splitlines()
        nodes: list[ast.FunctionDef | ast.ClassDef] = []
        for top in ast.parse(src).body:
            if isinstance(top, ast.FunctionDef | ast.ClassDef):
                nodes.append(top)
            if isinstance(top, ast.ClassDef):
                nodes += [n for n in top.body if isinstance(n, ast.FunctionDef)]
        for node in nodes:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            text = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
            if not lo <= len(tok(text, add_special_tokens=False)["input_ids"]) <= hi:
                continue
            if isinstance(node, ast.ClassDef):
                names = [node.name]
            else:
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                          and isinstance(n.ctx, ast.Store)]  # fmt: skip
            names = sorted({n for n in names if n not in ("self", "cls") and len(n) > 1})
            out.append((node.name, text, names or [node.name]))
    return out


def code_edit(
    tok: Any,
    seed: int = 0,
    n: int = 64,
    code: tuple[int, int] = CODE_EDIT_CODE,
    new_tokens: int = 128,
) -> list[Job]:
    """``n`` requests, each a different standard-library function, method or class of ``code``
    tokens with an editing instruction, under one shared short system prompt."""
    found = _stdlib_snippets(tok, (code[0], code[1]))
    if len(found) < n:
        raise ValueError(f"code-edit: only {len(found)} snippets of {code[0]}..{code[1]} tokens")
    rng = random.Random(seed)
    jobs = []
    for i, (name, text, names) in enumerate(rng.sample(found, n)):
        old = rng.choice(names)
        suffix = rng.choice(("_value", "_item", "_result", "_data"))
        new = old + suffix if old.islower() else "Better" + old
        ask = rng.choice(CODE_EDIT_INSTRUCTIONS).format(old=old, new=new, name=name)
        user = f"{ask}\n\n```python\n{text}\n```"
        messages = [
            {"role": "system", "content": CODE_EDIT_SYSTEM},
            {"role": "user", "content": user},
        ]
        jobs.append(Job(f"code-edit-{i}", render(tok, messages), new_tokens))
    return jobs


# name -> function(tokenizer, seed, ...): the workloads that need the model's tokenizer
REAL_WORKLOADS: dict[str, Callable[..., list[Job]]] = {"docs-qa": docs_qa, "code-edit": code_edit}
