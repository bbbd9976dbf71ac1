"""Choosing the running request to preempt: the one copy of the victim policy.

Used by the scheduler (a decode-time shortage, and priority preemption) and by
``BlockManager.pick_victim``. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

from actors.shared.errors import KVError

VictimPolicy = Literal["newest", "priority"]
VICTIM_POLICIES: tuple[VictimPolicy, ...] = ("newest", "priority")


def pick_victim(
    seqs: Mapping[str, int],
    policy: VictimPolicy = "newest",
    priorities: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
) -> str | None:
    """The request to preempt among ``seqs`` (request id -> admission sequence number), or None.

    ``newest``: the highest sequence number. ``priority``: the lowest value in ``priorities``
    (missing ids count as 0), ties broken by newest. The values are a *keep rank*: the lowest is
    given up first. A request's ``priority`` field means the opposite (lower is more important,
    as vLLM), so the scheduler passes ``-priority``: the least important request is preempted.
    Ids in ``exclude`` are skipped. Raises ``KVError`` for an unknown policy. O(running requests).
    """
    if policy not in VICTIM_POLICIES:
        raise KVError(f"unknown victim policy {policy!r}; known: {list(VICTIM_POLICIES)}")
    prio = priorities or {}
    best: str | None = None
    best_key = (0, 0)
    for rid, seq in seqs.items():
        if rid in exclude:
            continue
        key = (prio.get(rid, 0) if policy == "priority" else 0, -seq)
        if best is None or key < best_key:
            best, best_key = rid, key
    return best
