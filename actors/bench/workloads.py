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
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


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
