"""The executor's side of the prefix cache's disk tier (``--kv-disk-dir``), around
``DiskStore`` (the files) and ``DiskIO`` (the core's ledger): opening the store for the loaded
model, the announcement to the KV manager, and the work the driver runs in worker threads
(``do``): reading a waiting run's files, writing a save's blocks, deleting files.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpu.disk.io import DiskIO, DiskRead, DiskWritten
from gpu.disk.store import BadBlock, DiskStore, Payload, fingerprint
from messages import executor as xm
from messages.kv import DiskTier

if TYPE_CHECKING:
    from actors.runtime.config import RuntimeConfig
    from gpu.model_runner import ModelRunner


def block_bytes(ex: ModelRunner) -> int:
    """One block's K and V over every layer: a block file's payload."""
    return ex.kv_bytes // ex.num_blocks


def open_store(cfg: RuntimeConfig, ex: ModelRunner) -> DiskStore:
    """The store of this model's blocks under ``--kv-disk-dir`` (``DiskTierInUse`` if another
    live instance holds it)."""
    s = ex.spec
    layout = (s.num_layers, s.num_kv_heads, s.head_dim)
    # the model's code too: transformers' modules round otherwise than the native path
    computed_by = f"compute={ex.dtype}|device={ex.device.type}|impl={s.impl}"
    fp = fingerprint(ex.model_dir, str(ex.kv_dtype), ex.block_size, layout, computed_by)
    return DiskStore.open(cfg.kv.disk_dir, fp)


def ledger(ex: ModelRunner) -> DiskIO:
    return DiskIO(ex.cache.write_block_many, ex.block_size)


def announcement(store: DiskStore, ex: ModelRunner) -> DiskTier:
    # the bound counts whole files, headers included
    size = DiskStore.file_bytes(block_bytes(ex))
    return DiskTier(fingerprint=store.fingerprint, block_bytes=size, keys=store.keys())


def do(
    store: DiskStore, ex: ModelRunner, work: xm.Run | xm.DiskSave | xm.DiskDrop
) -> DiskRead | DiskWritten | None:
    """One piece of disk work, in a worker thread."""
    t0 = time.perf_counter()
    if isinstance(work, xm.DiskDrop):
        store.delete(work.keys)
        return None
    size = block_bytes(ex)
    if isinstance(work, xm.Run):
        payloads: list[Payload] = []
        bad = None
        for key in work.load_keys:
            try:
                payloads.append(store.read(key, size))
            except BadBlock as e:
                bad = (e.key, e.reason)
                break
        return DiskRead(work, payloads, bad, time.perf_counter() - t0)
    failed, nbytes = [], 0
    for block, key in zip(work.blocks, work.keys, strict=True):
        try:  # the block is pinned by the KV manager until this save is answered
            nbytes += store.write(key, ex.cache.read_block(block))
        except OSError:
            failed.append(key)
    return DiskWritten(work, failed, nbytes, time.perf_counter() - t0)
