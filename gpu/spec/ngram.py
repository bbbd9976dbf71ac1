"""The n-gram (prompt-lookup) proposer: a request's next tokens guessed from its own history.

Find the most recent earlier occurrence of the request's last ``n`` tokens (prompt and outputs),
for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (the longest that occurs wins),
and propose the (up to ``k``) tokens that followed it. Pure numpy, no torch.

The search narrows candidates backwards: one vectorized comparison finds where the last token
occurred before, then each further step keeps the candidates whose previous token matches the
suffix's, on the (few) survivors only. At 2,000 tokens it takes a few microseconds
(``tests/executor/test_spec_decode.py`` bounds it). The tokens live in a growing ``int32`` buffer
per request (``NgramTokens``), appended as outputs come, so nothing is rebuilt per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from gpu.spec.explore import STALE_STEPS

# how a request's acceptance is estimated (see NgramTokens.settle)
PRIOR = (1.0, 2.0)  # accepted drafts, rejections: a fresh request's estimate is a third
DECAY = 0.9  # per verification: the latest runs weigh most (a reply copies, then it does not)


def propose(tokens: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (1-D) of ``lo`` to ``hi`` tokens; ``[]`` when none occurs."""
    n = len(tokens)
    if k < 1 or n < 2:
        return []
    last = n - 1
    # candidates: end positions j < last of an occurrence of the suffix of length `length`
    cand = np.flatnonzero(tokens[:last] == tokens[last])
    length = 1
    best = cand if lo <= 1 and cand.size else None
    while cand.size and length < hi:
        cand = cand[cand >= length]  # room for one more token before the occurrence
        cand = cand[tokens[cand - length] == tokens[last - length]]
        if not cand.size:
            break
        length += 1
        if length >= lo:
            best = cand
    if best is None:
        return []
    j = int(best[-1])  # ascending: the most recent occurrence
    return [int(t) for t in tokens[j + 1 : j + 1 + k]]


class NgramTokens:
    """One request's tokens for the proposer: its prompt, then each output as it comes; and
    how its drafts have fared (``accept``: the estimated chance that a draft is accepted given
    the drafts before it were; ``since``: its decode steps since it last verified drafts,
    :data:`~gpu.spec.explore.STALE_STEPS` before the first, which makes it due to explore)."""

    __slots__ = ("buf", "hits", "misses", "n", "since")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.n = len(tokens)
        self.buf = np.empty(max(64, 2 * self.n), dtype=np.int32)
        self.buf[: self.n] = tokens
        self.hits, self.misses = PRIOR
        self.since = STALE_STEPS

    @property
    def accept(self) -> float:
        return self.hits / (self.hits + self.misses)

    def settle(self, drafted: int, accepted: int) -> None:
        """Count a verification: ``accepted`` drafts kept, then a rejection unless all were.
        Each draft after an accepted one is a trial, so the estimate is the fraction of trials
        kept (a geometric run's maximum-likelihood estimate), the older ones decayed."""
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)
        self.since = 0

    def __len__(self) -> int:
        return self.n

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            if self.n == len(self.buf):
                grown = np.empty(2 * len(self.buf), dtype=np.int32)
                grown[: self.n] = self.buf[: self.n]
                self.buf = grown
            self.buf[self.n] = t
            self.n += 1

    def propose(self, k: int, lo: int, hi: int) -> list[int]:
        return propose(self.buf[: self.n], k, lo, hi)
