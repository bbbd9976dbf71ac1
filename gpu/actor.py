"""The executor actor: owns the ``Executor`` (model + paged KV) and runs the step loop.

Each iteration drains the inbox without waiting (runs, block grants, preemptions, aborts), runs
one mixed prefill/decode step, publishes the step's tokens to the tokenizer service and request
ends to the scheduler (the prompts a step completes as soon as it is planned: ``PrefillDone``,
so that requests sharing their prefix are admitted while its forward runs), and asks the KV
manager for blocks *ahead of need* (one block of lookahead), so a step never waits on a round
trip. It blocks only when it has nothing to run; with nothing running, it waits for a burst
being admitted (``x_run.more``) before its first step.

A constrained request (``params.structured``) comes with the grammar the front door compiled
(``Run.grammar``); when its matcher is not in the executor's cache it is built in a worker thread
while the steps go on, and joins the batch when built; a preemption or abort meanwhile is
answered at once. The executor validates nothing the front door did (``gpu/requests.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from gpu.executor import Executor, ExecutorInputError, StepResult
from gpu.kernels import isa as kernel_isa
from gpu.kv_cache import resolve_num_blocks
from gpu.paged_kernel import usable
from gpu.publish import step_messages
from gpu.recovery import Flight, RecoveryMixin
from gpu.step_plan import burst_end
from gpu.structured.grammar import Compiled, GrammarError
from gpu.structured.pending import Done, PendingCompiles
from messages import executor as xm
from messages.common import Reconcile
from messages.scheduler import PrefillDone, RequestDone


class ExecutorActor(RecoveryMixin, Actor):
    name = "executor"
    inbound = xm.ExecutorInbound

    def __init__(self, cfg: RuntimeConfig, executor: Executor | None = None) -> None:
        super().__init__(cfg)
        x = cfg.executor
        self.ex = executor or Executor(
            cfg.model,
            dtype=x.dtype,
            device=x.device,
            num_blocks=resolve_num_blocks(cfg),
            block_size=cfg.kv.block_size,
            chunk_cap=x.chunk_cap,
            step_budget=x.step_budget,
            max_batch_size=cfg.scheduler.max_batch_size,
            long_prefill_threshold=x.long_prefill_threshold,
            max_long_prefills=x.max_long_prefills,
            decode_first=x.decode_first,
            threads=x.threads,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=x.gpu_memory_utilization,
        )
        self.flight: dict[str, Flight] = {}
        self.compiling = PendingCompiles(self.ex.structured)
        self.nursery: trio.Nursery | None = None
        self.mailbox: deque[Any] = deque()
        self.wake = trio.Event()
        self.steps = 0
        self.step_started: float | None = None
        self._init_recovery()
        # where a step runs: trio's worker thread, or the main thread (gpu/main_thread.py,
        # set by the runner)
        self.run_step: Callable[[Callable[[], StepResult]], Awaitable[StepResult]] = (
            trio.to_thread.run_sync
        )
        self.lookahead = cfg.kv.lookahead_blocks * cfg.kv.block_size
        self.burst_wait_s = max(0.0, cfg.executor.burst_wait_ms) / 1000.0
        self.more_coming = False  # the last run said another is being admitted behind it
        self.log.info(
            "executor.config",
            model=cfg.model,
            device=str(self.ex.device),
            dtype=str(self.ex.dtype),
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
        )

    # ------------------------------------------------------------------ loop
    async def start_tasks(self, nursery: trio.Nursery) -> None:
        # The inbox reader answers pings and handshakes at once, even mid-step (the step runs in
        # a worker thread), and parks every other message in the mailbox for the next step start.
        self.nursery = nursery
        nursery.start_soon(super().main_loop)

    def busy_s(self) -> float:
        """The step in flight so far (peers allow a silence of some multiple of it)."""
        started = self.step_started
        return 0.0 if started is None else time.perf_counter() - started

    async def main_loop(self) -> None:
        step = self._step_fn()
        while True:
            t0 = time.perf_counter()
            idle = not self.ex.has_work()
            self._drain()
            if idle and self.more_coming and self.burst_wait_s > 0 and self.ex.has_work():
                await self._gather_burst()
            if self.holding_due:
                self._send_holding()
            while self.reconcile_due:
                self.reply(self.reconcile_due.pop(), self._held())
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
            self._publish(result)
            t3 = time.perf_counter()
            if not result.num_requests:  # not a step: nothing ran (counted steps are logged)
                if result.skipped and not self.mailbox:
                    # every request waits for blocks (a shortage, or the KV manager restarting):
                    # sleep until a message (a grant, a preemption) arrives
                    self.wake = trio.Event()
                    await self.wake.wait()
                continue
            self.steps += 1
            self.log.info(
                "executor.step",
                step=self.steps,
                requests=result.num_requests,
                prefill_tokens=result.num_prefill_tokens,
                decode_tokens=result.num_decode_tokens,
                skipped=len(result.skipped),
                constrained=result.num_constrained,
                mask_s=round(result.mask_s, 6),
                forward_s=round(result.forward_s, 6),
                step_s=round(t2 - t1, 6),
                control_s=round((t1 - t0) + (t3 - t2), 6),
                decode_ctx=result.decode_ctx,
                prefill_ctx=result.prefill_ctx,
            )

    async def _gather_burst(self) -> None:
        """Nothing was running and the scheduler is admitting more requests right behind the
        last run (``x_run.more``): wait for them, at most ``burst_wait_ms`` and no longer than
        it takes to hold a full step's budget, so that the first step takes the burst rather
        than one request (which would hold the rest back for a whole step). Never waits while
        anything runs."""
        t0 = trio.current_time()
        deadline = t0 + self.burst_wait_s
        while (
            self.more_coming
            and not self.ex.fills_a_step()
            and (left := deadline - trio.current_time()) > 0
        ):
            self.wake = trio.Event()
            with trio.move_on_after(left):
                await self.wake.wait()
            self._drain()
        self.log.info(
            "executor.burst_waited",
            waited_s=round(trio.current_time() - t0, 6),
            requests=self.ex.num_requests(),
            ended=burst_end(self.more_coming, self.ex.fills_a_step()),
        )
        self.more_coming = False

    def _drain(self) -> None:
        """Apply what the inbox reader parked (runs, grants, preemptions, stops), in order."""
        while self.mailbox:
            self._apply(self.mailbox.popleft())

    def _step_fn(self) -> Callable[[], StepResult]:
        """One step, as ``run_step`` runs it (in a worker thread or on the main thread): the
        planned prompts reach ``_prefills_planned`` back on trio's thread."""
        token = trio.lowlevel.current_trio_token()

        def planned(rids: list[str]) -> None:
            try:
                token.run_sync_soon(self._prefills_planned, rids)
            except trio.RunFinishedError:
                pass  # shutting down

        return functools.partial(self.ex.step, on_planned=planned)

    def _prefills_planned(self, rids: list[str]) -> None:
        """The step just planned completes these prompts: tell the scheduler now, while the
        forward runs, so that the requests it held back for their prefix are admitted in time
        for the next step (``PrefillDone``). Safe: whatever arrives during a step waits in the
        mailbox for the next one, which starts after the forward has written that KV (a
        forward that raises ends this process, and the KV manager then drops its cache)."""
        for rid in rids:
            fl = self.flight.get(rid)
            if fl is not None:
                self.send("scheduler", PrefillDone(request_id=rid, attempt=fl.attempt))

    # -------------------------------------------------------------- inbound
    def handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, xm.Stats):
            self.reply(
                ident,
                xm.ExecutorStats(
                    running=self.ex.num_requests(),
                    steps=self.steps,
                    num_blocks=self.ex.num_blocks,
                    block_size=self.ex.block_size,
                    max_model_len=self.ex.max_model_len,
                    structured_hits=self.ex.structured.cache.hits,
                    structured_misses=self.ex.structured.cache.misses,
                    structured_cached=len(self.ex.structured.cache),
                ),
            )
            return
        if isinstance(msg, Reconcile):
            self.reconcile_due.append(ident)  # answered by the step loop, after the mailbox
        else:
            self.mailbox.append(msg)
        self.wake.set()

    def _apply(self, msg: Any) -> None:
        if isinstance(msg, xm.Run):
            self._run(msg)
            return
        if isinstance(msg, Done):
            if self.compiling.take(msg):  # else preempted, aborted or superseded since
                self._compiled(msg.run, msg.result, msg.seconds, cache_hit=False)
            return
        if not isinstance(msg, xm.Extend) and self.compiling.drop(msg.request_id, msg.attempt):
            status = "preempted" if isinstance(msg, xm.Preempt) else "aborted"
            self.log.info("executor.compile_dropped", request_id=msg.request_id, status=status)
            self.send(
                "scheduler",
                RequestDone(request_id=msg.request_id, attempt=msg.attempt, status=status),
            )
            return
        fl = self.flight.get(msg.request_id)
        if fl is None or fl.attempt != msg.attempt:
            return  # the request already ended; the sender learns it from RequestDone
        if isinstance(msg, xm.Extend):
            self.ex.extend(msg.request_id, msg.blocks)
            self.log.debug("executor.extended", request_id=msg.request_id, blocks=msg.blocks)
        elif isinstance(msg, xm.Preempt):
            fl = self._end(msg.request_id, "preempted")
            self.log.info(
                "executor.preempted",
                request_id=msg.request_id,
                attempt=fl.attempt,
                output_tokens=len(fl.outputs),
            )
        elif isinstance(msg, xm.Stop):
            fl = self._end(msg.request_id, "aborted")
            self.log.info(
                "executor.aborted",
                request_id=msg.request_id,
                attempt=fl.attempt,
                output_tokens=len(fl.outputs),
                reason=msg.reason,
            )

    def _run(self, msg: xm.Run) -> None:
        rid = msg.request_id
        self.more_coming = msg.more
        if rid in self.flight:  # a stale attempt still here: drop it first
            self.ex.abort(rid)
            self.flight.pop(rid)
        self.compiling.drop(rid)
        if msg.params.structured is None:
            self._start(msg, None)
            return
        found = self.compiling.cached(msg)
        if found is not None:
            self._compiled(msg, found, 0.0, cache_hit=True)
        elif self.nursery is not None:
            self.compiling.wait(self.nursery, msg, self._deliver)
        else:  # not serving (a test driving the actor's handlers): build it here
            self._compiled(msg, self.compiling.build(msg), 0.0, cache_hit=False)

    def _deliver(self, done: Done) -> None:
        self.mailbox.append(done)
        self.wake.set()

    def _compiled(
        self, msg: xm.Run, result: Compiled | GrammarError, seconds: float, cache_hit: bool
    ) -> None:
        cache = self.ex.structured.cache
        if isinstance(result, GrammarError):
            self._reject(msg, ExecutorInputError(msg.request_id, result.field, result.reason))
            return
        self.log.info(
            "executor.structured_compiled",
            request_id=msg.request_id,
            kind=result.constraint.kind,
            hash=result.constraint.digest,
            cache_hit=cache_hit,
            compile_s=round(result.compile_s, 6),
            wait_s=round(seconds, 6),
            cache_hits=cache.hits,
            cache_misses=cache.misses,
        )
        self._start(msg, result)

    def _reject(self, msg: xm.Run, e: ExecutorInputError) -> None:
        self.log.warning(
            "executor.rejected", request_id=msg.request_id, field=e.field, reason=e.reason
        )
        self.send(
            "scheduler",
            RequestDone(
                request_id=msg.request_id,
                attempt=msg.attempt,
                status="error",
                message=str(e),
                field=e.field,
            ),
        )

    def _start(self, msg: xm.Run, grammar: Compiled | None) -> None:
        rid = msg.request_id
        try:
            self.ex.add_request(
                rid,
                msg.prompt_ids,
                msg.params,
                msg.block_table,
                msg.cached_tokens,
                prior_output_tokens=msg.output_offset,
                grammar=grammar,
            )
        except ExecutorInputError as e:
            self._reject(msg, e)
            return
        self.flight[rid] = Flight(msg.attempt, msg.prompt_ids, msg.output_offset)
        self.log.info(
            "executor.running",
            request_id=rid,
            attempt=msg.attempt,
            prompt_tokens=len(msg.prompt_ids),
            cached_tokens=msg.cached_tokens,
            blocks=len(msg.block_table),
        )

    def _end(self, rid: str, status: str) -> Flight:
        """Drop the request (``status`` preempted or aborted) and tell the scheduler."""
        fl = self.flight.pop(rid)
        self.ex.abort(rid)
        self.send(
            "scheduler",
            RequestDone(request_id=rid, attempt=fl.attempt, status=status, output_ids=fl.outputs),
        )
        return fl

    # -------------------------------------------------------------- outbound
    def _publish(self, result: StepResult) -> None:
        for peer, msg in step_messages(
            result, self.flight, self.ex, self.lookahead, self.kv_down, self.log
        ):
            self.send(peer, msg)
