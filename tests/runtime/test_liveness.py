"""Peer liveness on trio's clock: silence makes a peer suspect, an exit or a restart makes it
dead; with a mock clock.

The pure record (``actors.runtime.liveness``) is driven directly; then two real actors talk over
ipc sockets while a ``MockClock`` runs the heartbeats, so a death takes no real seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from actors.runtime.liveness import Kind, Liveness, LoopLag, State
from messages.client import Welcome
from messages.common import ErrorCode, ErrorReply, Hello, Ping, Pong
from minirt.client import RequestError, ServerWatch

HB = 0.5
TIMEOUT = HB * 3  # suspect_after heartbeats


def kinds(changes: list[Any]) -> list[tuple[str, Kind]]:
    return [(c.peer, c.kind) for c in changes]


async def test_a_silent_peer_is_suspect_never_dead_while_its_process_lives(mock_clock):
    """Silence makes a peer suspect (requests wait); a watched peer (on this host) is never
    declared dead by silence, however long: only its process's exit makes it dead."""
    live = Liveness(["kv", "executor"], heartbeat_s=HB)
    assert live.state("kv") is State.UNSEEN
    first = live.pong("kv", "b1")
    assert first is not None and (first.kind, first.boot_id) == (Kind.SEEN, "b1")
    assert live.state("kv") is State.ALIVE
    assert live.wants_watch("kv", "b1")
    live.watch("kv", "b1", ok=True)
    assert not live.wants_watch("kv", "b1")  # once per process
    for _ in range(10):  # answering every heartbeat: alive however long it runs
        mock_clock.jump(HB)
        assert live.pong("kv", "b1") is None
        assert live.check() == []
    mock_clock.jump(TIMEOUT)  # silent for exactly the timeout: not yet
    assert live.check() == []
    mock_clock.jump(0.01)
    [suspect] = live.check()
    assert (suspect.peer, suspect.kind) == ("kv", Kind.SUSPECT)
    assert suspect.silent_s == pytest.approx(1.51)
    assert live.state("kv") is State.SUSPECT and live.down == frozenset()
    mock_clock.jump(3600)  # an hour stopped (a debugger): still only suspect
    assert live.check() == [] and live.down == frozenset()
    assert live.suspect == {"kv": pytest.approx(3601.51)}
    cleared = live.pong("kv", "b1")  # the same process, after the stall
    assert cleared is not None and cleared.kind is Kind.CLEARED
    assert cleared.silent_s == pytest.approx(3601.51)
    assert live.state("kv") is State.ALIVE and live.suspect == {}
    died = live.exited("kv", "b1", "its process 42 exited")  # the fact
    assert died is not None and died.kind is Kind.DIED
    assert died.reason == "kv died (its process 42 exited)"
    assert live.down == {"kv"}
    assert live.exited("kv", "b1") is None  # declared once
    assert live.pong("kv", "b1") is None  # a late answer of the exited process: ignored
    back = live.pong("kv", "b2")  # its successor
    assert back is not None and back.kind is Kind.BACK and live.wants_watch("kv", "b2")


async def test_a_silent_peer_not_on_this_host_dies_past_the_long_bound_which_adapts(mock_clock):
    """No pid to watch (another container or machine): silence past ``dead_after_s`` is taken
    for death; a peer that came back from a long silence is given 4x that silence next time."""
    live = Liveness(["kv"], heartbeat_s=HB, dead_after_s=60.0)
    live.pong("kv", "b1")
    live.watch("kv", "b1", ok=False)  # not on this host (or no pidfd)
    mock_clock.jump(TIMEOUT + 0.01)
    assert kinds(live.check()) == [("kv", Kind.SUSPECT)]
    mock_clock.jump(58.0)
    assert live.check() == []
    cleared = live.pong("kv", "b1")  # back after 59.5 s: the bound becomes 4 x 59.5 s
    assert cleared is not None and cleared.kind is Kind.CLEARED
    mock_clock.jump(200.0)
    assert kinds(live.check()) == [("kv", Kind.SUSPECT)]  # 200 s < 238 s: not dead
    mock_clock.jump(39.0)
    [died] = live.check()
    assert died.kind is Kind.DIED and live.down == {"kv"}
    assert died.reason == "kv died (no heartbeat for 239.0s, not on this host)"
    mock_clock.jump(10 * HB)
    assert live.check() == []  # declared once, not at every heartbeat
    back = live.pong("kv", "b1")  # the same process after all
    assert back is not None and back.kind is Kind.BACK and live.down == frozenset()


