"""Knowing at once that a peer on this host exited: a pidfd, readable once its process is gone
(liveness.py then never declares a watched peer dead from silence alone)."""

from __future__ import annotations

import os
from typing import Any

import trio

GONE = -1  # the process had already exited when asked


def open_pidfd(pid: int, peer: str, log: Any) -> int | None:
    """A pidfd for ``pid``; ``GONE`` if it already exited; None where pidfds are unavailable
    (logged: silence's long bound decides instead)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return GONE
    except OSError as e:
        log.warning("peer.unwatched", peer=peer, peer_pid=pid, reason=str(e))
        return None


async def wait_exit(fd: int) -> None:
    """Return once the process behind ``fd`` (from ``open_pidfd``) has exited; closes ``fd``."""
    if fd == GONE:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
