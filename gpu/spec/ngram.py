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

REST = 4  # steps without drafts after a single draft was rejected


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
    how many drafts it proposes next (``k``, adapted to how its last ones fared)."""

    __slots__ = ("buf", "k", "n", "rest")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.n = len(tokens)
        self.buf = np.empty(max(64, 2 * self.n), dtype=np.int32)
        self.buf[: self.n] = tokens
        self.k = 0  # 0: the configured num_speculative_tokens
        self.rest = 0  # steps to propose nothing (its single drafts kept failing)

    def settle(self, drafted: int, accepted: int, k_max: int) -> None:
        """Adapt the next draft's length to this one's fate: all accepted, twice as many (the
        text is being copied: longer runs pay); none, half (a draft row is not free on a CPU,
        about a tenth of a one-row step on SmolLM2); some, one more than were accepted. A
        single draft rejected rests the proposer for ``REST`` steps."""
        if accepted == 0 and drafted == 1:
            self.rest = REST
        if accepted == drafted:
            self.k = min(k_max, 2 * drafted)
        elif accepted == 0:
            self.k = max(1, drafted // 2)
        else:
            self.k = min(k_max, accepted + 1)

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
        if self.rest:
            self.rest -= 1
            return []
        return propose(self.buf[: self.n], k, lo, hi)
