"""How many tokens' worth of blocks a request reserves: the one copy of the reservation policy.

Used by the scheduler (``reserve_tokens`` of every ``kv_admit`` it sends) and by
``BlockManager.reserve_for`` (the library's callers and benchmarks); ``grow_to`` by the executor
(and the replay's simulated one) as a request decodes. Pure arithmetic.
"""

from __future__ import annotations

from typing import Literal

from actors.shared.errors import KVError

ReserveMode = Literal["full", "on_demand"]
RESERVE_MODES: tuple[ReserveMode, ...] = ("full", "on_demand")


def reserve_tokens(
    mode: ReserveMode, prompt_len: int, max_tokens: int, *, lookahead_blocks: int, block_size: int
) -> int:
    """Tokens to reserve for a request of ``prompt_len`` tokens that may still generate
    ``max_tokens`` tokens.

    The last token a request generates is never fed back, so its K/V is never written: a
    request holds at most ``prompt_len + max_tokens - 1`` tokens of K/V.

    ``full``: all of that (it can never run short). ``on_demand``: ``prompt_len`` plus
    ``lookahead_blocks * block_size`` tokens, capped at that; it grows block by block while it
    decodes. Raises ``KVError`` for an unknown mode or negative lengths.
    """
    if mode not in RESERVE_MODES:
        raise KVError(f"unknown reservation mode {mode!r}; known: {list(RESERVE_MODES)}")
    if prompt_len < 0 or max_tokens < 0:
        raise KVError(f"negative lengths: prompt_len={prompt_len} max_tokens={max_tokens}")
    written = max(0, max_tokens - 1)
    if mode == "full":
        return prompt_len + written
    return prompt_len + min(written, lookahead_blocks * block_size)


def kv_tokens_at_most(prompt_len: int, outputs_left: int, max_model_len: int) -> int:
    """The most tokens of K/V a request of ``prompt_len`` tokens (prior outputs included) that may
    generate ``outputs_left`` more will ever hold: every token but the last one generated (never
    fed back), within the model's length."""
    return min(prompt_len + outputs_left, max_model_len) - 1


def grow_to(kv_next: int, lookahead_tokens: int, at_most: int) -> int:
    """The block table's size, in tokens, to ask for ahead of need when the next step writes K/V
    up to ``kv_next`` tokens: ``lookahead_tokens`` more, but never past ``at_most``
    (``kv_tokens_at_most``; a full reservation holds that from the start, so it never grows)."""
    return min(kv_next + lookahead_tokens, at_most)
