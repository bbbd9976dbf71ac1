"""Overload and soak: many concurrent clients against a small KV pool. Every request ends exactly
once (finished, aborted, overloaded or error with a reason), nothing leaks, memory is flat.

The fast variant runs in every `make test`; the full one (2,000 requests, 256 clients) is marked
slow and runs in .ci/run (`make test-slow`)."""

from __future__ import annotations

import collections
import random
import time

import msgspec
import pytest
import trio

from messages import client as cm
from minirt.client import RequestError, open_client
from tests.support.runtime import kv_stats, start_runtime, wait_until

MAX_PREEMPTIONS = 3
TERMINAL = ("client.completed", "client.failed", "client.rejected")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def rss_all(rt) -> dict[str, int]:
    """Each actor's RSS (kB); an actor that is down just now (the chaos soak) is left out."""
    out = {}
    for a in ACTORS:
        try:
            out[a] = rss_kb(rt.pid_of(a))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


async def soak(rt, total: int, clients: int, seed: int = 0, during=None) -> dict:
    """Run the soak; ``during(cancel_scope)``, if given, runs beside the clients until they are
    done (the chaos soak kills actors there). Request ``i`` is the same in every run of a seed
    (its own RNG), so two runs can be compared token for token."""
    issued = 0
    outcomes: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    timings: dict[str, dict] = {}
    warm: dict[str, int] = {}
    warm_at = total // 5
    ended = [trio.Event()]  # set (and replaced) each time one of the soak's requests ends

    def one_ended() -> None:
        ended[0].set()
        ended[0] = trio.Event()

    async def client_loop(cid: int) -> None:
        nonlocal issued
        async with open_client(rt.endpoint) as c:
            while issued < total:
                i = issued
                issued += 1
                if i == warm_at:
                    warm.update(rss_all(rt))
                rid = f"soak-{i}"
                rng = random.Random(seed * 1_000_003 + i)
                prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 120))]
                cancel = rng.random() < 0.05
                got: list[int] = []
                accepted = False
                try:
                    async for msg in c.stream(
                        prompt_ids=prompt,
                        max_tokens=rng.randint(4, 40),
                        ignore_eos=rng.random() < 0.5,
                        request_id=rid,
                    ):
                        accepted = accepted or isinstance(msg, cm.Accepted)
                        if isinstance(msg, cm.Delta):
                            got.extend(msg.token_ids)
                            if cancel:
                                break  # leaving the stream cancels the request
                        if isinstance(msg, cm.Final):
                            outcomes[rid] = msg.finish_reason
                            assert msg.usage.completion_tokens == len(got), rid  # none twice
                            tokens[rid] = got
                            timings[rid] = msgspec.structs.asdict(msg.timings)
                    if cancel and rid not in outcomes:
                        outcomes[rid] = "aborted"
                    one_ended()
                except RequestError as e:
                    # refused before it was accepted because an actor is down (the chaos soak):
                    # never queued, so not lost; the client retries later
                    refused = e.code == "actor_dead" and not accepted
                    outcomes[rid] = "refused" if refused else f"{e.code}"
                    if refused:  # back off until the runtime serves again (its Welcome says)
                        await c.hello(ready_timeout=60)
                    elif e.code == "overloaded":  # back off until a request of the soak ends
                        with trio.move_on_after(5):
                            await ended[0].wait()
                    else:
                        one_ended()

    t0 = time.monotonic()
    async with trio.open_nursery() as outer:
        if during is not None:
            outer.start_soon(during)
        async with trio.open_nursery() as nursery:
            for cid in range(clients):
                nursery.start_soon(client_loop, cid)
        outer.cancel_scope.cancel()
    elapsed = time.monotonic() - t0

    async def drained():
        s = await kv_stats(rt)
        return s if s.check_ok and s.in_use == 0 and s.running == 0 else None

    stats = await wait_until(drained, timeout=30)
    end = rss_all(rt)
    return {
        "outcomes": outcomes,
        "tokens": tokens,
        "timings": timings,
        "elapsed": elapsed,
        "warm": warm,
        "end": end,
        "stats": stats,
    }


ACTORS = ("tokenizer", "scheduler", "kv_manager", "executor")


def check(rt, report: dict, total: int) -> dict:
    outcomes = report["outcomes"]
    assert len(outcomes) == total, f"lost {total - len(outcomes)} requests"
    kinds = collections.Counter(outcomes.values())
    # a calm soak: no actor dies (tests/reliability/test_chaos.py kills them on purpose), so no request
    # fails for a death, however loaded the machine
    assert set(kinds) <= {"stop", "length", "abort", "aborted", "overloaded"}, kinds
    deaths = [e for e in rt.events() if e.get("event") in ("peer.dead", "supervisor.child_exited")]
    assert not deaths, deaths[:3]
    # exactly one terminal event per request at the front door: none lost, none duplicated
    ends = collections.Counter(
        e["client_request_id"]
        for e in rt.events()
        if e.get("event") in TERMINAL and e.get("actor") == "tokenizer"
    )
    assert set(ends) == set(outcomes), "a request ended without a terminal event"
    assert max(ends.values()) == 1, [r for r, n in ends.items() if n > 1][:5]
    # preemption thrash is bounded: past MAX_PREEMPTIONS the next admission reserves everything
    requeued = [e["preemptions"] for e in rt.events("request.requeued")]
    assert max(requeued, default=0) <= MAX_PREEMPTIONS + 1
    growth = {a: report["end"][a] / report["warm"][a] - 1 for a in ACTORS}
    for a, g in growth.items():
        assert g <= 0.10, (
            f"{a} memory grew {g:.1%} after warm-up ({report['warm'][a]} -> {report['end'][a]} kB)"
        )
    return {
        "kinds": dict(kinds),
        "growth": growth,
        "preempted": len(requeued),
        "refused": len(rt.events("admission.refused")),
        "evicted": len(rt.events("kv.evicted")),
    }


FLAGS = ("--num-blocks", "96", "--kv-mode", "on_demand", "--max-batch-size", "24")


def run(tiny_model, tmp_path, total: int, clients: int, max_waiting: int) -> dict:
    flags = (*FLAGS, "--max-waiting", str(max_waiting))
    with start_runtime(tiny_model, tmp_path / "rt", *flags) as rt:
        report = trio.run(soak, rt, total, clients)
        summary = check(rt, report, total)
    summary.update(
        total=total,
        clients=clients,
        seconds=round(report["elapsed"], 1),
        rss_warm_kb=report["warm"],
        rss_end_kb=report["end"],
    )
    print(f"\nsoak: {summary}")
    return summary


def test_soak_fast(tiny_model, tmp_path):
    s = run(tiny_model, tmp_path, total=300, clients=64, max_waiting=16)
    assert s["kinds"].get("overloaded", 0) > 0, "the bounded queue never pushed back"


@pytest.mark.slow
def test_soak_full(tiny_model, tmp_path):
    s = run(tiny_model, tmp_path, total=2000, clients=256, max_waiting=200)
    assert s["kinds"].get("overloaded", 0) > 0 and s["preempted"] > 0 and s["refused"] > 0
