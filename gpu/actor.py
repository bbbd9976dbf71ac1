"""The executor actor: owns the ``Executor`` (model + paged KV) and runs the step loop.

Each iteration drains the inbox without waiting (runs, block grants, preemptions, aborts), runs
one mixed prefill/decode step, publishes the step's tokens to the tokenizer service and request
ends to the scheduler, and asks the KV manager for blocks *ahead of need* (one block of
lookahead), so a step never waits on a round trip. It blocks only when it has nothing to run.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import trio

from actors.runtime.actor import Actor
from actors.runtime.config import RuntimeConfig
from gpu.executor import Executor, ExecutorInputError, StepResult
from gpu.sampling import SamplingParams
from messages import common
from messages import executor as xm
from messages.kv import Grow
from messages.scheduler import PrefillDone, RequestDone
from messages.tokenizer import TokenBatch, TokenEvent

CPU_DEFAULT_KV_BYTES = 512 << 20


def resolve_num_blocks(cfg: RuntimeConfig) -> int:
    """The KV pool size in blocks: ``kv.num_blocks`` if set, else from the memory budget and the
    model's shape (both the KV manager and the executor must use the same number)."""
    if cfg.kv.num_blocks:
        return int(cfg.kv.num_blocks)
    from gpu import loader
    from gpu.kv_cache import PagedKVCache

    spec = loader.load_spec(cfg.model)
    device = loader.resolve_device(cfg.executor.device)
    dtype = loader.resolve_dtype(cfg.executor.dtype, device)
    per_block = PagedKVCache.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, cfg.kv.block_size, dtype
    )
    budget = cfg.kv.kv_memory
    if budget is None:
        budget = 0.8 if device.type == "cuda" else CPU_DEFAULT_KV_BYTES
    return PagedKVCache.blocks_for_budget(budget, per_block, device)


def to_exec_params(p: common.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
    )


class _Flight:
    """What the actor tracks per in-flight request (the executor tracks the rest)."""

    __slots__ = ("attempt", "grow_asked", "outputs", "prompt", "started")

    def __init__(self, attempt: int, prompt: list[int]) -> None:
        self.attempt = attempt
        self.prompt = prompt
        self.outputs: list[int] = []
        self.grow_asked = 0  # total tokens last asked of the KV manager
        self.started = time.monotonic()


