"""Chaos soak (``make test-slow``): the soak of tests/reliability/test_soak.py (2,000 requests from 256
clients) while a random actor other than the front door is SIGKILLed every few seconds. Every
request ends exactly once and none fails (0 lost), every finished stream has exactly the tokens of
the same soak run without kills (0 duplicated or missing), the pool is clean afterwards (0 leaked
blocks) and memory stays bounded. Each kill comes a few seconds after the runtime serves again. Prints the added latency (TTFT and end-to-end p50/p99) for
docs/reliability.md."""

from __future__ import annotations

import collections
import os
import random
import signal

import pytest
import trio

from minirt.client import open_client
from tests.reliability.test_soak import FLAGS, TERMINAL, soak
from tests.support.runtime import kv_stats, start_runtime, wait_until
from tests.support.steps import Steps

VICTIMS = ("scheduler", "kv_manager", "executor")
KILLS_PER_ACTOR = 4  # the supervisor gives up on an actor after 5 restarts


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def latency(report: dict) -> dict[str, float]:
    t = report["timings"].values()
    ttft = [x.get("ttft_s", 0.0) for x in t]
    e2e = [x.get("total_s", 0.0) for x in t]
    return {
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p50": pct(e2e, 0.5),
        "e2e_p99": pct(e2e, 0.99),
    }


def chaos_run(tiny_model, tmp_path, total: int, clients: int, kill_every: float) -> None:
    flags = (*FLAGS, "--max-waiting", "200")
    with start_runtime(tiny_model, tmp_path / "calm", *flags) as rt:
        calm = trio.run(soak, rt, total, clients)
        # the kills are spaced by the executor's progress: as many steps as the calm run made
        # in ``kill_every`` seconds (so a loaded machine stretches the schedule, not thins it)
        every_steps = max(1, round(Steps.of(rt).count() * kill_every / calm["elapsed"]))
    kills: list[tuple[str, int]] = []

    with start_runtime(tiny_model, tmp_path / "chaos", *flags) as rt:
        rng = random.Random(7)

        # each actor in turn (in a random order each round), so a short soak meets all three
        order = [v for _ in range(KILLS_PER_ACTOR) for v in rng.sample(VICTIMS, len(VICTIMS))]

        steps = Steps.of(rt)

        async def killer() -> None:
            count = collections.Counter[str]()
            for victim in order:
                await steps.reach(steps.count() + round(every_steps * rng.uniform(0.6, 1.4)))
                pid = rt.pid_of(victim)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue  # already down (restarting)
                count[victim] += 1
                kills.append((victim, pid))
                # the next kill comes a few seconds after the runtime serves again
                await wait_until(lambda v=victim, p=pid: rt.pid_of(v) != p, timeout=60)
                async with open_client(rt.endpoint, ready_timeout=60):
                    pass

        chaos = trio.run(soak, rt, total, clients, 0, killer)

        async def settled() -> None:
            # a kill near the end: its restart, and a runtime that serves and holds nothing
            await wait_until(
                lambda: len(rt.events("supervisor.child_restarted")) == len(kills), timeout=60
            )
            async with open_client(rt.endpoint, ready_timeout=60):
                pass

            async def clean() -> bool:
                s = await kv_stats(rt)
                return s.check_ok and s.in_use == 0 and s.running == 0

            await wait_until(clean, timeout=30)

        trio.run(settled)
        ends = collections.Counter(
            e["client_request_id"]
            for e in rt.events()
            if e.get("event") in TERMINAL and e.get("actor") == "tokenizer"
        )
        resumed = rt.events("request.resumed")
        rebuilt = rt.events("kv.rebuilt")
        reconciled = rt.events("scheduler.reconciled")[1:]  # after the first start
        restarts = rt.events("supervisor.child_restarted")

    assert kills, "nothing was killed"
    assert len(restarts) == len(kills), (restarts, kills)
    outcomes = chaos["outcomes"]
    assert len(outcomes) == total, f"lost {total - len(outcomes)} requests"
    kinds = collections.Counter(outcomes.values())
    # 0 failed: "refused" are new requests refused at once (never accepted) while an actor was down
    assert set(kinds) <= {"stop", "length", "abort", "aborted", "overloaded", "refused"}, kinds
    assert set(ends) == set(outcomes) and max(ends.values()) == 1  # each ended exactly once
    # token for token what the calm run gave, for every request finished in both
    # (each run refuses most requests as overloaded, and which ones is timing, so the overlap
    # is what the comparison can cover: at least half what chance alone would leave, never
    # nothing; CI's 2-core machine left 185 of 2,000)
    # (how many finish between kills 1.5 s apart depends on the machine's speed: on this
    # project's 2-core machine 444-622 of 2,000 in runs minutes apart, the calm run 567-606;
    # so the bar is relative to the calm run on the same machine)
    finished = len(chaos["tokens"])
    assert finished > len(calm["tokens"]) // 2, f"too few finished under the kills: {finished}"
    both = [r for r in chaos["tokens"] if r in calm["tokens"]]
    by_chance = finished * len(calm["tokens"]) / total
    assert len(both) > max(50, by_chance / 2), (len(both), by_chance)
    differ = [r for r in both if chaos["tokens"][r] != calm["tokens"][r]]
    assert not differ, differ[:5]
    s = chaos["stats"]  # soak() waited for: check passes, 0 blocks in use, 0 running
    assert s.check_ok and s.in_use == 0 and s.running == 0
    # the front door lived through it all: its memory is flat; restarted actors are not bigger
    # than before the kills
    for a, end in chaos["end"].items():
        limit = 0.10 if a == "tokenizer" else 0.25
        assert end <= chaos["warm"].get(a, end) * (1 + limit), (a, chaos["warm"], chaos["end"])
    calm_l, chaos_l = latency(calm), latency(chaos)
    # a resume with output tokens recomputes an attempt a crash cut short; one without is a
    # request refused while the runtime settled, submitted again
    cut = [e for e in resumed if e["output_tokens"]]
    print(
        f"\nchaos soak: {total} requests, {clients} clients, kills "
        f"{dict(collections.Counter(v for v, _ in kills))}, resumed {len(resumed)} "
        f"({len(cut)} cut short, recomputing {sum(e['recomputed_tokens'] for e in cut)} tokens; "
        f"by reason {dict(collections.Counter(e['reason'].split(' (')[0] for e in resumed))}), "
        f"kv rebuilds {len(rebuilt)}, reconciliations {len(reconciled)}, "
        f"{len(both)} streams compared with the calm run's, "
        f"outcomes {dict(kinds)}, wall {calm['elapsed']:.1f}s calm / "
        f"{chaos['elapsed']:.1f}s chaos\n"
        + "\n".join(f"  {k}: {calm_l[k]:.3f}s calm, {chaos_l[k]:.3f}s chaos" for k in calm_l)
    )


@pytest.mark.slow
def test_chaos_soak(tiny_model, tmp_path):
    chaos_run(tiny_model, tmp_path, total=2000, clients=256, kill_every=1.5)
