"""The executor's resident LoRA adapters (``--max-cpu-loras``, least recently used out first),
and the runs waiting for one to load.

A run whose adapter is not resident waits here while the driver reads it (``load_adapter``, in a
worker thread: off the step loop) and hands it back as ``LoraLoaded``; every run waiting for the
same adapter starts then. An adapter a request in flight runs with is never evicted: the cache
holds ``--max-cpu-loras`` adapters, or more while that many are in use.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from actors.shared.lora import LoraError, read_tensors
from messages.common import LoraRef
from messages.executor import Run

if TYPE_CHECKING:
    from gpu.lora.slots import Adapter


class LoraLoaded:
    """The driver's answer for an adapter of ``AdapterCache.take``: it, or why not."""

    __slots__ = ("ref", "result", "seconds")

    def __init__(self, ref: LoraRef, result: Adapter | LoraError, seconds: float) -> None:
        self.ref = ref
        self.result = result
        self.seconds = seconds


def load_adapter(ref: LoraRef) -> LoraLoaded:
    """Read ``ref``'s factors (slow: a driver runs it in a thread), in float32."""
    import torch

    from gpu.lora.slots import Adapter

    t0 = time.perf_counter()
    try:
        raw = read_tensors(ref)
    except LoraError as e:
        return LoraLoaded(ref, e, time.perf_counter() - t0)
    factors = {k: (a.to(torch.float32), b.to(torch.float32)) for k, (a, b) in raw.items()}
    adapter = Adapter(ref.digest, ref.name, ref.rank, ref.scaling, factors)
    return LoraLoaded(ref, adapter, time.perf_counter() - t0)


class AdapterCache:
    def __init__(self, max_resident: int, in_use: Callable[[], set[str]], log: Any) -> None:
        self.max_resident = max_resident
        self.log = log
        self.in_use = in_use  # the digests the requests in flight run with
        self.resident: OrderedDict[str, Adapter] = OrderedDict()
        self.waiting: dict[str, list[Run]] = {}  # by digest: runs waiting for its load
        self._new: list[LoraRef] = []

    def get(self, key: str) -> Adapter | None:
        a = self.resident.get(key)
        if a is not None:
            self.resident.move_to_end(key)
        return a

    def start(self, run: Run) -> Adapter | None:
        """The run's adapter if resident; None: the run waits for its load."""
        ref = run.params.lora
        assert ref is not None
        found = self.get(ref.digest)
        if found is None:
            if ref.digest not in self.waiting:
                self.waiting[ref.digest] = []
                self._new.append(ref)
            self.waiting[ref.digest].append(run)
        return found

    def take(self) -> list[LoraRef]:
        """The adapters the driver is to load (``load_adapter``) and hand back."""
        out, self._new = self._new, []
        return out

    def done(self, loaded: LoraLoaded) -> tuple[list[Run], LoraError | None]:
        """The runs that waited for ``loaded``, and why they cannot run (None: its adapter is
        resident now, the ones used longest ago by no request evicted to make room)."""
        runs = self.waiting.pop(loaded.ref.digest, [])
        ref, result = loaded.ref, loaded.result
        if isinstance(result, LoraError):
            self.log.warning(
                "executor.lora_failed", lora=ref.name, field=result.field, reason=result.reason
            )
            return runs, result
        self.resident[ref.digest] = result
        busy = self.in_use() | set(self.waiting) | {ref.digest}
        for key in list(self.resident):
            if len(self.resident) <= self.max_resident:
                break
            if key not in busy:
                gone = self.resident.pop(key)
                self.log.info("executor.lora_evicted", lora=gone.name, digest=gone.key)
        self.log.info(
            "executor.lora_loaded",
            lora=ref.name,
            digest=ref.digest,
            rank=ref.rank,
            bytes=result.nbytes(),
            seconds=round(loaded.seconds, 6),
            resident=len(self.resident),
            waiting_runs=len(runs),
        )
        return runs, None

    def drop(self, request_id: str, attempt: int | None = None) -> bool:
        """Stop waiting for the request's adapter (that attempt's, if given)."""
        for runs in self.waiting.values():
            for i, run in enumerate(runs):
                if run.request_id == request_id and (attempt is None or run.attempt == attempt):
                    del runs[i]
                    return True
        return False

    def clear(self) -> None:
        self.waiting.clear()
        self._new.clear()
