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

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpu.model.memory import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    check_fits,
    default_kv_bytes,
    device_memory,
)

if TYPE_CHECKING:
    import torch

    from actors.runtime.config import RuntimeConfig
    from gpu.disk.store import Payload
    from gpu.model.loader import ModelSpec


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
        if device.type == "cpu":  # one allocation, advised for huge pages (gpu.model.cpu_tuning)
            from gpu.model.cpu_tuning import huge_page_zeros

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
            nbytes = int(device_memory(device)[0] * budget)
        else:
            nbytes = int(budget)
        if nbytes < per_block:
            raise ValueError(f"KV memory budget {nbytes} B is below one block ({per_block} B)")
        return nbytes // per_block

    def read_block(self, block: int) -> bytes:
        """Block ``block``'s K and V of every layer as bytes (``[2, layers, kv_heads,
        block_size * head_dim]``): what the disk tier stores."""
        import torch

        rows = [t[block :: self.num_blocks] for t in (*self.block_k, *self.block_v)]
        return torch.stack(rows).cpu().view(torch.uint8).numpy().tobytes()

    def write_block(self, block: int, payload: Payload) -> None:
        """Put ``read_block``'s bytes back into block ``block`` (a read-only ``payload`` is
        copied once; a writable one is read in place)."""
        import torch

        tables = (*self.block_k, *self.block_v)
        row = tables[0].shape[1]
        if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
            payload = bytearray(payload)
        flat = torch.frombuffer(payload, dtype=torch.uint8).view(tables[0].dtype)
        parts = flat.view(len(tables), self.num_kv_heads, row).to(tables[0].device)
        for t, part in zip(tables, parts, strict=True):
            t[block :: self.num_blocks] = part

    def write_block_many(self, blocks: Sequence[int], payloads: Sequence[Payload]) -> None:
        for b, p in zip(blocks, payloads, strict=True):
            self.write_block(b, p)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``layer`` at ``slots`` (``[n]`` int64)."""
        from gpu.model import cpu_ops

        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            if not cpu_ops.kv_write(cache, slots, x):
                cache.index_copy_(1, slots, x.transpose(0, 1))


def pool_blocks(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_memory: int | float | None = None,
    max_tokens: int | None = None,
    *,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    step_tokens: int = 8192,
    batch_rows: int = 256,
    loaded: bool = False,
) -> int:
    """Blocks of ``block_size`` tokens for ``spec``'s KV within ``kv_memory`` (bytes if an int or a
    float > 1, else a fraction of free device memory); None means the default of
    :func:`gpu.model.memory.default_kv_bytes` (``utilization`` of the card on cuda, for steps of
    ``step_tokens`` tokens sampling ``batch_rows`` rows; ``loaded``: this process holds the
    weights already), at most ``max_tokens`` (what the batch can ever use: more would be memory
    never touched)."""
    per_block = PagedKVCache.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype
    )
    if kv_memory is not None:
        return PagedKVCache.blocks_for_budget(kv_memory, per_block, device)
    nbytes = default_kv_bytes(
        spec,
        dtype,
        device,
        utilization=utilization,
        step_tokens=step_tokens,
        batch_rows=batch_rows,
        loaded=loaded,
    )
    blocks = PagedKVCache.blocks_for_budget(max(nbytes, per_block), per_block, device)
    if max_tokens:
        blocks = min(blocks, -(-max_tokens // block_size))
    return blocks


def loaded_pool(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_blocks: int | None,
    kv_memory: int | float | None,
    *,
    utilization: float,
    step_tokens: int,
    batch_rows: int,
) -> tuple[int, int]:
    """The executor's pool, its weights loaded: ``(blocks, bytes per block)``. ``num_blocks`` as
    given (the supervisor's), else :func:`pool_blocks` with the card as it is now; refused when
    it would not leave one step's activations on the device (gpu.model.memory.check_fits)."""
    per_block = PagedKVCache.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype
    )
    if num_blocks is None:
        num_blocks = pool_blocks(
            spec,
            dtype,
            device,
            block_size,
            kv_memory,
            batch_rows * spec.max_model_len,
            utilization=utilization,
            step_tokens=step_tokens,
            batch_rows=batch_rows,
            loaded=True,
        )
    check_fits(
        num_blocks * per_block,
        spec,
        dtype,
        device,
        step_tokens=step_tokens,
        batch_rows=batch_rows,
    )
    return num_blocks, per_block


def resolve_num_blocks(cfg: RuntimeConfig) -> int:
    """The KV pool size in blocks: ``kv.num_blocks`` if set, else :func:`pool_blocks` for the
    configured model, device, dtype and ``kv.kv_memory`` (the KV manager and the executor must
    use the same number; the supervisor resolves it once and writes it into the config)."""
    if cfg.kv.num_blocks:
        return int(cfg.kv.num_blocks)
    from gpu.model import loader

    device = loader.resolve_device(cfg.executor.device)
    served = loader.resolve_dtype(cfg.executor.dtype, device, cfg.model)
    dtype = loader.attention_dtype(served, device)
    spec = loader.load_spec(cfg.model, cfg.executor.model_impl)
    most = cfg.scheduler.max_batch_size * spec.max_model_len
    ex = cfg.executor
    return pool_blocks(
        spec,
        dtype,
        device,
        cfg.kv.block_size,
        cfg.kv.kv_memory,
        most,
        utilization=ex.gpu_memory_utilization,
        step_tokens=ex.step_budget,
        batch_rows=cfg.scheduler.max_batch_size,
    )


def resolve_max_model_len(cfg: RuntimeConfig) -> int:
    """The longest request served, prompt plus output: ``max_model_len`` if given (refused past
    the model's context or the pool), else the model's context capped by the pool's tokens. A
    request longer than the whole pool could never run, in any ``--kv-mode``."""
    from gpu.model import loader

    model_len = loader.load_spec(cfg.model, cfg.executor.model_impl).max_model_len
    pool = int(cfg.kv.num_blocks or resolve_num_blocks(cfg)) * cfg.kv.block_size
    if cfg.max_model_len is None:
        return min(model_len, pool)
    want = int(cfg.max_model_len)
    if want < 2:
        raise ValueError(f"max_model_len must be at least 2, got {want}")
    if want > model_len:
        raise ValueError(f"max_model_len {want} exceeds the model's context ({model_len} tokens)")
    if want > pool:
        raise ValueError(
            f"max_model_len {want} exceeds what the KV pool holds ({pool} tokens); "
            "raise --kv-memory/--num-blocks or lower --max-model-len"
        )
    return want


def resolve_serving(cfg: RuntimeConfig, say=None) -> None:
    """Resolve, once, what every actor must agree on: the model (``--model`` as given to a local
    directory, see gpu.model.sources; the served name defaults to what was given), the KV pool's blocks
    and ``max_model_len``. Idempotent: a resolved config resolves to itself."""
    from gpu.model.sources import resolve

    if not (cfg.model and (Path(cfg.model) / "config.json").is_file()):
        got = resolve(cfg.model, say=say)
        cfg.model = str(got.path)
        cfg.http.served_model_name = cfg.http.served_model_name or got.name
    cfg.http.served_model_name = cfg.http.served_model_name or cfg.model
    cfg.kv.num_blocks = resolve_num_blocks(cfg)
    cfg.max_model_len = resolve_max_model_len(cfg)
