"""Slow is not dead: an actor that is stopped (SIGSTOP), or starved of CPU by a cgroup quota,
makes its peers suspect it, and nothing is failed or reset; requests finish with the tokens of
an undisturbed run. A real kill -9 is still detected at once (its process's exit, through a
pidfd) and resumed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from minirt.client import RequestError, open_client
from tests.support.runtime import Runtime, kv_stats, start_runtime, wait_until

ACTORS = ["tokenizer", "scheduler", "kv_manager", "executor"]
PROMPTS = [[5 + i, 6, 7, 8] for i in range(4)]
CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller


async def _generate_all(rt: Runtime, max_tokens: int, during=None, rounds: int = 2) -> list:
    """The PROMPTS at once; ``during(rt)`` runs once all are admitted and the first tokens came
    (streams in flight; ``rounds``: this is the run's Nth batch of PROMPTS). Returns each
    request's result or RequestError."""
    outcomes: list = [None] * len(PROMPTS)
    async with open_client(rt.endpoint) as client:

        async def one(i: int) -> None:
            try:
                outcomes[i] = await client.generate(
                    prompt_ids=PROMPTS[i], max_tokens=max_tokens, ignore_eos=True
                )
            except RequestError as e:
                outcomes[i] = e

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
            if during is not None:  # every request admitted (in flight), the first streaming
                await wait_until(
                    lambda: len(rt.events("request.admitted")) >= len(PROMPTS) * rounds,
                    timeout=60,
                )
                await wait_until(lambda: rt.events("executor.prefill_done"), timeout=30)
                await during(rt)
    return outcomes


def _suspected_by_all(rt: Runtime, victim: str) -> bool:
    said = {e["actor"] for e in rt.events("peer.suspect") if e.get("peer") == victim}
    return said >= {a for a in ACTORS if a != victim}


@pytest.mark.deadline(240)
@pytest.mark.parametrize("victim", ACTORS)
async def test_an_actor_stopped_for_10s_fails_nothing(victim, tiny_model, tmp_path):
    """SIGSTOP an actor for 10 s mid-stream, then SIGCONT: every peer logs it suspect, then
    cleared; no peer.dead, no request fails, the tokens are those of an undisturbed run."""
    with start_runtime(tiny_model, tmp_path / "rt", "--num-blocks", "256") as rt:
        reference = await _generate_all(rt, 400)

        async def pause(rt: Runtime) -> None:
            pid = rt.pid_of(victim)
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await wait_until(lambda: _suspected_by_all(rt, victim), timeout=30)
                # the rest of the 10 s pause, watching for the one thing that must not happen
                left = max(0.0, 10.0 - (time.monotonic() - stopped_at))
                died = None
                with trio.move_on_after(left):
                    died = await wait_until(
                        lambda: [e for e in rt.events("peer.dead") if e["peer"] == victim],
                        timeout=left + 1,
                    )
                assert not died, died
            finally:
                os.kill(pid, signal.SIGCONT)

        outcomes = await _generate_all(rt, 400, during=pause)
        assert not [o for o in outcomes if isinstance(o, RequestError)], outcomes
        assert [o.token_ids for o in outcomes] == [r.token_ids for r in reference]
        await wait_until(
            lambda: (
                {e["actor"] for e in rt.events("peer.cleared") if e["peer"] == victim}
                >= {a for a in ACTORS if a != victim}
            ),
            timeout=15,
        )
        assert not rt.events("peer.dead"), rt.events("peer.dead")
        assert not rt.events("request.resumed") and not rt.events("supervisor.child_exited")
        assert all(e["silent_s"] >= 9.0 for e in rt.events("peer.cleared"))


@contextlib.contextmanager
def cpu_quota(pids: list[int], percent_of_a_core: int) -> Iterator[None]:
    """Put ``pids`` in a cgroup (v1 cpu controller) limited to ``percent_of_a_core`` % of one
    core; moved back and removed after."""
    if not (CPU / "cpu.cfs_quota_us").exists() or not os.access(CPU, os.W_OK):
        pytest.skip("no writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = CPU / f"minirt-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(1000 * percent_of_a_core))
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU / "cgroup.procs").write_text(pid)
        group.rmdir()


