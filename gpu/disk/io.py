"""The executor core's ledger of disk-tier work (``--kv-disk-dir``); the driver does the I/O.

- A run whose cached prefix is partly on disk (``Run.load_keys``) waits here, holding its blocks
  but not running, while the driver reads and checks the files in a worker thread and hands the
  payloads back (``DiskRead``); other requests keep stepping meanwhile. The core then copies the
  payloads into the blocks (``put``) between steps and starts the run; from the first file that
  was missing or failed its check on, the prompt is computed instead (``Run.cached_tokens``
  lowered to that block), so its outputs stay exact.
- ``x_disk_save`` / ``x_disk_drop`` from the KV manager are queued for the driver, which reads
  the (pinned) blocks and writes the files in a worker thread (``DiskWritten``), or deletes.

``take`` hands the driver its work, in arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from gpu.disk.store import Payload
from messages import executor as xm


@dataclass
class DiskRead:
    """Driver -> core: a waiting run's files read (``payloads``: in order, up to the first bad
    one; ``bad``: (key, reason) of that one)."""

    run: xm.Run
    payloads: list[Payload]
    bad: tuple[str, str] | None
    seconds: float


@dataclass
class DiskWritten:
    """Driver -> core: an ``x_disk_save`` done (``failed``: the keys it could not write)."""

    save: xm.DiskSave
    failed: list[str]
    nbytes: int
    seconds: float


@dataclass
class DiskIO:
    put: Callable[[Sequence[int], Sequence[Payload]], None]  # payloads into blocks (the runner's)
    block_size: int
    loading: dict[str, xm.Run] = field(default_factory=dict)
    todo: list[xm.Run | xm.DiskSave | xm.DiskDrop] = field(default_factory=list)

    def load(self, run: xm.Run) -> None:
        self.loading[run.request_id] = run
        self.todo.append(run)

    def queue(self, msg: xm.DiskSave | xm.DiskDrop) -> None:
        self.todo.append(msg)

    def take(self) -> list[xm.Run | xm.DiskSave | xm.DiskDrop]:
        out, self.todo = self.todo, []
        return out

    def drop(self, rid: str, attempt: int | None = None) -> bool:
        """Forget a waiting run (any attempt when None); whether one was waiting."""
        run = self.loading.get(rid)
        if run is None or (attempt is not None and run.attempt != attempt):
            return False
        del self.loading[rid]
        return True

    def done(self, msg: DiskRead) -> xm.Run | None:
        """The run to start now that its files are read (its blocks filled, ``cached_tokens``
        lowered past a bad file), or None if it was dropped meanwhile."""
        run = msg.run
        if self.loading.get(run.request_id) is not run:
            return None
        del self.loading[run.request_id]
        n = len(msg.payloads)
        if n:
            self.put(run.load_blocks[:n], msg.payloads)
        cached = run.cached_tokens
        if msg.bad is not None:
            first = cached - len(run.load_keys) * self.block_size  # where the loads begin
            cached = first + n * self.block_size
        return msgspec.structs.replace(run, cached_tokens=cached, load_blocks=[], load_keys=[])
