"""Prefix structure without token ids: one hash per full KV block, chained over the prefix.

``chain_hashes(tokens, bs)[i]`` identifies ``tokens[: (i + 1) * bs]``: two prompts share their
first ``i + 1`` blocks exactly when their ``i``-th hashes are equal (barring 64-bit collisions).
That is what the prefix cache, prefix deferral and ``lpm`` see of a prompt, so events carry these
hashes (``request.queued``: the prompt; ``request.finished``: the rest of what was cached) and a
replay rebuilds stand-in token ids from them with ``block_tokens``: equal hashes give equal
blocks, distinct hashes distinct ones. Hashes are 16 hex digits; the chain is deterministic
for a given Python build (tuples of ints hash without per-process salt).
"""

from __future__ import annotations

from collections.abc import Sequence

_M64 = (1 << 64) - 1
_M16 = 0xFFFF


def chain_hashes(
    tokens: Sequence[int], block_size: int, start_block: int = 0, prev: str | None = None
) -> list[str]:
    """Hashes of the full blocks of ``tokens`` from block ``start_block`` on; ``prev`` is the
    hash of block ``start_block - 1`` (required when ``start_block > 0``, to continue a chain)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block and prev is None:
        raise ValueError("continuing a chain (start_block > 0) needs the previous hash")
    h = int(prev, 16) if prev is not None else 0
    out = []
    for i in range(start_block, len(tokens) // block_size):
        h = hash((h, *tokens[i * block_size : (i + 1) * block_size])) & _M64
        out.append(f"{h:016x}")
    return out


def block_tokens(h: str, block_size: int) -> list[int]:
    """Stand-in token ids of the block whose chain hash is ``h``: the hash's four 16-bit words
    (non-negative), then zeros. Equal hashes give equal blocks."""
    x = int(h, 16)
    words = [(x >> s) & _M16 for s in (0, 16, 32, 48)]
    if block_size >= 4:
        return words + [0] * (block_size - 4)
    return [x % (1 << 31) + j for j in range(block_size)]  # tiny blocks: still distinct


def filler(index: int, n: int) -> list[int]:
    """``n`` stand-in tokens no other request has (negative ids, so never equal to a hashed
    block): the parts of a sequence the log has no hashes for (a prompt's partial last block,
    tokens generated past the last logged block)."""
    return [-1 - index] * n
