"""Test helpers for the HTTP API: a real runtime serving HTTP on a free port, and transformers'
references for what its answers must be."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from tests.support.runtime import Runtime, poll_until, start_runtime

MAX_NEW = 12
PROMPT = "the quick model serves a request"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class HttpRuntime:
    rt: Runtime
    url: str  # http://127.0.0.1:PORT
    model: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)


def aclient(server: HttpRuntime) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def random_ids(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def health(url: str, timeout: float = 10.0) -> httpx.Response | None:
    """``GET /health``, or None when it does not answer (a loaded machine, a restart)."""
    try:
        return httpx.get(url + "/health", timeout=timeout)
    except httpx.HTTPError:
        return None


def wait_healthy(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> None:
    last = [""]

    def ok() -> bool:
        try:
            r = httpx.get(url + "/health", timeout=2.0, headers=headers)
        except httpx.HTTPError as e:
            last[0] = repr(e)
            return False
        last[0] = r.text
        return r.status_code == 200

    try:
        poll_until(ok, timeout, f"{url}/health to answer 200", interval=0.1)
    except TimeoutError:
        raise RuntimeError(f"{url}/health never answered 200: {last[0]}") from None


@contextmanager
def start_http_runtime(
    model: Path, run_dir: Path, *flags: str, api_key: str = ""
) -> Iterator[HttpRuntime]:
    """``minirt up`` with its HTTP server on a free loopback port; yields once /health is 200."""
    port = free_port()
    http_flags = ["--http-port", str(port)]
    if api_key:
        http_flags += ["--api-key", api_key]
    url = f"http://127.0.0.1:{port}"
    with start_runtime(model, run_dir, *flags, *http_flags) as rt:
        wait_healthy(url)
        yield HttpRuntime(rt, url, model)


def hf_chat_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids transformers' chat template gives (the reference for chat requests)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def hf_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[list[float]]:
    """transformers' log-softmax at every output position (teacher-forced on ``output``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    return torch.log_softmax(logits.float(), dim=-1).tolist()
