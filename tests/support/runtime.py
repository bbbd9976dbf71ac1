"""Test helpers: start a real ``minirt up`` (four actor processes) and talk to it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio
import zmq

from actors.runtime.transport import open_socket
from messages import kv as km
from messages.codec import Decoder, encode
from minirt.launch.launch import Runtime, start_runtime  # noqa: F401  (re-exported for tests)


async def query(endpoint: str, msg: Any, reply_type: Any, timeout: float = 5.0) -> Any:
    """Send ``msg`` to an actor inbox and return its typed reply."""
    sock = open_socket(zmq.Context.instance(), zmq.DEALER, connect=[endpoint])
    try:
        with trio.fail_after(timeout):
            await sock.send([encode(msg)])
            frames = await sock.recv()
        return Decoder(reply_type).decode(frames[-1])
    finally:
        sock.close()


async def kv_stats(rt: Runtime) -> km.Stats:
    return await query(rt.actor_endpoint("kv_manager"), km.StatsQuery(check=True), km.Stats)


async def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll ``cond`` (sync or async) until truthy; fails after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while True:
            value = cond()
            if hasattr(value, "__await__"):
                value = await value
            if value:
                return value
            await trio.sleep(interval)


def poll_until(
    cond: Callable[[], Any], timeout: float = 10.0, what: str = "", interval: float = 0.05
) -> Any:
    """Blocking ``wait_until`` (threads, sync clients): call ``cond`` until it returns something
    truthy (returned); ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what or cond}")
        time.sleep(interval)


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """transformers' greedy ``generate``, one request at a time (the reference). ``ignore_eos``
    runs on past EOS tokens (without suppressing them, unlike ``min_new_tokens``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


@contextmanager
def stopped(rt: Runtime, actor: str) -> Iterator[int]:
    """``actor`` stopped (SIGSTOP) inside the block, running again (SIGCONT) after it; yields its
    pid. A stopped executor makes no progress: what a test does meanwhile (hang up, cancel, kill
    a peer) happens before a request can end, however fast the model or loaded the machine.
    Its peers find it suspect, never dead (docs/reliability.md)."""
    pid = rt.pid_of(actor)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)