class ExecutorActor(Actor):
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
        )
        self.flight: dict[str, _Flight] = {}
        self.mailbox: deque[Any] = deque()
        self.wake = trio.Event()
        self.steps = 0
        self.lookahead = cfg.kv.lookahead_blocks * cfg.kv.block_size
        self.log.info(
            "executor.config",
            model=cfg.model,
            device=str(self.ex.device),
            dtype=str(self.ex.dtype),
            num_blocks=self.ex.num_blocks,
            block_size=self.ex.block_size,
            **dataclasses.asdict(self.ex.budget),
        )

    # ------------------------------------------------------------------ loop
    async def start_tasks(self, nursery: trio.Nursery) -> None:
        # The inbox reader answers pings and handshakes at once, even mid-step (the step runs in
        # a worker thread), and parks every other message in the mailbox for the next step start.
        nursery.start_soon(super().main_loop)

    async def main_loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            while self.mailbox:
                self._apply(self.mailbox.popleft())
            if not self.ex.has_work():
                self.wake = trio.Event()
                await self.wake.wait()
                continue
            t1 = time.perf_counter()
            result = await trio.to_thread.run_sync(self.ex.step)
            t2 = time.perf_counter()
            self._publish(result)
            t3 = time.perf_counter()
            self.steps += 1
            if result.num_requests:
                self.log.info(
                    "step",
                    step=self.steps,
                    requests=result.num_requests,
                    prefill_tokens=result.num_prefill_tokens,
                    decode_tokens=result.num_decode_tokens,
                    skipped=len(result.skipped),
                    forward_s=round(result.forward_s, 6),
                    step_s=round(t2 - t1, 6),
                    control_s=round((t1 - t0) + (t3 - t2), 6),
                )

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
                ),
            )
            return
        self.mailbox.append(msg)
        self.wake.set()

    def on_peer_dead(self, name: str, reason: str) -> None:
        self.mailbox.clear()
        for rid in list(self.flight):
            self.ex.abort(rid)
        self.log.warning("executor.reset", reason=reason, dropped=len(self.flight))
        self.flight.clear()

    def _apply(self, msg: Any) -> None:
        if isinstance(msg, xm.Run):
            self._run(msg)
            return
        fl = self.flight.get(msg.request_id)
        if fl is None or fl.attempt != msg.attempt:
            return  # the request already ended; the sender learns it from RequestDone
        if isinstance(msg, xm.Extend):
            self.ex.extend(msg.request_id, msg.blocks)
            self.log.debug("kv.extended", request_id=msg.request_id, blocks=msg.blocks)
        elif isinstance(msg, xm.Preempt):
            self._end(msg.request_id, "preempted")
        elif isinstance(msg, xm.Stop):
            self._end(msg.request_id, "aborted")

    def _run(self, msg: xm.Run) -> None:
        rid = msg.request_id
        if rid in self.flight:  # a stale attempt still here: drop it first
            self.ex.abort(rid)
            self.flight.pop(rid)
        try:
            self.ex.add_request(
                rid,
                msg.prompt_ids,
                to_exec_params(msg.params),
                msg.block_table,
                msg.cached_tokens,
                prior_output_tokens=msg.output_offset,
            )
        except ExecutorInputError as e:
            self.log.warning("request.rejected", request_id=rid, field=e.field, reason=e.reason)
            self.send(
                "scheduler",
                RequestDone(
                    request_id=rid,
                    attempt=msg.attempt,
                    status="error",
                    message=str(e),
                    field=e.field,
                ),
            )
            return
        self.flight[rid] = _Flight(msg.attempt, msg.prompt_ids)
        self.log.info(
            "request.running",
            request_id=rid,
            attempt=msg.attempt,
            prompt_tokens=len(msg.prompt_ids),
            cached_tokens=msg.cached_tokens,
            blocks=len(msg.block_table),
        )

    def _end(self, rid: str, status: str) -> None:
        fl = self.flight.pop(rid)
        self.ex.abort(rid)
        self.log.info(
            f"request.{status}", request_id=rid, attempt=fl.attempt, output_tokens=len(fl.outputs)
        )
        self.send(
            "scheduler",
            RequestDone(request_id=rid, attempt=fl.attempt, status=status, output_ids=fl.outputs),
        )

    # -------------------------------------------------------------- outbound
    def _publish(self, result: StepResult) -> None:
        events: list[TokenEvent] = []
        for out in result.outputs:
            if out.token_id is None:
                continue
            rid = out.request_id
            fl = self.flight.get(rid)
            if fl is None:
                continue
            fl.outputs.append(out.token_id)
            events.append(
                TokenEvent(rid, out.token_id, out.logprob, out.top_logprobs, out.finish_reason)
            )
            if out.prefill_done:
                self.log.info(
                    "request.prefill_done",
                    request_id=rid,
                    ttft_s=round(time.monotonic() - fl.started, 6),
                )
                self.send("scheduler", PrefillDone(request_id=rid, attempt=fl.attempt))
            if out.finish_reason is not None:
                self.flight.pop(rid)
                kv_tokens = fl.prompt + fl.outputs[:-1]
                self.send(
                    "scheduler",
                    RequestDone(
                        request_id=rid,
                        attempt=fl.attempt,
                        status="finished",
                        kv_token_ids=kv_tokens,
                        output_ids=fl.outputs,
                        finish_reason=out.finish_reason,
                    ),
                )
                continue
            # Grow ahead of need: the next step writes KV for prompt + outputs tokens.
            need = out.num_prompt_tokens + out.num_output_tokens
            capacity = self.ex.capacity(rid)
            if capacity < need + self.lookahead and fl.grow_asked < need + self.lookahead:
                fl.grow_asked = need + self.lookahead
                self.send(
                    "kv_manager",
                    Grow(request_id=rid, attempt=fl.attempt, total_tokens=fl.grow_asked),
                )
        if events:
            self.send("tokenizer", TokenBatch(events=events))
