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
    return propose_matched(tokens, k, lo, hi)[0]


def propose_matched(tokens: np.ndarray, k: int, lo: int, hi: int) -> tuple[list[int], int]:
    """:func:`propose`'s drafts and the length of the suffix they were found by (0: none)."""
    n = len(tokens)
    if k < 1 or n < 2:
        return [], 0
    last = n - 1
    # candidates: end positions j < last of an occurrence of the suffix of length `length`
    cand = np.flatnonzero(tokens[:last] == tokens[last])
    length = 1
    best, matched = (cand, 1) if lo <= 1 and cand.size else (None, 0)
    while cand.size and length < hi:
        cand = cand[cand >= length]  # room for one more token before the occurrence
        cand = cand[tokens[cand - length] == tokens[last - length]]
        if not cand.size:
            break
        length += 1
        if length >= lo:
            best, matched = cand, length
    if best is None:
        return [], 0
    j = int(best[-1])  # ascending: the most recent occurrence
    return [int(t) for t in tokens[j + 1 : j + 1 + k]], matched


class NgramTokens:
    """One request's tokens for the proposer: its prompt, then each output as it comes; and
    how its drafts have fared (``accept``: the estimated chance that a draft of the latest
    proposal is accepted given the drafts before it were; ``since``: its decode steps since it
    last verified drafts, :data:`~gpu.spec.explore.STALE_STEPS` before the first, which makes it
    due to explore).

    Drafts found by a long suffix are kept far more often than those a single token found (a
    reply that copies its prompt matches 4 tokens; free text matches 1 by chance), so the
    estimate is kept per suffix length (``matched``: the latest proposal's): one estimate for
    both let the chance matches of a copying reply turn its copies off."""

    __slots__ = ("buf", "matched", "n", "since", "trials")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.n = len(tokens)
        self.buf = np.empty(max(64, 2 * self.n), dtype=np.int32)
        self.buf[: self.n] = tokens
        self.trials: dict[int, tuple[float, float]] = {}  # suffix length -> (kept, rejected)
        self.matched = 0
        self.since = STALE_STEPS

    @property
    def accept(self) -> float:
        hits, misses = self.trials.get(self.matched, PRIOR)
        return hits / (hits + misses)

    @property
    def best(self) -> float:
        """The highest estimate of any suffix length (the prior's before any verification)."""
        return max((h / (h + m) for h, m in (PRIOR, *self.trials.values())), default=0.0)

    def settle(self, drafted: int, accepted: int) -> None:
        """Count a verification of the latest proposal: ``accepted`` drafts kept, then a
        rejection unless all were. Each draft after an accepted one is a trial, so the estimate
        is the fraction of trials kept (a geometric run's maximum-likelihood estimate), the
        older ones decayed."""
        hits, misses = self.trials.get(self.matched, PRIOR)
        self.trials[self.matched] = (
            DECAY * hits + accepted,
            DECAY * misses + (accepted < drafted),
        )
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
        drafts, self.matched = propose_matched(self.buf[: self.n], k, lo, hi)
        return drafts
