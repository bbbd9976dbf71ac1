"""Paged KV cache: K and V of every layer in fixed-size blocks, preallocated once.

Layout per layer: ``[num_kv_heads, num_blocks * block_size, head_dim]``; token slot ``s`` of
block ``b`` is row ``b * block_size + s``. Heads lead so that a gather of many slots gives
``[kv_heads, n, head_dim]``, which batched matmuls consume without a copy. The cache never
decides which blocks a request owns: callers pass slot indices computed from block tables.

The pool's size is decided here too, once for every process that needs it (the supervisor, the
KV manager, the executor): :func:`resolve_num_blocks`. This module imports torch only inside the
functions that need it, so sizing a pool from a config does not pull in the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from actors.runtime.config import RuntimeConfig
    from gpu.loader import ModelSpec

DEFAULT_CPU_KV_BYTES = 512 << 20  # the KV budget on cpu when none is given
DEFAULT_CUDA_KV_FRACTION = 0.8  # ... and on cuda, as a fraction of free device memory


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device``: cuda free memory, or MemAvailable from /proc/meminfo on cpu."""
    if device.type == "cuda":
        import torch

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
        import torch

        shape = (num_kv_heads, self.num_slots, head_dim)
        if device.type == "cpu":  # one allocation, advised for huge pages (gpu.cpu_tuning)
            from gpu.cpu_tuning import huge_page_zeros

            per = num_kv_heads * self.num_slots * head_dim
            pool = huge_page_zeros(2 * num_layers * per, dtype)
            views = [pool[i * per : (i + 1) * per].view(shape) for i in range(2 * num_layers)]
            self.k, self.v = views[:num_layers], views[num_layers:]
        else:
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
        import torch

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
        from gpu import cpu_ops  # one C copy per row and head on CPU (index_copy_: ~80 us a call)

        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            if not cpu_ops.kv_write(cache, slots, x):
                cache.index_copy_(1, slots, x.transpose(0, 1))


def pool_blocks(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_memory: int | float | None = None,
) -> int:
    """Blocks of ``block_size`` tokens for ``spec``'s KV within ``kv_memory`` (bytes if an int or a
    float > 1, else a fraction of free device memory); None means the default budget:
    ``DEFAULT_CPU_KV_BYTES`` on cpu, ``DEFAULT_CUDA_KV_FRACTION`` of free memory on cuda."""
    per_block = PagedKVCache.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype
    )
    if kv_memory is None:
        kv_memory = DEFAULT_CUDA_KV_FRACTION if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    return PagedKVCache.blocks_for_budget(kv_memory, per_block, device)


def resolve_num_blocks(cfg: RuntimeConfig) -> int:
    """The KV pool size in blocks: ``kv.num_blocks`` if set, else :func:`pool_blocks` for the
    configured model, device, dtype and ``kv.kv_memory`` (the KV manager and the executor must
    use the same number; the supervisor resolves it once and writes it into the config)."""
    if cfg.kv.num_blocks:
        return int(cfg.kv.num_blocks)
    from gpu import loader

    device = loader.resolve_device(cfg.executor.device)
    dtype = loader.attention_dtype(loader.resolve_dtype(cfg.executor.dtype, device), device)
    return pool_blocks(
        loader.load_spec(cfg.model), dtype, device, cfg.kv.block_size, cfg.kv.kv_memory
    )
