"""The front door (tokenizer service) is SIGKILLed mid-stream: the Python clients (``open_client``
and ``SyncClient``) resubmit their requests with the tokens they received once its successor
serves, and every stream ends with exactly the tokens of an uninterrupted run, each once. Nothing
of the dead front door's requests is left behind (KV blocks, scheduler or executor requests)."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from actors.client import ConnectionLost, SyncClient, open_client
from messages import client as cm
from messages import executor as xm
from tests.runtime import kv_stats, query, start_runtime, wait_until
from tests.test_resume import run_all as stream_all

# The front door is killed once the clients have *read* 60 tokens, and the runtime runs ahead of
# a client the full suite slows down: at 48 tokens a stream, one run of `make test` found every
# stream already sent when the kill came (nothing to resume). 128 a stream keeps them running.
SPECS = [
    {
        "prompt_ids": [5 + i, 9, 11 + i, 4],
        "max_tokens": 128,
        "ignore_eos": True,
        "request_id": f"f{i}",
        **({"temperature": 0.8, "seed": 7 + i} if i % 2 else {}),
    }
    for i in range(8)
]
SYNC = {"prompt_ids": [8, 6, 4, 2], "max_tokens": 128, "ignore_eos": True, "seed": 3}
SYNC["temperature"] = 0.7


def sync_stream(endpoint: str, seen: list[int]) -> list[int]:
    with SyncClient(endpoint) as c:
        for msg in c.stream(**SYNC):
            if isinstance(msg, cm.Delta):
                seen.extend(msg.token_ids)
    return list(seen)


@pytest.mark.deadline(150)
async def test_front_door_sigkill_clients_resume_exact(tiny_model, tmp_path):
    with start_runtime(tiny_model, tmp_path / "rt", "--max-batch-size", "4") as rt:
        reference = await stream_all(rt, SPECS)
        ref_sync = await trio.to_thread.run_sync(sync_stream, rt.endpoint, [])
        old_pid = rt.pid_of("tokenizer")
        streamed = 0

        def count() -> None:
            nonlocal streamed
            streamed += 1
            if streamed == 60:
                os.kill(old_pid, signal.SIGKILL)

        seen: list[int] = []
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                result: dict = {}

                async def run_sync() -> None:
                    result["sync"] = await trio.to_thread.run_sync(sync_stream, rt.endpoint, seen)

                nursery.start_soon(run_sync)
                resumed = await stream_all(rt, SPECS, count)
        assert rt.pid_of("tokenizer") != old_pid
        assert resumed == reference  # every stream: each token once, none missing
        assert result["sync"] == ref_sync
        assert rt.events("client.resumed"), "no client resumed its stream"
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # the dead front door is gone, not a zombie left behind

        async def clean():
            s = await kv_stats(rt)
            x = await query(rt.actor_endpoint("executor"), xm.Stats(), xm.ExecutorStats)
            return s.check_ok and s.in_use == 0 and s.running == 0 and x.running == 0

        await wait_until(clean, timeout=15)


@pytest.mark.deadline(120)
async def test_front_door_sigkill_without_resume_fails_fast(tiny_model, tmp_path):
    with start_runtime(tiny_model, tmp_path / "rt") as rt:
        async with open_client(rt.endpoint, resume=False) as client:
            old_pid = rt.pid_of("tokenizer")
            with trio.fail_after(10), pytest.raises(ConnectionLost, match="tokenizer service"):
                async for msg in client.stream(prompt_ids=[5, 6], max_tokens=1000, ignore_eos=True):
                    if isinstance(msg, cm.Delta) and old_pid:
                        os.kill(old_pid, signal.SIGKILL)
                        old_pid = 0
