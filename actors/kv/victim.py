"""Choosing the running request to preempt when decode growth finds no block."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

from actors.kv.errors import KVError

VictimPolicy = Literal["newest", "priority"]


def pick_victim(
    seqs: Mapping[str, int],
    policy: VictimPolicy = "newest",
    priorities: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
) -> str | None:
    """The request to preempt among ``seqs`` (request id -> admission sequence number), or None.

    ``newest``: the highest sequence number. ``priority``: the lowest value in ``priorities``
    (missing ids count as 0), ties broken by newest. Ids in ``exclude`` are skipped. Pure;
    raises ``KVError`` for an unknown policy. O(running requests).
    """
    if policy not in ("newest", "priority"):
        raise KVError(f"unknown victim policy {policy!r}")
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
