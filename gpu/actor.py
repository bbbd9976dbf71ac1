"""The executor actor: sockets and the step loop around ``ExecutorCore`` (``gpu/core.py``).

The core decides (the flight ledger, runs and ends, the burst wait, what a step publishes,
recovery); this shell holds the sockets, the ``ModelRunner`` (model + paged KV) and time. Each
iteration hands the core what the inbox parked (runs, block grants, preemptions, stops), waits
for a burst when the core says so, runs one mixed prefill/decode step in a worker thread (or on
the main thread, gpu/main_thread.py) and sends the core's outbox. It blocks only when it has
nothing to run. A constrained run's matcher is built in a worker thread from the grammar the
front door compiled, while the steps go on (``take_builds``). The executor validates nothing
the front door did (``gpu/requests.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from gpu.core import ExecutorCore
from gpu.disk import jobs as disk_jobs
from gpu.kernels import isa as kernel_isa
from gpu.lora.cache import AdapterCache, load_adapter
from gpu.model.from_config import executor_from_config
from gpu.model.paged_kernel import usable
from gpu.model_runner import ModelRunner, StepResult
from gpu.step.budget import step_target
from gpu.structured.builds import GrammarBuilt, build_grammar
from messages import executor as xm
from messages.common import LoraRef, Reconcile


class ExecutorActor(Actor):
    name = "executor"
    inbound = xm.ExecutorInbound

    def __init__(self, cfg: RuntimeConfig, executor: ModelRunner | None = None) -> None:
        super().__init__(cfg)
        self.ex = executor or executor_from_config(cfg)
        self.grammars = self.ex.structured.cache
        spec = self.ex.speculative  # room for a step's drafts, asked beyond the lookahead
        loras = None
        if cfg.lora.enable_lora:
            loras = AdapterCache(cfg.lora.resident, self.ex.requests.loras_in_use, self.log)
            self.ex.adapter = loras.get
        self.store = disk_jobs.open_store(cfg, self.ex) if cfg.kv.disk_dir else None
        self.core = ExecutorCore(
            self.ex,
            cfg.kv.lookahead_blocks * cfg.kv.block_size,
            max(0.0, cfg.executor.burst_wait_ms) / 1000.0,
            self.log,
            grammars=self.grammars,
            draft_tokens=spec.num_speculative_tokens if spec is not None else 0,
            disk=disk_jobs.ledger(self.ex) if self.store is not None else None,
            loras=loras,
        )
        self.flight = self.core.flight
        self.nursery: trio.Nursery | None = None
        self.mailbox: deque[Any] = deque()
        self.wake = trio.Event()
        self.step_started: float | None = None
        self.reconcile_due: list[bytes] = []  # a (re)started scheduler asked what runs here
        self.disk_reads = trio.CapacityLimiter(1)
        # writes and deletes, one at a time in the order the KV manager sent them: the deletes
        # that make room for a save are done before it starts (the tier's byte bound holds)
        self.disk_writes, self.disk_writes_todo = trio.open_memory_channel[Callable[[], Any]](
            math.inf
        )
        self._announce()
        # where a step runs: trio's worker thread, or the main thread (gpu/main_thread.py,
        # set by the runner)
        self.run_step: Callable[[Callable[[], StepResult]], Awaitable[StepResult]] = (
            trio.to_thread.run_sync
        )
        self.log.info(
            "executor.config",
            model=cfg.model,
            arch=self.ex.spec.arch,
            model_impl=self.ex.spec.impl,  # the path --model-impl chose (gpu/model/loader.py)
            device=str(self.ex.device),
            dtype=str(self.ex.dtype),
            dtype_reason=self.ex.dtype_reason,
            kv_dtype=str(self.ex.kv_dtype),
            num_blocks=self.ex.num_blocks,
            block_size=self.ex.block_size,
            kv_bytes=self.ex.kv_bytes,
            max_model_len=self.ex.max_model_len,
            # the kernel library's operator (gpu/kernels.py), in the instruction set it runs
            decode_attention="paged_kernel"
            if usable(self.ex.device, self.ex.kv_dtype)
            else "tensor",
            kernel_isa=kernel_isa() if self.ex.device.type == "cpu" else None,
            **dataclasses.asdict(self.ex.budget),
            burst_wait_ms=cfg.executor.burst_wait_ms,
            speculative=dataclasses.asdict(spec) if (spec := self.ex.speculative) else None,
            spec_costs=self.ex.spec_cost.as_dict() if spec else None,
            step_target_s=round(step_target(self.ex.seed_costs, self.ex.budget.step_target_ms), 6),
            bound_cpus=self.ex.bound_cpus,  # --bind-threads: the CPU of each OpenMP thread
            step_costs=self.ex.seed_costs.as_dict(),  # the start's model (the adaptive seed)
        )

    @property
    def steps(self) -> int:
        return self.core.steps

    # ------------------------------------------------------------------ loop
    async def start_tasks(self, nursery: trio.Nursery) -> None:
        # The inbox reader answers pings and handshakes at once, even mid-step (the step runs in
        # a worker thread), and parks every other message in the mailbox for the next step start.
        self.nursery = nursery
        nursery.start_soon(super().main_loop)
        if self.store is not None:
            nursery.start_soon(self._disk_writer)

    def busy_s(self) -> float:
        """The step in flight so far (peers allow a silence of some multiple of it)."""
        started = self.step_started
        return 0.0 if started is None else time.perf_counter() - started

    async def main_loop(self) -> None:
        step = self._step_fn()
        core = self.core
        while True:
            t0 = time.perf_counter()
            idle = not self.ex.has_work()
            # what reached the socket during the step (an abort) is read now, not after the next
            # step: the inbox reader task may not have run since the step's outcome woke us
            self.drain_inbox()
            self._drain()
            if core.gathers(idle):
                await self._gather_burst()
            if core.recovery.holding_due:
                core.recovery.holding()
            while self.reconcile_due:
                self.reply(self.reconcile_due.pop(), core.recovery.held())
            self._flush()
            if not self.ex.has_work():
                self.wake = trio.Event()
                await self.wake.wait()
                continue
            t1 = self.step_started = time.perf_counter()
            try:
                result = await self.run_step(step)
            finally:
                self.step_started = None
            t2 = time.perf_counter()
            core.stepped(result, t2 - t1, (t1 - t0) + (time.perf_counter() - t2))
            self._flush()
            if not result.num_requests and result.skipped and not self.mailbox:
                # every request waits for blocks (a shortage, or the KV manager restarting):
                # sleep until a message (a grant, a preemption) arrives
                self.wake = trio.Event()
                await self.wake.wait()

    async def _gather_burst(self) -> None:
        """Wait for the burst the core expects, at most ``burst_wait_ms`` and no longer than it
        takes to hold a full step's budget. Never waits while anything runs."""
        t0 = trio.current_time()
        deadline = t0 + self.core.burst_wait_s
        while not self.core.gathered() and (left := deadline - trio.current_time()) > 0:
            self.wake = trio.Event()
            with trio.move_on_after(left):
                await self.wake.wait()
            self._drain()
        self.core.burst_waited(trio.current_time() - t0)

    def _drain(self) -> None:
        """Hand the core what the inbox reader parked, in order; start the matcher builds."""
        while self.mailbox:
            self.core.apply(self.mailbox.popleft())
            for run in self.core.take_builds():
                if self.nursery is None:  # not serving (a test driving the handlers): here
                    self.core.apply(GrammarBuilt(run, build_grammar(self.grammars, run), 0.0))
                else:
                    self.nursery.start_soon(self._build, run)
            for ref in self.core.take_loras():
                if self.nursery is None:
                    self.core.apply(load_adapter(ref))
                else:
                    self.nursery.start_soon(self._load_lora, ref)
            for work in self.core.take_disk():
                assert self.store is not None
                job = functools.partial(disk_jobs.do, self.store, self.ex, work)
                if self.nursery is None:
                    self._disk_done(job())
                elif isinstance(work, xm.Run):  # one read at a time: a run whose blocks
                    # are read first starts first (two cores read no faster for sharing them)
                    self.nursery.start_soon(self._disk_read, job)
                else:
                    self.disk_writes.send_nowait(job)

    async def _disk_read(self, job: Callable[[], Any]) -> None:
        self._disk_done(await trio.to_thread.run_sync(job, limiter=self.disk_reads))

    async def _disk_writer(self) -> None:
        async for job in self.disk_writes_todo:
            self._disk_done(await trio.to_thread.run_sync(job))

    def _disk_done(self, result: Any) -> None:
        if result is not None:
            self.mailbox.append(result)
            self.wake.set()

    def _announce(self) -> None:
        """Tell the KV manager what the disk tier holds (at start; to a restarted one)."""
        if self.store is not None:
            self.core.send("kv_manager", disk_jobs.announcement(self.store, self.ex))
            self.wake.set()

    async def _build(self, run: xm.Run) -> None:
        t0 = time.perf_counter()
        result = await trio.to_thread.run_sync(build_grammar, self.grammars, run)
        self.mailbox.append(GrammarBuilt(run, result, time.perf_counter() - t0))
        self.wake.set()

    async def _load_lora(self, ref: LoraRef) -> None:
        self.mailbox.append(await trio.to_thread.run_sync(load_adapter, ref))
        self.wake.set()

    def _flush(self) -> None:
        for peer, msg in self.core.take_outbox():
            self.send(peer, msg)

    def _step_fn(self) -> Callable[[], StepResult]:
        """One step, as ``run_step`` runs it (in a worker thread or on the main thread): the
        planned prompts reach the core back on trio's thread, and leave at once."""
        token = trio.lowlevel.current_trio_token()

        def planned(rids: list[str]) -> None:
            try:
                token.run_sync_soon(self._planned, rids)
            except trio.RunFinishedError:
                pass  # shutting down

        return functools.partial(self.ex.step, on_planned=planned)

    def _planned(self, rids: list[str]) -> None:
        self.core.planned(rids)
        self._flush()

    # -------------------------------------------------------------- inbound
    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, xm.Stats):
            cache = self.ex.structured.cache
            self.reply(
                ident,
                xm.ExecutorStats(
                    running=self.ex.num_requests(),
                    steps=self.core.steps,
                    num_blocks=self.ex.num_blocks,
                    block_size=self.ex.block_size,
                    max_model_len=self.ex.max_model_len,
                    structured_hits=cache.hits,
                    structured_misses=cache.misses,
                    structured_cached=len(cache),
                ),
            )
            return
        if isinstance(msg, Reconcile):
            self.reconcile_due.append(ident)  # answered by the step loop, after the mailbox
        else:
            self.mailbox.append(msg)
        self.wake.set()

    # ------------------------------------------------------------- peers
    def on_peer_dead(self, name: str, reason: str) -> None:
        if name not in ("kv_manager", "scheduler"):
            self.mailbox.clear()
        self.core.recovery.peer_dead(name, reason)

    def on_peer_back(self, name: str) -> None:
        if name == "kv_manager":
            self._announce()
        if self.core.recovery.peer_back(name):
            self.wake.set()