async def test_the_long_bound_grows_with_the_busy_time_a_peer_reports(mock_clock):
    """A peer not on this host that reports its loop lagging 20 s (``Pong.busy_ms``) is given
    10x that, 200 s, before its silence counts as death, not the default 60 s."""
    live = Liveness(["kv"], heartbeat_s=HB, dead_after_s=60.0)
    live.pong("kv", "b1", busy_s=20.0)
    live.watch("kv", "b1", ok=False)
    mock_clock.jump(150.0)
    assert kinds(live.check()) == [("kv", Kind.SUSPECT)]  # 150 s: past 60, not past 200
    mock_clock.jump(49.0)
    assert live.check() == []
    mock_clock.jump(1.5)
    [died] = live.check()
    assert died.kind is Kind.DIED


def test_loop_lag_summarises_each_window_and_remembers_the_worst():
    lag = LoopLag(window_s=10.0)
    assert lag.recent_s == 0.0
    for i in range(19):  # 0.5 s heartbeats: lags of 1 ms, one of 2.5 s
        assert lag.add(2.5 if i == 7 else 0.001, now=0.5 * i) is None
    assert lag.recent_s == 2.5
    window = lag.add(-0.002, now=10.0)  # an early wake counts as no lag
    assert window == {
        "window_s": 10.0,
        "samples": 20,
        "p50_ms": 1.0,
        "p99_ms": 2500.0,
        "max_ms": 2500.0,
    }
    assert lag.recent_s == 2.5  # the last window's worst, until a new window ends
    for i in range(20):
        lag.add(0.001, now=10.5 + 0.5 * i)
    assert lag.recent_s == pytest.approx(0.001)


async def test_a_peer_that_never_answered_is_never_declared_dead(mock_clock):
    live = Liveness(["kv"], heartbeat_s=HB)
    mock_clock.jump(50 * TIMEOUT)
    assert live.check() == [] and live.state("kv") is State.UNSEEN and not live.down


async def test_a_new_boot_id_is_a_restart_and_late_answers_of_the_old_process_are_ignored(
    mock_clock,
):
    live = Liveness(["kv", "executor"], heartbeat_s=HB)
    live.pong("kv", "old")
    live.pong("executor", "x1")
    mock_clock.jump(HB)
    restarted = live.pong("kv", "new")
    assert restarted is not None and restarted.kind is Kind.RESTARTED
    assert restarted.reason == "kv restarted (new boot id new)" and restarted.boot_id == "new"
    assert live.state("kv") is State.ALIVE and not live.down
    assert live.pong("kv", "old") is None  # a stale Pong: neither a restart nor a sign of life
    assert live.pong("kv", "new") is None
    live.pong("executor", "x1")
    mock_clock.jump(TIMEOUT - 0.1)
    live.pong("executor", "x1")
    mock_clock.jump(0.2)
    # the stale Pong did not count: kv is silent since "new" answered; the executor is not
    assert kinds(live.check()) == [("kv", Kind.SUSPECT)]
    assert live.exited("kv", "old") is None  # the replaced process's exit: already known
    died = live.exited("kv", "new")
    assert died is not None and died.kind is Kind.DIED
    back = live.pong("kv", "newer")  # its successor, after the death was noticed
    assert back is not None and (back.kind, back.boot_id) == (Kind.BACK, "newer")
    assert live.peers["kv"].restarts == 2


def test_the_clients_watch_fails_open_requests_on_a_restart_or_silence_only():
    watch = ServerWatch(probe_s=1.0, dead_s=3.0)
    with pytest.raises(RequestError, match="bad_frame"):
        watch.welcomed(ErrorReply(code=ErrorCode.BAD_FRAME, message="?"))
    with pytest.raises(RuntimeError, match="refused the handshake: version 9"):
        watch.welcomed(Welcome(version=1, model="m", max_model_len=8, ok=False, reason="version 9"))
    assert watch.welcomed(Welcome(1, "m", 8, boot_id="b1", ready=False)) is False  # not yet
    assert watch.welcomed(Welcome(1, "m", 8, boot_id="b1")) is True
    watch.heard(Pong(actor="tokenizer", boot_id="b1"), now=10.0)
    assert watch.silence(now=100.0) is None  # nothing open: an idle client waits for nothing
    watch.opened(now=100.0)  # silence counts from the request's start, not the last message
    assert watch.silence(now=102.9) is None
    assert watch.silence(now=103.5) == "tokenizer service stopped answering (3.5s)"
    assert watch.heard(Pong(actor="tokenizer", boot_id="b1"), now=103.6) is None
    lost = watch.heard(Pong(actor="tokenizer", boot_id="b2"), now=103.7)
    assert lost == "tokenizer service restarted; request lost"
    watch.closed()
    assert watch.silence(now=200.0) is None


