"""Verification of a step's drafts, and the step's speculation counters.

Every row of a speculating request gets a *target token*, computed exactly as without
speculation for that output index: the row's logits (after ``logit_bias`` and ``min_tokens`` at
that index), then argmax for a greedy request, else the seeded draw of ``gpu/sampling.py``
(``argmax(p / E)``, ``E ~ Exp(1)`` from a generator seeded by ``(seed, output index)``) over the
filtered distribution ``p`` (temperature, top-k, top-p, min-p). Draft ``i`` is accepted while
the target token of the row before it equals it; the request emits the accepted drafts and the
target token after them (``accepted + 1`` tokens).

Lossless: for a greedy request the emitted tokens are the argmaxes, as without speculation. For
a sampled one this *is* rejection sampling for a deterministic proposal ``d``: the exponential
race picks ``d`` with probability ``p(d)`` (accept), and given that it did not, picks ``t != d``
with probability ``p(t) / (1 - p(d))`` (``p`` with ``d`` removed, renormalised). The race's
noise depends only on ``(seed, output index)``, so a seeded request emits the very tokens it
emits without speculation, whatever its drafts, batch or preemptions (up to the float rounding
of its logits in another batch shape, as already between batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def accepted(targets: list[int], drafts: list[int]) -> int:
    """How many leading drafts the target tokens confirm (``targets[i]`` is the token at the
    position of ``drafts[i]``)."""
    a = 0
    while a < len(drafts) and targets[a] == drafts[a]:
        a += 1
    return a


@dataclass
class SpecStats:
    """A step's speculation, as vLLM V1's spec-decode counters count it: ``num_drafts``
    (requests that verified drafts), ``num_draft_tokens`` (drafts verified),
    ``num_accepted_tokens`` (drafts accepted); ``k``: the most drafts one request verified;
    ``per_request``: ``[request_id, drafts, accepted]`` of each that speculated; ``explored``:
    those of them that explored; ``off``: why none did (``gpu/spec/plan.py``), else None;
    ``reasons``: the plan's account of itself, event fields (``SpecPlan.stats``; none in a
    replay)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    k: int = 0
    per_request: list[tuple[str, int, int]] = field(default_factory=list)
    off: str | None = None
    explored: list[str] = field(default_factory=list)
    reasons: dict[str, Any] = field(default_factory=dict)

    def add(self, request_id: str, drafts: int, accepted: int, explored: bool = False) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        self.k = max(self.k, drafts)
        self.per_request.append((request_id, drafts, accepted))
        if explored:
            self.explored.append(request_id)


def spec_fields(stats: SpecStats | None) -> dict[str, Any]:
    """The ``executor.step`` event's speculation fields (none when speculation is off):
    ``spec_k``, ``spec_drafts``, ``spec_draft_tokens``, ``spec_accepted``, ``spec`` (the
    per-request ``[request_id, drafts, accepted]``), ``spec_explore`` (those exploring) and
    ``spec_off``; from the plan: ``spec_why`` (per reason, the decodes that verified none),
    ``spec_gain`` and ``spec_price_ms`` (the drafts kept on their price: expected tokens, priced
    time), ``spec_explore_ms``, ``spec_rate`` (the planned tokens per second) and
    ``spec_turned_down`` (the next draft: ``[expected tokens, priced ms]``, or null)."""
    if stats is None:
        return {}
    out: dict[str, Any] = {
        "spec_k": stats.k,
        "spec_drafts": stats.num_drafts,
        "spec_draft_tokens": stats.num_draft_tokens,
        "spec_accepted": stats.num_accepted_tokens,
        "spec": [list(r) for r in stats.per_request],
        "spec_explore": list(stats.explored),
        "spec_off": stats.off,
    }
    return {**out, **stats.reasons}
