"""Per-request grammar state and the per-step token bitmask of the constrained rows.

Each constrained request has a :class:`GrammarState`: an llguidance matcher advanced by every
token the request generates (after a preemption, rebuilt by replaying the outputs it had).
Each step, :class:`Masker` fills one bitmask row per constrained row (llguidance's thread pool,
all rows in one call) and sets the logits of the tokens the grammar forbids to ``-inf``, on those
rows only: the other rows' logits are untouched, so unconstrained requests in the same batch
sample exactly as without this module.

EOS is allowed by the grammar exactly where it accepts. ``ignore_eos``, and ``min_tokens`` while
not reached, take EOS away too, unless the grammar allows nothing else there.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from actors.shared.grammar import Compiled

NEG_INF = float("-inf")


class GrammarState:
    """One request's matcher. Raises ValueError if ``outputs`` (a resumed request's earlier
    tokens) do not match the grammar."""

    __slots__ = ("compiled", "matcher")

    def __init__(self, compiled: Compiled, outputs: list[int]) -> None:
        self.compiled = compiled
        self.matcher = compiled.matcher()
        for i, tok in enumerate(outputs):
            if not self.matcher.consume_token(tok):
                raise ValueError(f"earlier output token {i} ({tok}) does not match the grammar")

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar rejects it (the matcher is then in error)."""
        return bool(self.matcher.consume_token(token))

    @property
    def stopped(self) -> bool:
        """The grammar accepts and nothing more can follow (or it consumed EOS)."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def error(self) -> str:
        return str(self.matcher.get_error()) or "the grammar allows no token here"


def _penalty_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: row ``b`` holds, for each bit of byte ``b`` (lowest first), 0 where
    it is set (allowed) and ``-inf`` where not. Adding a row of these to 8 logits masks them
    without a branch: a gather and an add (8x cheaper than ``masked_fill`` with a bool mask)."""
    b = torch.arange(256, dtype=torch.int32)[:, None]
    bits = ((b >> torch.arange(8, dtype=torch.int32)) & 1).bool()
    return torch.zeros(256, 8).masked_fill_(~bits, NEG_INF).to(device)


class Masker:
    """The bitmask buffer, llguidance's thread pool and the mask application for one vocabulary."""

    def __init__(
        self, vocab_size: int, eos_ids: list[int], device: torch.device, threads: int
    ) -> None:
        import llguidance

        if sys.byteorder != "little":  # the bitmask's int32 words are read as bytes
            raise RuntimeError("structured output needs a little-endian host")
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = [t for t in eos_ids if 0 <= t < vocab_size]
        self.device = device
        self.pool = llguidance.LLExecutor(num_threads=max(1, threads))
        self._buf = torch.zeros((0, self.words), dtype=torch.int32)
        self._table = _penalty_table(device)

    def fill(
        self,
        states: list[GrammarState],
        no_eos: list[bool],
        drafts: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Int32 bitmask (CPU) of the tokens each grammar allows next, a row per state; with
        ``drafts`` (one list per state, speculative decoding), a state's row is followed by one
        per draft token: what the grammar allows once it has consumed the drafts before it
        (the drafts must be ones it accepts: ``gpu/spec/plan.py`` cuts them so). Rows with
        ``no_eos`` (one flag per row) lose EOS unless it is all the grammar allows."""
        n = len(no_eos)
        # No parallel torch op in the mask thread (a second OpenMP team slows every later forward:
        # docs/benchmarks/spec-decode/README.md): allocated empty, every row filled through numpy.
        if self._buf.shape[0] < n:
            self._buf = torch.empty((max(n, 2 * self._buf.shape[0]), self.words), dtype=torch.int32)
        mask = self._buf[:n]
        drafts = drafts or [[]] * len(states)
        plain: list[tuple[Any, int]] = []
        ahead: list[tuple[Any, int, list[int]]] = []
        row = 0
        for s, d in zip(states, drafts, strict=True):
            if d:
                ahead.append((s.matcher, row, d))
            else:
                plain.append((s.matcher, row))
            row += 1 + len(d)
        # What llguidance.torch.fill_next_token_bitmask_par does; that module is not imported:
        # its import builds a torch.compile kernel (1.6 s) that is never used here.
        if ahead:
            mask.numpy().fill(-1)  # a row past where a grammar stopped allows all (never emitted)
        if plain:
            self.pool.unsafe_compute_mask_ptr(plain, mask.data_ptr(), self.words * 4, n)
        if ahead:  # llguidance advances each matcher through its drafts, then rolls it back
            self.pool.unsafe_compute_mask_ptr_with_draft_token(
                ahead, mask.data_ptr(), self.words * 4, n
            )
        for i, ban in enumerate(no_eos):
            if ban and self.eos_ids:
                self._drop_eos(mask[i])
        return mask

    def _drop_eos(self, row: torch.Tensor) -> None:
        saved = row.clone()
        for t in self.eos_ids:
            word = (int(row[t // 32]) & 0xFFFFFFFF) & ~(1 << (t % 32))
            row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
        if not bool(row.any()):
            row.copy_(saved)  # EOS is all the grammar allows: it ends the answer anyway

    def apply(
        self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor, inplace: bool = False
    ) -> torch.Tensor:
        """``[B, V]`` logits with the forbidden tokens of ``rows`` at ``-inf`` (``mask`` row
        ``i`` is for logits row ``rows[i]``), the other rows untouched (allowed logits too:
        ``x + 0``). ``logits`` itself is changed only if ``inplace``."""
        with torch.inference_mode():  # the forward's logits are inference tensors
            return self._apply(logits, rows, mask, inplace)

    def _apply(
        self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor, inplace: bool
    ) -> torch.Tensor:
        dev = logits.device
        m = mask.to(dev, non_blocking=True).view(torch.uint8).reshape(-1).long()
        width = min(logits.shape[1], self.words * 32)
        penalty = self._table.index_select(0, m).view(len(rows), -1)[:, :width]
        every = rows == list(range(logits.shape[0]))
        out = logits if inplace else logits.clone() if every else None
        if every:
            assert out is not None
            out[:, :width].add_(penalty)
            out[:, width:] = NEG_INF  # logits wider than the vocabulary: padding, never allowed
            return out
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logits.index_select(0, idx)
        sub[:, :width].add_(penalty)
        sub[:, width:] = NEG_INF
        return logits.index_copy_(0, idx, sub) if inplace else logits.index_copy(0, idx, sub)
