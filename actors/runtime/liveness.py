"""Connections to the other actors: one DEALER per peer, an outbox for when its queue is full, and
heartbeats that tell when a peer died or restarted.

Liveness: every ``heartbeat_s`` each actor pings every peer; a peer that has answered before and
then stays silent for ``dead_after`` heartbeats is declared dead (within 2 s by default), and a
``Pong`` carrying a new ``boot_id`` means it restarted (also a death, however fast the restart).
DEALERs use ZMQ_IMMEDIATE, so nothing is queued for a peer that is not connected: a restarted
peer never receives messages meant for the process it replaced.
"""

from __future__ import annotations

import time
import zmq

from actors.runtime.transport import ZSocket


class Peer:
    def __init__(self, name: str, sock: ZSocket) -> None:
        self.name = name
        self.sock = sock
        self.boot_id = ""  # of the process last heard from
        self.last_seen = 0.0  # monotonic time of the last Pong; 0 = never
        self.alive = False
        self.nonce = 0

    def heard(self, boot_id: str) -> str | None:
        """Record a Pong. Returns "back" (first contact or after a death), "restarted" (new
        boot_id without a noticed death) or None."""
        self.last_seen = time.monotonic()
        event = None
        if not self.alive:
            event = "back"
        elif boot_id and self.boot_id and boot_id != self.boot_id:
            event = "restarted"
        self.alive = True
        self.boot_id = boot_id or self.boot_id
        return event

    def overdue(self, now: float, timeout: float) -> bool:
        """Alive until now, but silent for longer than ``timeout`` seconds."""
        return self.alive and now - self.last_seen > timeout

    def mark_dead(self) -> None:
        self.alive = False


def set_immediate(sock: ZSocket) -> None:
    sock.sock.setsockopt(zmq.IMMEDIATE, 1)
