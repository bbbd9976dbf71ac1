"""Kill any actor with SIGKILL: in-flight requests end with an error naming it, the supervisor
restarts it, the others re-sync, and new requests succeed."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import trio

from actors.client import RequestError, open_client
from tests.runtime import kv_stats, start_runtime, wait_until

ACTORS = ["tokenizer", "scheduler", "kv_manager", "executor"]


@pytest.mark.deadline(180)
@pytest.mark.parametrize("victim", ACTORS)
async def test_sigkill_actor_fails_inflight_then_recovers(victim, tiny_model, tmp_path):
    # A pool that fits one long request at a time: the others wait in the queue, in flight.
    flags = ("--num-blocks", "80", "--kv-mode", "full")
    with start_runtime(tiny_model, tmp_path / "rt", *flags) as rt:
        outcomes: list = []
        async with open_client(rt.endpoint) as client:

            async def one(i: int) -> None:
                try:
                    outcomes.append(
                        await client.generate(
                            prompt_ids=[5 + i, 6, 7, 8], max_tokens=1000, ignore_eos=True
                        )
                    )
                except RequestError as e:
                    outcomes.append(e)

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
                await wait_until(lambda: rt.events("executor.prefill_done"), timeout=30)
                old_pid = rt.pid_of(victim)
                killed_at = time.monotonic()
                os.kill(old_pid, signal.SIGKILL)
                await wait_until(lambda: len(outcomes) == 6, timeout=10)
                ended_after = time.monotonic() - killed_at
        errors = [o for o in outcomes if isinstance(o, RequestError)]
        assert len(errors) >= 5, outcomes  # at most the one running request may have finished
        if victim == "tokenizer":
            # the front door itself died: the client notices (silence, or its successor's boot id)
            said = r"tokenizer service (stopped answering|restarted)"
        else:
            # the tokenizer service stays up, learns of the death (by heartbeats, or from the
            # scheduler) and says which actor died or restarted
            said = rf"\b{victim} (died \(no heartbeat|restarted \(new boot id).*; request aborted"
        for e in errors:
            assert e.code == "actor_dead" and re.search(said, str(e)), e
        assert ended_after < 6.0, f"in-flight requests took {ended_after:.1f}s to fail"

        await wait_until(lambda: rt.pid_of(victim) != old_pid, timeout=30)  # restarted
        assert rt.events("supervisor.child_restarted")

        async def recovered():
            try:
                async with open_client(rt.endpoint) as c:
                    return await c.generate(prompt_ids=[9, 10, 11], max_tokens=4)
            except (RequestError, TimeoutError):
                return None

        res = await wait_until(recovered, timeout=60, interval=0.5)
        assert len(res.token_ids) == 4

        async def clean():
            s = await kv_stats(rt)
            return s.check_ok and s.in_use == 0

        await wait_until(clean, timeout=15)
