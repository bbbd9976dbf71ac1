"""Test helpers: start a real ``minirt up`` (four actor processes) and talk to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import zmq

from actors.eventlog import read_events
from actors.transport import open_socket
from messages import kv as km
from messages.codec import Decoder, encode


@dataclass
class Runtime:
    run_dir: Path
    proc: subprocess.Popen[str]
    endpoint: str

    def actor_endpoint(self, name: str) -> str:
        return f"ipc://{self.run_dir / 'sock' / name}"

    def events(
        self, name: str | None = None, request_id: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            e
            for e in read_events(self.run_dir)
            if (name is None or e.get("event") == name)
            and (request_id is None or e.get("request_id") == request_id)
        ]

    def pid_of(self, actor: str) -> int:
        starts = [e for e in self.events("actor.started") if e.get("actor") == actor]
        return int(starts[-1]["pid"])


@contextmanager
def start_runtime(
    model: Path, run_dir: Path, *flags: str, timeout: float = 90.0
) -> Iterator[Runtime]:
    """``minirt up`` in a subprocess; yields once it printed ``minirt ready``; stops it after."""
    cmd = [
        sys.executable,
        "-m",
        "actors.cli",
        "up",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        *flags,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        endpoint = None
        assert proc.stdout is not None
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("minirt ready "):
                endpoint = line.split()[2]
                break
        if endpoint is None:
            raise RuntimeError("minirt up did not become ready:\n" + "".join(lines))
        yield Runtime(run_dir, proc, endpoint)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


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
