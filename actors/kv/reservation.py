"""How many tokens' worth of blocks a request reserves: the one copy of the reservation policy.

Used by the scheduler (``reserve_tokens`` of every ``kv_admit`` it sends) and by
``KVManager.reserve_for`` (the library's callers and benchmarks). Pure arithmetic.
"""

from __future__ import annotations

from typing import Literal

from actors.kv.errors import KVError

ReserveMode = Literal["full", "on_demand"]
RESERVE_MODES: tuple[ReserveMode, ...] = ("full", "on_demand")


def reserve_tokens(
    mode: ReserveMode, prompt_len: int, max_tokens: int, *, lookahead_blocks: int, block_size: int
) -> int:
    """Tokens to reserve for a request of ``prompt_len`` tokens that may still generate
    ``max_tokens`` tokens.

    ``full``: ``prompt_len + max_tokens`` (it can never run short). ``on_demand``: ``prompt_len``
    plus ``lookahead_blocks * block_size`` tokens, capped at ``prompt_len + max_tokens``; it grows
    block by block while it decodes. Raises ``KVError`` for an unknown mode or negative lengths.
    """
    if mode not in RESERVE_MODES:
        raise KVError(f"unknown reservation mode {mode!r}; known: {list(RESERVE_MODES)}")
    if prompt_len < 0 or max_tokens < 0:
        raise KVError(f"negative lengths: prompt_len={prompt_len} max_tokens={max_tokens}")
    if mode == "full":
        return prompt_len + max_tokens
    return prompt_len + min(max_tokens, lookahead_blocks * block_size)
