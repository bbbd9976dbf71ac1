"""The executor core's shared state: what its parts (the core itself, ``Recovery`` and the
publishing of steps) read and write, handed to each when it is built (the scheduler's
``CoreState`` pattern: parts never import their owner).

- the **flight ledger**: each running attempt (``Flight``);
- the **outbox**, and every ``done`` sent lately (a restarted scheduler's reconciliation);
- the runs that hold blocks but do not run yet (a matcher being built, a prefix being read).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from gpu.disk.io import DiskIO
from gpu.lora.cache import AdapterCache
from gpu.request_table import RequestTable
from gpu.structured.builds import MatcherBuilds
from messages import executor as xm
from messages.scheduler import RequestDone

Outgoing = tuple[str, msgspec.Struct]


class Flight:
    """What the core tracks per in-flight request (the executor tracks the rest)."""

    __slots__ = ("attempt", "grow_asked", "output_offset", "outputs", "prompt", "spec", "started")

    def __init__(
        self, attempt: int, prompt: list[int], output_offset: int = 0, started: float = 0.0
    ) -> None:
        self.attempt = attempt
        self.prompt = prompt
        self.output_offset = output_offset
        self.outputs: list[int] = []
        self.grow_asked = 0  # total tokens last asked of the KV manager
        self.started = started  # the core's clock when it started running
        self.spec = [0, 0, 0]  # speculation: steps that verified drafts, drafts, accepted


def finished(rid: str, fl: Flight, reason: str) -> RequestDone:
    """What the scheduler is told when request ``rid`` ends. The last output's KV was never
    written: it is not among the cacheable tokens."""
    return RequestDone(
        request_id=rid,
        attempt=fl.attempt,
        status="finished",
        kv_token_ids=fl.prompt + fl.outputs[:-1],
        output_ids=fl.outputs,
        finish_reason=reason,
        spec_drafts=fl.spec[0],
        spec_draft_tokens=fl.spec[1],
        spec_accepted=fl.spec[2],
    )


class CoreState:
    """What the executor core's parts share."""

    def __init__(
        self,
        requests: RequestTable,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
        builds: MatcherBuilds | None = None,
        disk: DiskIO | None = None,
        loras: AdapterCache | None = None,
    ) -> None:
        self.requests = requests
        self.loras = loras  # resident LoRA adapters and the runs waiting for one (--enable-lora)
        self.log = log
        self.clock = clock
        self.builds = builds  # constrained runs waiting for their matcher, else None
        self.disk = disk  # the disk tier's loads and writes (--kv-disk-dir), else None
        self.flight: dict[str, Flight] = {}
        self.outbox: list[Outgoing] = []
        # every done of the last RECENT_S seconds: a scheduler that died may not have read them
        self.recent_done: deque[tuple[float, RequestDone]] = deque(maxlen=8192)

    def send(self, peer: str, msg: msgspec.Struct) -> None:
        if isinstance(msg, RequestDone):
            self.recent_done.append((self.clock(), msg))
        self.outbox.append((peer, msg))

    def building(self) -> list[xm.Run]:
        """The runs waiting for their adapter, their matcher or their blocks from disk (they hold blocks,
        not yet running)."""
        runs = list(self.builds.runs.values()) if self.builds is not None else []
        if self.loras is not None:
            runs += [r for waiting in self.loras.waiting.values() for r in waiting]
        return runs + (list(self.disk.loading.values()) if self.disk is not None else [])
