"""Paged KV cache: K and V of every layer in fixed-size blocks, preallocated once.

Layout per layer: ``[num_kv_heads, num_blocks * block_size, head_dim]``; token slot ``s`` of
block ``b`` is row ``b * block_size + s``. Heads lead so that a gather of many slots gives
``[kv_heads, n, head_dim]``, which batched matmuls consume without a copy. The cache never
decides which blocks a request owns: callers pass slot indices computed from block tables.
"""

from __future__ import annotations

import torch


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device``: cuda free memory, or MemAvailable from /proc/meminfo on cpu."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class PagedKVCache:
    """K/V storage for ``num_layers`` layers in ``num_blocks`` blocks of ``block_size`` tokens.

    Attributes ``k`` and ``v`` are lists (one tensor per layer); ``flat_k``/``flat_v`` view the
    same storage as ``[kv_heads * num_slots, head_dim]`` and ``block_k``/``block_v`` as
    ``[kv_heads * num_blocks, block_size * head_dim]``. Only :meth:`write` mutates them.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        shape = (num_kv_heads, self.num_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # The same storage as [kv_heads * num_slots, head_dim]: gathers along dim 0 are fastest.
        self.flat_k = [t.view(-1, head_dim) for t in self.k]
        self.flat_v = [t.view(-1, head_dim) for t in self.v]
        # ... and as [kv_heads * num_blocks, block_size * head_dim]: one row per block and head,
        # for gathering whole blocks (decode contexts).
        self.block_k = [t.view(-1, block_size * head_dim) for t in self.k]
        self.block_v = [t.view(-1, block_size * head_dim) for t in self.v]

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * block_size * elem

    @staticmethod
    def blocks_for_budget(budget: int | float, per_block: int, device: torch.device) -> int:
        """Blocks that fit in ``budget``: bytes if an int (or a float > 1), else a fraction of free memory."""
        if isinstance(budget, float) and 0.0 < budget <= 1.0:
            nbytes = int(available_memory(device) * budget)
        else:
            nbytes = int(budget)
        if nbytes < per_block:
            raise ValueError(f"KV memory budget {nbytes} B is below one block ({per_block} B)")
        return nbytes // per_block

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``layer`` at ``slots`` (``[n]`` int64)."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))
