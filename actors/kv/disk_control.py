"""DiskControl: the KV core's decisions about the disk tier, over ``DiskTier`` (the index).

Composed into ``KVManagerCore`` (``core.disk``); inert until the executor announces its tier
(``kv_disk_tier``). What it decides:

- at admission (``admitted``): the prompt's blocks right after the pool's cached prefix that are
  on disk, consecutively; their freshly allocated blocks are loaded by the executor
  (``AdmitResult.load_blocks``/``load_keys``) and count as cached tokens;
- when blocks are cached (``cached``): the chain's blocks not yet on disk are written behind
  (``executor.DiskSave``), least recently used files deleted first to stay within the bound
  (``executor.DiskDrop``); the written blocks stay pinned in the pool (a lock on the deepest)
  until the executor answers (``kv_disk_saved``);
- files the executor found bad (``kv_disk_dropped``) leave the index;
- whether a load pays (``pays``): a disk hit is cheaper than recomputing, not free. The executor
  reports what a block costs it read (``kv_disk_rates``: the last load's seconds per block) and
  computed (its recent prefill seconds per token); a hit whose read would cost more than
  computing its tokens is computed instead (never on this project's CPUs: reading a block takes
  ~1 ms, computing its 16 tokens ~20 ms; it can on a fast GPU with a slow disk), and the
  policies' prefix queries (``kv_match``) count a disk hit at the share of its compute it saves.

Events: kv.disk_tier, kv.disk_spill, kv.disk_saved, kv.disk_evicted, kv.disk_dropped,
kv.disk_skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from actors.kv.block_manager import BlockManager
from actors.kv.disk_tier import DiskTier
from actors.shared.blockhash import disk_keys, salted
from messages import executor as xm
from messages import kv as km


class DiskControl:
    def __init__(
        self, capacity: int, log: Any, send: Callable[[str, msgspec.Struct], None]
    ) -> None:
        self.capacity = capacity
        self.log = log
        self.send = send
        self.tier: DiskTier | None = None
        self.load_s = 0.0  # seconds to read one block: a moving average of the executor's loads
        self.loads = 0  # loads measured (one is no rate: its read may have met a busy machine)
        self.prefill_s = 0.0  # seconds to compute one prompt token there (0: unknown)

    def announce(self, msg: km.DiskTier) -> None:
        """The executor's tier, as found on disk (at its start, or to this restarted manager)."""
        tier, drop = DiskTier.found(self.capacity, msg.fingerprint, msg.block_bytes, msg.keys)
        self.tier = tier
        self.log.info(
            "kv.disk_tier",
            fingerprint=msg.fingerprint,
            blocks=len(tier.files),
            bytes=tier.bytes,
            capacity=tier.capacity,
            block_bytes=tier.block_bytes,
        )
        self._drop(drop)

    def rates(self, msg: km.DiskRates) -> None:
        self.loads += 1
        self.load_s = msg.load_s if self.loads == 1 else 0.7 * self.load_s + 0.3 * msg.load_s
        if msg.prefill_s > 0:
            self.prefill_s = msg.prefill_s

    def saving(self, block_size: int) -> float:
        """The share of a block's compute that loading it saves (1.0 until two loads and a
        prefill are measured; 0 when reading it costs more than computing it)."""
        if self.loads < 2 or not self.prefill_s:
            return 1.0
        return max(0.0, 1.0 - self.load_s / (self.prefill_s * block_size))

    def peek(self, mgr: BlockManager, token_ids: Sequence[int], salt: str, pool: int) -> int:
        """Tokens a ``kv_match`` counts for the disk tier after the ``pool`` tokens the pool has
        cached: its consecutive hits, at the share of their compute a load saves. No change."""
        tier = self.tier
        if tier is None or not tier.files:
            return 0
        keys = self.keys(mgr, token_ids, salt, mgr.cache.max_match_blocks(len(token_ids)))
        hits = tier.peek(keys, pool // mgr.block_size)
        return int(hits * mgr.block_size * self.saving(mgr.block_size))

    def reset(self) -> None:
        """The executor died: its saves in flight are lost (it announces the tier again)."""
        self.tier = None

    def keys(
        self, mgr: BlockManager, token_ids: Sequence[int], salt: str, blocks: int
    ) -> list[str]:
        assert self.tier is not None
        return disk_keys(token_ids, mgr.block_size, self.tier.fingerprint, salt, blocks)

    def admitted(
        self, mgr: BlockManager, rid: str, token_ids: Sequence[int], salt: str, cached: int
    ) -> tuple[list[int], list[str]]:
        """The blocks of an admitted request to load from disk (its table's, right after the
        ``cached`` tokens the pool had) and their keys."""
        tier = self.tier
        if tier is None or not tier.files:
            return [], []
        keys = self.keys(mgr, token_ids, salt, mgr.cache.max_match_blocks(len(token_ids)))
        start = cached // mgr.block_size
        n = tier.hits(keys, start)
        if not n:
            return [], []
        if not self.saving(mgr.block_size):
            self.log.info(
                "kv.disk_skipped",
                request_id=rid,
                blocks=n,
                load_s=self.load_s,
                compute_s=round(self.prefill_s * mgr.block_size, 6),
            )
            return [], []
        tier.hit_tokens += n * mgr.block_size
        mgr.disk_hit(rid, n * mgr.block_size)
        return mgr.requests[rid].blocks[start : start + n], keys[start : start + n]

    def cached(self, mgr: BlockManager, token_ids: Sequence[int], salt: str) -> None:
        """``token_ids``' full blocks are in the pool's cache: write behind what disk lacks."""
        tier = self.tier
        if tier is None:
            return
        path = mgr.cache.walk(salted(token_ids, salt), len(token_ids) // mgr.block_size)
        keys = self.keys(mgr, token_ids, salt, len(path))
        drop, save = tier.plan_save(keys)
        self._drop(drop)
        if not save:
            return
        at = {k: i for i, k in enumerate(keys)}
        deepest = path[max(at[k] for k in save)]
        mgr.cache.lock(deepest)  # pinned: not evicted, so not overwritten, until written
        save_id = tier.started(save, deepest)
        blocks = [path[at[k]].block for k in save]
        self.log.info(
            "kv.disk_spill",
            save_id=save_id,
            blocks=len(save),
            bytes=len(save) * tier.block_bytes,
            disk_bytes=tier.bytes,
        )
        self.send("executor", xm.DiskSave(save_id=save_id, blocks=blocks, keys=save))

    def pinning(self) -> bool:
        """Whether disk writes in flight pin blocks (they come back when answered)."""
        return self.tier is not None and bool(self.tier.saving)

    def saved(self, mgr: BlockManager, msg: km.DiskSaved) -> bool:
        """A save answered: its blocks unpinned. False for a save this manager never made."""
        tier = self.tier
        sv = tier.saved(msg.save_id, msg.failed) if tier is not None else None
        if sv is None:
            return False  # a save of an executor (or manager) that has died since
        mgr.cache.unlock(sv.pin)
        self.log.info(
            "kv.disk_saved",
            save_id=msg.save_id,
            blocks=len(sv.keys) - len(msg.failed),
            failed=len(msg.failed),
            disk_blocks=len(tier.files),  # type: ignore[union-attr]
            disk_bytes=tier.bytes,  # type: ignore[union-attr]
        )
        return True

    def dropped(self, msg: km.DiskDropped) -> None:
        if self.tier is None:
            return
        n = self.tier.dropped(msg.keys)
        self.log.warning("kv.disk_dropped", blocks=n, reason=msg.reason)

    def _drop(self, keys: list[str]) -> None:
        if not keys:
            return
        tier = self.tier
        assert tier is not None
        self.log.info(
            "kv.disk_evicted",
            blocks=len(keys),
            bytes=len(keys) * tier.block_bytes,
            disk_bytes=tier.bytes,
        )
        self.send("executor", xm.DiskDrop(keys=keys))

    def stats(self) -> dict[str, int]:
        t = self.tier
        if t is None:
            return {}
        return {
            "disk_blocks": len(t.files),
            "disk_bytes": t.bytes,
            "disk_capacity": t.capacity,
            "disk_hit_tokens": t.hit_tokens,
        }