@pytest.mark.deadline(300)
async def test_a_runtime_starved_by_a_cpu_quota_fails_nothing(tiny_model, tmp_path):
    """Every actor in a cgroup with 10% of one core for the whole run (a container's --cpus, a
    Kubernetes CPU limit): steps and heartbeats stall for whole periods, yet every request
    completes with the undisturbed tokens, and no peer is declared dead or reset."""
    with start_runtime(tiny_model, tmp_path / "rt", "--num-blocks", "256") as rt:
        reference = await _generate_all(rt, 200)
        with cpu_quota([rt.pid_of(a) for a in ACTORS], 10):
            outcomes = await _generate_all(rt, 200)
        assert not [o for o in outcomes if isinstance(o, RequestError)], outcomes
        assert [o.token_ids for o in outcomes] == [r.token_ids for r in reference]
        assert not rt.events("peer.dead"), rt.events("peer.dead")
        assert not rt.events("request.resumed") and not rt.events("supervisor.child_exited")


def _group(name: str, shares: int) -> Path:
    if not (CPU / "cpu.shares").exists() or not os.access(CPU, os.W_OK):
        pytest.skip("no writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = CPU / f"minirt-test-{name}-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    (group / "cpu.shares").write_text(str(shares))
    return group


def _release(group: Path) -> None:
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            (CPU / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


SPIN = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass"


@contextlib.contextmanager
def noisy_neighbours(pids: list[int], seconds: float) -> Iterator[list[subprocess.Popen]]:
    """A noisy neighbour: twice as many busy loops as cores, for ``seconds``, in a cgroup of the
    highest CPU weight (cpu.shares 262144), while ``pids`` sit in one of the lowest (2): they get
    about one cycle in 100,000, so every actor and the supervisor stall for the whole time (as
    on a host whose other tenants take the cores)."""
    low, high = _group("low", 2), _group("high", 262144)
    spinners: list[subprocess.Popen] = []
    try:
        for pid in pids:
            (low / "cgroup.procs").write_text(str(pid))
        for _ in range(2 * (os.cpu_count() or 1)):
            p = subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)])
            spinners.append(p)
            (high / "cgroup.procs").write_text(str(p.pid))
        yield spinners  # each exits after ``seconds``
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        _release(high)
        _release(low)


@pytest.mark.deadline(300)
async def test_a_runtime_starved_by_noisy_neighbours_fails_nothing(tiny_model, tmp_path):
    """Busy loops (twice the cores) take nearly every cycle for 8 s while requests stream: every
    actor and the supervisor stall together, heartbeats stop; every request completes with the
    undisturbed tokens, no peer is declared dead, nothing is reset."""
    with start_runtime(tiny_model, tmp_path / "rt", "--num-blocks", "256") as rt:
        reference = await _generate_all(rt, 400)

        async def starve(rt: Runtime) -> None:
            pids = [rt.pid_of(a) for a in ACTORS] + [rt.proc.pid]
            with noisy_neighbours(pids, 8.0) as spinners:
                for p in spinners:
                    await trio.to_thread.run_sync(p.wait)

        outcomes = await _generate_all(rt, 400, during=starve)
        assert not [o for o in outcomes if isinstance(o, RequestError)], outcomes
        assert [o.token_ids for o in outcomes] == [r.token_ids for r in reference]
        assert not rt.events("peer.dead"), rt.events("peer.dead")
        assert not rt.events("request.resumed") and not rt.events("supervisor.child_exited")
        assert rt.events("peer.suspect"), "the starvation did not stall the heartbeats"


@pytest.mark.slow
@pytest.mark.deadline(300)
@pytest.mark.parametrize("victim", ["scheduler", "kv_manager", "executor"])
async def test_a_kill_during_starvation_is_detected_at_once_and_resumed(
    victim, tiny_model, tmp_path
):
    """kill -9 of an actor while the runtime is starved: its peers know from its exit (not from
    silence) within seconds, it is restarted, and the requests resume to the same tokens."""
    with start_runtime(tiny_model, tmp_path / "rt", "--num-blocks", "256") as rt:
        reference = await _generate_all(rt, 200)
        killed: dict[str, float] = {}

        async def kill(rt: Runtime) -> None:
            killed["at"] = time.time()
            os.kill(rt.pid_of(victim), signal.SIGKILL)

        with cpu_quota([rt.pid_of(a) for a in ACTORS], 20):
            outcomes = await _generate_all(rt, 200, during=kill)
        assert not [o for o in outcomes if isinstance(o, RequestError)], outcomes
        assert [o.token_ids for o in outcomes] == [r.token_ids for r in reference]
        dead = [e for e in rt.events("peer.dead") if e["peer"] == victim]
        assert dead and all("exited" in e["reason"] or "restarted" in e["reason"] for e in dead)
        took = min(float(e["ts"]) for e in dead) - killed["at"]
        assert took < 5.0, f"the death was noticed {took:.1f}s after the kill"

        async def clean():
            s = await kv_stats(rt)
            return s.check_ok and s.in_use == 0

        await wait_until(clean, timeout=30)
