"""A W2-like workload as text, sent over the OpenAI HTTP API (to a router or one replica).

Routers match prefixes on the request's text, so the prompts are text: words that are one token
each in the model's tokenizer, so "768 tokens of system prompt" stays true after tokenization.
Each request carries its own ``X-Request-Id`` (the router forwards it to the replica), so
``minirt trace ID`` finds the replica that served it.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio


@dataclass
class TextJob:
    rid: str
    group: int
    prompt: str | list[int]  # text, or token ids


@dataclass
class HttpRecord:
    rid: str
    group: int
    sent: float = 0.0
    first: float | None = None
    end: float = 0.0
    status: int = 0
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    def summary(self) -> dict[str, Any]:
        ttft = None if self.first is None else self.first - self.sent
        tpot = None
        if self.first is not None and self.completion_tokens > 1:
            tpot = (self.end - self.first) / (self.completion_tokens - 1)
        return {
            "request_id": self.rid,
            "tags": [f"group-{self.group}"],
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "sent_s": self.sent,
            "queue_s": None,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": self.end - self.sent,
            "itl_s": [],
            "preemptions": 0,
            "text": self.text,
        }


def one_token_words(tokenizer: Any) -> list[str]:
    """Lower-case words the tokenizer holds as single tokens after a space."""
    words = sorted(k[1:] for k in tokenizer.get_vocab() if re.fullmatch(r"\u0120[a-z]{3,}", k))
    if len(words) < 16:
        raise ValueError(f"tokenizer has only {len(words)} one-token words; need 16")
    return words


def text_w2(
    tokenizer: Any,
    seed: int = 0,
    groups: int = 8,
    per_group: int = 8,
    system: int = 768,
    suffix: tuple[int, int] = (16, 64),
    tag: str = "w2",
) -> list[TextJob]:
    """``groups`` system prompts of ``system`` words, each shared by ``per_group`` requests with
    their own ``suffix``-word tail; shuffled (requests of a group do not arrive together)."""
    rng = random.Random(seed)
    words = one_token_words(tokenizer)
    heads = [" ".join(rng.choice(words) for _ in range(system)) for _ in range(groups)]
    jobs = [
        TextJob(
            f"{tag}-{g}-{j}",
            g,
            heads[g] + " " + " ".join(rng.choice(words) for _ in range(rng.randint(*suffix))),
        )
        for g in range(groups)
        for j in range(per_group)
    ]
    rng.shuffle(jobs)
    return jobs


async def complete(
    client: httpx.AsyncClient,
    url: str,
    job: TextJob,
    *,
    model: str,
    max_tokens: int,
    t0: float,
    api_key: str = "",
    timeout: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> HttpRecord:
    """One streaming ``/v1/completions`` (greedy, usage included; ``extra``: more body fields);
    never raises: errors are in the record (``status`` 0 when no HTTP answer came)."""
    rec = HttpRecord(job.rid, job.group, sent=time.perf_counter() - t0)
    headers = {"X-Request-Id": job.rid}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout
        ) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:500]
            else:
                await _read_stream(resp, rec, t0)
    except httpx.HTTPError as e:
        rec.error = rec.error or f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter() - t0
    return rec


async def _read_stream(resp: httpx.Response, rec: HttpRecord, t0: float) -> None:
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            rec.error = json.dumps(chunk["error"])[:500]
            continue
        for choice in chunk.get("choices") or []:
            if choice.get("text") and rec.first is None:
                rec.first = time.perf_counter() - t0
            rec.text += choice.get("text") or ""
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage["prompt_tokens"]
            rec.completion_tokens = usage["completion_tokens"]
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not done and not rec.error:
        rec.error = "stream ended without [DONE]"


async def run_jobs(url: str, jobs: list[TextJob], **kw: Any) -> tuple[list[HttpRecord], float]:
    """Every job at once (W2 arrives at t=0); returns records in job order and the wall time."""
    t0 = time.perf_counter()
    out: dict[str, HttpRecord] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(limits=limits, trust_env=False) as client,
        trio.open_nursery() as nursery,
    ):

        async def one(job: TextJob) -> None:
            out[job.rid] = await complete(client, url, job, t0=t0, **kw)

        for job in jobs:
            nursery.start_soon(one, job)
    return [out[j.rid] for j in jobs], time.perf_counter() - t0


def hit_rate(records: list[HttpRecord]) -> float:
    """Cached prompt tokens over prompt tokens, over the requests that succeeded."""
    ok = [r for r in records if r.status == 200 and not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0


def reference_texts(model_dir: Path, jobs: list[TextJob], max_tokens: int) -> dict[str, str]:
    """transformers' greedy continuation of each prompt, decoded as the server decodes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, str] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one request at a time: more threads only fight the replicas
    try:
        with torch.no_grad():
            for job in jobs:
                ids = torch.tensor([tok(job.prompt).input_ids])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                )
                out[job.rid] = str(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    finally:
        torch.set_num_threads(threads)
    return out
