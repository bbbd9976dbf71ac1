"""The front door (tokenizer service) is SIGKILLed mid-stream: the Python clients (``open_client``
and ``SyncClient``) resubmit their requests with the tokens they received once its successor
serves, and every stream ends with exactly the tokens of an uninterrupted run, each once. Nothing
of the dead front door's requests is left behind (KV blocks, scheduler or executor requests)."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from messages import client as cm
from messages import executor as xm
from minirt.client import ConnectionLost, SyncClient, open_client
from tests.reliability.test_resume import run_all as stream_all
from tests.support.runtime import kv_stats, query, start_runtime, stopped, wait_until
from tests.support.steps import Steps

# An eighth into the second run, counted in the executor's own steps (a process of its own reads
# its log), the executor is stopped; once the clients have read tokens, the front door is killed
# and the executor runs on. Every stream is then in flight with tokens received, however far the
# clients lag behind the runtime on a loaded machine (a count of tokens read alone came after
# every stream was sent; a count of steps alone before any client had read a token).
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
        steps = Steps.of(rt)
        reference = await stream_all(rt, SPECS)
        ref_sync = await trio.to_thread.run_sync(sync_stream, rt.endpoint, [])
        old_pid = rt.pid_of("tokenizer")
        took = await steps.settled(rt)  # the reference runs' steps (a fresh runtime)
        executor = rt.pid_of("executor")
        stopper = steps.killer(took + took // 8, executor, signal.SIGSTOP)
        received: dict[str, int] = {}  # each stream's tokens read so far (-1: ended)

        def count(rid: str, n: int) -> None:
            received[rid] = n

        async def kill_when_read() -> None:
            await wait_until(lambda: stopper.poll() is not None, timeout=60, interval=0.01)
            # a stream in flight with tokens read: its client resumes after them
            await wait_until(
                lambda: max(received.values(), default=0) > 0, timeout=30, interval=0.01
            )
            os.kill(old_pid, signal.SIGKILL)
            os.kill(executor, signal.SIGCONT)

        seen: list[int] = []
        try:
            with trio.fail_after(90):
                async with trio.open_nursery() as nursery:
                    result: dict = {}

                    async def run_sync() -> None:
                        result["sync"] = await trio.to_thread.run_sync(
                            sync_stream, rt.endpoint, seen
                        )

                    nursery.start_soon(run_sync)
                    nursery.start_soon(kill_when_read)
                    resumed = await stream_all(rt, SPECS, count)
        finally:
            stopper.terminate()
            stopped_it = stopper.wait() == 0
            os.kill(executor, signal.SIGCONT)
        assert stopped_it, "the executor was never stopped"
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
        # the executor stopped: the request is still in flight when the front door dies,
        # however fast the model or loaded the machine
        async with open_client(rt.endpoint, resume=False) as client:
            old_pid = rt.pid_of("tokenizer")
            with (
                stopped(rt, "executor"),
                trio.fail_after(10),
                pytest.raises(ConnectionLost, match="tokenizer service"),
            ):
                async for msg in client.stream(prompt_ids=[5, 6], max_tokens=1000, ignore_eos=True):
                    if isinstance(msg, cm.Accepted) and old_pid:
                        os.kill(old_pid, signal.SIGKILL)
                        old_pid = 0