# ------------------------------------------------------------- two actors over ipc sockets
class Probe(Actor):
    """A real actor with no work of its own: heartbeats and hooks only."""

    inbound = Hello | Ping
    peers = ("scheduler", "kv_manager")

    def __init__(self, name: str, cfg: RuntimeConfig) -> None:
        self.name = name
        super().__init__(cfg)
        self.deaths: list[tuple[str, str]] = []
        self.returns: list[str] = []
        self.changed = trio.Event()
        self.seen = {p: trio.Event() for p in self.peers}  # answered a heartbeat

    def _watch(self, peer: str, pong: Pong) -> None:
        # both actors live in this process, so a "death" is a cancelled task, not an exit: watch
        # no pid, as for a peer on another host (silence past the long bound is its death)
        self.liveness.watch(peer, pong.boot_id, ok=False)

    def _peer_changed(self, change: Any, pid: int = 0) -> None:
        super()._peer_changed(change, pid)
        if change.kind not in (Kind.DIED, Kind.SUSPECT):
            self.seen[change.peer].set()

    def on_peer_dead(self, name: str, reason: str) -> None:
        self.deaths.append((name, reason))
        self.changed.set()

    def on_peer_back(self, name: str) -> None:
        self.returns.append(name)
        self.changed.set()


@pytest.fixture
def heartbeat_clock() -> trio.testing.MockClock:
    """Mock time that jumps to the next heartbeat once every task has been idle for 50 ms of real
    time, so an answer already on its way through a socket arrives before the clock moves (an
    ``autojump_threshold`` of 0 would race the I/O thread, not the code under test)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def test_actor_notices_a_peer_die_and_restart_on_the_mock_clock(heartbeat_clock, tmp_path):
    cfg = RuntimeConfig(run_dir=str(tmp_path), heartbeat_s=HB).resolve()
    (tmp_path / "sock").mkdir()
    watcher = Probe("scheduler", cfg)

    async def wait_change(after: int) -> None:
        while len(watcher.deaths) + len(watcher.returns) <= after:
            watcher.changed = trio.Event()
            await watcher.changed.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(watcher.serve)

        async def start_peer() -> tuple[Probe, trio.CancelScope]:
            peer = Probe("kv_manager", cfg)
            scope = trio.CancelScope()

            async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await peer.serve(task_status)

            await nursery.start(run)
            return peer, scope

        first, first_scope = await start_peer()
        with trio.fail_after(2 * TIMEOUT):  # seen within a few heartbeats
            await watcher.seen["kv_manager"].wait()
        assert watcher.liveness.peers["kv_manager"].boot_id == first.boot_id
        with trio.move_on_after(20 * HB):  # answering: never declared dead
            await wait_change(0)
        assert watcher.deaths == [] and watcher.down == frozenset()

        first_scope.cancel()  # the peer goes silent for good
        died_at = trio.current_time()
        await wait_change(0)
        [(name, reason)] = watcher.deaths
        assert name == "kv_manager" and reason.startswith("kv_manager died (no heartbeat for")
        assert reason.endswith("not on this host)")
        # suspect first, then dead at the first heartbeat past the long bound
        bound = watcher.liveness.dead_after_s
        assert bound - HB < trio.current_time() - died_at <= bound + HB
        assert watcher.down == {"kv_manager"} and watcher.returns == []

        second, second_scope = await start_peer()  # its successor, on the same endpoint
        await wait_change(1)
        assert watcher.returns == ["kv_manager"] and watcher.down == frozenset()
        assert watcher.liveness.peers["kv_manager"].boot_id == second.boot_id

        second_scope.cancel()  # replaced at once, before any heartbeat is missed
        third, _ = await start_peer()
        await wait_change(2)
        assert watcher.deaths[1] == (
            "kv_manager",
            f"kv_manager restarted (new boot id {third.boot_id})",
        )
        assert watcher.returns == ["kv_manager", "kv_manager"]
        assert watcher.down == frozenset()
        nursery.cancel_scope.cancel()
