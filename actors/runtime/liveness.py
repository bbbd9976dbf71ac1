"""Which peers are alive: a pure record of heartbeat answers and process exits, on trio's clock
(no sockets).

Death is a fact, not a guess. Every ``heartbeat_s`` an actor pings each peer and, after each
heartbeat, asks ``check()`` who fell silent; every ``Pong`` goes to ``pong()``; a peer process on
this host is watched through its pid (the actor waits on a pidfd) and its exit goes to
``exited()``. Each returns the ``Change`` to act on:

- a peer that answers for the first time is ``SEEN``;
- a peer that has answered before and then stays silent for ``suspect_after`` heartbeats is
  ``SUSPECT`` (slow, starved of CPU, throttled, stopped): nothing is failed or reset for it,
  requests wait; an answer then ``CLEARED`` it;
- a peer whose process exited has ``DIED`` at once (its pid watch);
- a peer that is not on this host (no pid to watch: another container or machine) and stays
  silent for ``dead_after_s`` also ``DIED``; that bound grows to 4x the longest silence a peer
  came back from, so a machine that pauses for long also waits longer. A peer on this host is
  never declared dead by silence: its supervisor restarts it when it is wedged
  (minirt/launch/supervisor.py);
- a peer that never answered is never declared dead;
- a ``Pong`` carrying a new ``boot_id`` from a peer believed alive means it ``RESTARTED``: its
  predecessor died, however fast the restart, and the new process is alive;
- a ``Pong`` from a peer declared dead brings it ``BACK`` (its successor, or the same process
  after a stall).

Pongs from a process known to be replaced (a boot id seen before a restart) are ignored, so a
late answer of the old process can neither revive it nor pass for another restart. Times are
``trio.current_time()``, so tests drive them with ``trio.testing.MockClock``.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio


class State(enum.Enum):
    UNSEEN = "unseen"  # never answered
    ALIVE = "alive"
    SUSPECT = "suspect"  # silent for a while: slow or stopped, not dead
    DEAD = "dead"  # exited (or silent past the long bound, not on this host), not back yet


class Kind(enum.Enum):
    SEEN = "seen"  # first answer ever
    SUSPECT = "suspect"  # silent for suspect_after heartbeats
    CLEARED = "cleared"  # a suspect answered again
    DIED = "died"  # its process exited (or, not on this host, silent past the long bound)
    RESTARTED = "restarted"  # answered with a new boot id: the old process died, the new is alive
    BACK = "back"  # answers again after it was declared dead


@dataclass(frozen=True)
class Change:
    peer: str
    kind: Kind
    boot_id: str  # of the process last heard from
    reason: str = ""  # DIED and RESTARTED: what requests that depended on the old process fail with
    silent_s: float = 0.0  # SUSPECT, CLEARED, DIED by silence: how long it was silent


@dataclass
class PeerRecord:
    state: State = State.UNSEEN
    boot_id: str = ""
    last_seen: float = 0.0  # trio time of the last Pong
    retired: set[str] = field(default_factory=set)  # boot ids of processes that were replaced
    restarts: int = 0  # restarts noticed (by a new boot id or after a death)
    watched: bool = False  # on this host, its pid watched: silence never makes it dead
    watch_tried: bool = False  # a pid watch was tried for this process (once per process)
    dead_after_s: float = 0.0  # not on this host: the silence taken for death


# Not on this host (no pid to watch), a peer silent this long is taken for dead: far above a
# busy machine's stalls (steps of 1.9-3.8 s seen at load 4 on 2 vCPUs, a CFS quota's periods,
# a debugger's pause), and raised per peer to 4x the longest silence it came back from.
DEAD_AFTER_S = 60.0
# ... and at least this many times the longest a peer reports it could not answer (its event
# loop's lag, a long step): a peer whose loop lags 20 s under load is given 200 s.
BUSY_FACTOR = 10.0


@functools.cache
def host_id() -> str:
    """Who can watch whose pid: this kernel's boot id and this pid namespace. Two processes with
    the same ``host_id`` see each other's pids (containers apart do not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still exists (stopped or starved counts, a zombie
    that exited does not): what makes a silent peer suspect rather than dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class Liveness:
    def __init__(
        self,
        peers: Iterable[str],
        heartbeat_s: float,
        suspect_after: float = 3.0,
        dead_after_s: float = DEAD_AFTER_S,
    ) -> None:
        self.timeout = heartbeat_s * suspect_after  # silence before a peer is suspect
        self.dead_after_s = max(dead_after_s, self.timeout)
        self.peers: dict[str, PeerRecord] = {
            name: PeerRecord(dead_after_s=self.dead_after_s) for name in peers
        }

    def state(self, peer: str) -> State:
        return self.peers[peer].state

    @property
    def down(self) -> frozenset[str]:
        """Peers declared dead and not back yet."""
        return frozenset(n for n, p in self.peers.items() if p.state is State.DEAD)

    @property
    def suspect(self) -> dict[str, float]:
        """Suspect peers and how long each has been silent."""
        now = trio.current_time()
        return {n: now - p.last_seen for n, p in self.peers.items() if p.state is State.SUSPECT}

    def wants_watch(self, peer: str, boot_id: str) -> bool:
        """Whether ``peer``'s process ``boot_id`` (the latest) has no pid watch tried yet."""
        p = self.peers[peer]
        return p.boot_id == boot_id and not p.watch_tried and p.state is not State.DEAD

    def watch(self, peer: str, boot_id: str, ok: bool) -> None:
        """A pid watch was tried for ``peer``'s process ``boot_id``: with ``ok`` its exit will be
        reported through ``exited`` and silence never makes it dead."""
        p = self.peers[peer]
        if p.boot_id == boot_id:
            p.watch_tried, p.watched = True, ok

    def pong(self, peer: str, boot_id: str, busy_s: float = 0.0) -> Change | None:
        """Record a ``Pong`` from ``peer``; the change it makes, if any. ``busy_s``: the longest
        the peer says it was recently kept from answering (``Pong.busy_ms``): its long bound
        becomes at least ``BUSY_FACTOR`` times that."""
        p = self.peers[peer]
        if boot_id in p.retired:
            return None  # a late answer of a process already replaced
        p.dead_after_s = max(p.dead_after_s, BUSY_FACTOR * busy_s)
        now = trio.current_time()
        silent, p.last_seen = now - p.last_seen, now
        previous, p.boot_id = p.boot_id, boot_id or p.boot_id
        new_process = bool(boot_id and previous and boot_id != previous)
        if new_process:
            p.retired.add(previous)
            p.watched = p.watch_tried = False  # the successor is watched anew
        if p.state is State.UNSEEN:
            p.state = State.ALIVE
            return Change(peer, Kind.SEEN, p.boot_id)
        if p.state is State.DEAD:
            p.state = State.ALIVE
            p.restarts += new_process
            return Change(peer, Kind.BACK, p.boot_id)
        if new_process:
            p.state = State.ALIVE
            p.restarts += 1
            return Change(
                peer, Kind.RESTARTED, p.boot_id, f"{peer} restarted (new boot id {p.boot_id})"
            )
        if p.state is State.SUSPECT:
            p.state = State.ALIVE
            p.dead_after_s = max(p.dead_after_s, 4 * silent)
            return Change(peer, Kind.CLEARED, p.boot_id, silent_s=silent)
        return None

    def exited(self, peer: str, boot_id: str, how: str = "exited") -> Change | None:
        """``peer``'s process ``boot_id`` is gone (its pid watch fired): it ``DIED``, unless a
        successor already answered or it was declared dead before."""
        p = self.peers[peer]
        if p.boot_id != boot_id or p.state is State.DEAD:
            return None
        p.state = State.DEAD
        p.retired.add(boot_id)
        return Change(peer, Kind.DIED, boot_id, f"{peer} died ({how})")

    def check(self) -> list[Change]:
        """Make suspect every peer alive until now but silent for longer than the timeout; declare
        dead a suspect not on this host silent past its long bound."""
        now = trio.current_time()
        changes = []
        for name, p in self.peers.items():
            silent = now - p.last_seen
            if p.state is State.ALIVE and silent > self.timeout:
                p.state = State.SUSPECT
                changes.append(Change(name, Kind.SUSPECT, p.boot_id, silent_s=silent))
            elif p.state is State.SUSPECT and not p.watched and silent > p.dead_after_s:
                p.state = State.DEAD
                reason = f"{name} died (no heartbeat for {silent:.1f}s, not on this host)"
                changes.append(Change(name, Kind.DIED, p.boot_id, reason, silent))
        return changes


class LoopLag:
    """How late an event loop wakes from a sleep (its lag: the time a busy or starved process
    kept it from running), summarised per window of ``window_s``. Pure: the caller measures."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.samples: list[float] = []
        self.start: float | None = None
        self.last_max = 0.0  # the previous window's worst

    def add(self, lag_s: float, now: float) -> dict[str, float] | None:
        """One sample; at the end of a window its summary (``p50_ms``, ``p99_ms``, ``max_ms``,
        ``samples``, ``window_s``), else None."""
        if self.start is None:
            self.start = now
        self.samples.append(max(0.0, lag_s))
        if now - self.start < self.window_s:
            return None
        s = sorted(self.samples)
        out = {
            "window_s": round(now - self.start, 1),
            "samples": len(s),
            "p50_ms": round(1000 * s[len(s) // 2], 1),
            "p99_ms": round(1000 * s[min(len(s) - 1, int(0.99 * len(s)))], 1),
            "max_ms": round(1000 * s[-1], 1),
        }
        self.last_max, self.samples, self.start = s[-1], [], now
        return out

    @property
    def recent_s(self) -> float:
        """The worst lag of the last full window and the current one."""
        return max(self.last_max, max(self.samples, default=0.0))
