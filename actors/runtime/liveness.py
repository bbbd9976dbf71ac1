"""Which peers are alive: a pure record of heartbeat answers, on trio's clock (no sockets).

Every ``heartbeat_s`` an actor pings each peer and, after each heartbeat, asks ``check()`` who
fell silent; every ``Pong`` goes to ``pong()``. Both return the ``Change`` to act on:

- a peer that answers for the first time is ``SEEN``;
- a peer that has answered before and then stays silent for ``dead_after`` heartbeats has
  ``DIED`` (within 2 s by default); a peer that never answered is never declared dead;
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
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio


class State(enum.Enum):
    UNSEEN = "unseen"  # never answered
    ALIVE = "alive"
    DEAD = "dead"  # declared dead and not back yet


class Kind(enum.Enum):
    SEEN = "seen"  # first answer ever
    DIED = "died"  # silent for too long
    RESTARTED = "restarted"  # answered with a new boot id: the old process died, the new is alive
    BACK = "back"  # answers again after it was declared dead


@dataclass(frozen=True)
class Change:
    peer: str
    kind: Kind
    boot_id: str  # of the process last heard from
    reason: str = ""  # DIED and RESTARTED: what requests that depended on the old process fail with


@dataclass
class PeerRecord:
    state: State = State.UNSEEN
    boot_id: str = ""
    last_seen: float = 0.0  # trio time of the last Pong
    retired: set[str] = field(default_factory=set)  # boot ids of processes that were replaced
    restarts: int = 0  # restarts noticed (by a new boot id or after a death)


class Liveness:
    def __init__(self, peers: Iterable[str], heartbeat_s: float, dead_after: float = 3.0) -> None:
        self.timeout = heartbeat_s * dead_after
        self.peers: dict[str, PeerRecord] = {name: PeerRecord() for name in peers}

    def state(self, peer: str) -> State:
        return self.peers[peer].state

    @property
    def down(self) -> frozenset[str]:
        """Peers declared dead and not back yet."""
        return frozenset(n for n, p in self.peers.items() if p.state is State.DEAD)

    def pong(self, peer: str, boot_id: str) -> Change | None:
        """Record a ``Pong`` from ``peer``; the change it makes, if any."""
        p = self.peers[peer]
        if boot_id in p.retired:
            return None  # a late answer of a process already replaced
        p.last_seen = trio.current_time()
        previous, p.boot_id = p.boot_id, boot_id or p.boot_id
        new_process = bool(boot_id and previous and boot_id != previous)
        if new_process:
            p.retired.add(previous)
        if p.state is State.UNSEEN:
            p.state = State.ALIVE
            return Change(peer, Kind.SEEN, p.boot_id)
        if p.state is State.DEAD:
            p.state = State.ALIVE
            p.restarts += new_process
            return Change(peer, Kind.BACK, p.boot_id)
        if new_process:
            p.restarts += 1
            return Change(
                peer, Kind.RESTARTED, p.boot_id, f"{peer} restarted (new boot id {p.boot_id})"
            )
        return None

    def check(self) -> list[Change]:
        """Declare dead every peer alive until now but silent for longer than the timeout."""
        now = trio.current_time()
        died = []
        for name, p in self.peers.items():
            silent = now - p.last_seen
            if p.state is State.ALIVE and silent > self.timeout:
                p.state = State.DEAD
                reason = f"{name} died (no heartbeat for {silent:.1f}s)"
                died.append(Change(name, Kind.DIED, p.boot_id, reason))
        return died
