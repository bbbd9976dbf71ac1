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

import hashlib
from array import array
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


def salted(token_ids: Sequence[int], salt: str) -> Sequence[int]:
    """``token_ids`` as the prefix cache keys them for a request with ``cache_salt`` ``salt``:
    the first token paired with the salt, so that the first block (and so every block after it)
    of one salt never equals another salt's. Unsalted (``""``): the ids themselves."""
    if not salt or not token_ids:
        return token_ids
    return [(salt, token_ids[0]), *token_ids[1:]]  # type: ignore[list-item]


def disk_keys(
    tokens: Sequence[int], block_size: int, seed: str, salt: str = "", num_blocks: int = -1
) -> list[str]:
    """The disk tier's names of the first ``num_blocks`` full blocks of ``tokens`` (all, when
    negative): a BLAKE2b chain (128 bits) over the tokens, seeded with the model's fingerprint
    (``seed``) and the request's ``salt``. Unlike ``chain_hashes`` these outlive the process and
    name KV bytes another process will trust, so they are a cryptographic hash."""
    full = len(tokens) // block_size
    n = full if num_blocks < 0 else min(num_blocks, full)
    if n <= 0:
        return []
    ids = array("q", tokens[: n * block_size]).tobytes()
    step = 8 * block_size
    prev = hashlib.blake2b(f"{seed}\0{salt}".encode(), digest_size=16).digest()
    out = []
    for i in range(n):
        prev = hashlib.blake2b(prev + ids[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(prev.hex())
    return out
