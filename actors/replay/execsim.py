"""The executor, simulated: ``gpu/actor.py``'s step loop and ``gpu/executor.py``'s bookkeeping
without the model. Each iteration applies what arrived since the last one (runs, block grants,
preemptions, stops), plans one step with the real ``plan_step``, lets the step take as long as
the step-time model says, then publishes like the real actor: ``PrefillDone`` to the scheduler
for the prompts a step completes when it is planned; after it, tokens to the front door,
``RequestDone`` to the scheduler and ``Grow`` to the KV manager one block
ahead of need. A request produces the tokens its replayed sequence holds and finishes after
as many tokens as it produced in the recorded run."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from actors.kv.reservation import grow_to, kv_tokens_at_most
from actors.replay.loop import Loop
from actors.replay.stepmodel import StepModel
from gpu.recovery import finished
from gpu.requests import RequestState
from gpu.step_plan import StepBudget, StepPlan, burst_end, fills_a_step, plan_step
from messages import executor as xm
from messages.kv import Grow
from messages.scheduler import PrefillDone, RequestDone
from messages.tokenizer import TokenBatch, TokenEvent

NO_LIMIT = 1 << 62  # the model's length, unknown here


class _Flight:
    """What the actor tracks per request, plus where its stand-in tokens come from."""

    __slots__ = (
        "attempt", "fill", "grow_asked", "outputs", "prompt", "reason", "seq", "seq_base",
        "started", "total",
    )  # fmt: skip

    def __init__(self, attempt: int, prompt: list[int], started: float, script: Script) -> None:
        self.attempt = attempt
        self.prompt = prompt
        self.outputs: list[int] = []
        self.grow_asked = 0
        self.started = started
        self.seq, self.seq_base, self.total, self.reason, self.fill = script


# (sequence, index of its first generated token, outputs in all, finish reason, filler token)
Script = tuple[list[int], int, int, str, int]


class SimExecutor:
    name = "executor"

    def __init__(
        self,
        loop: Loop,
        budget: StepBudget,
        block_size: int,
        lookahead_tokens: int,
        model: StepModel,
        rec: Any,
        script: Callable[[str], Script],
        out_hop_s: float,
        num_blocks: int,
        burst_wait_s: float = 0.0,
    ) -> None:
        self.loop = loop
        self.budget = budget
        self.bs = block_size
        self.lookahead = lookahead_tokens
        self.model = model
        self.rec = rec
        self.script = script  # request id -> what it generates and when it finishes
        self.out_hop_s = out_hop_s
        self.prefilling: dict[str, RequestState] = {}
        self.decoding: dict[str, RequestState] = {}
        self.flight: dict[str, _Flight] = {}
        self.mailbox: deque[Any] = deque()
        self.busy = False
        self.steps = 0
        self.burst_wait_s = burst_wait_s
        self.more_coming = False  # the last run said another is being admitted behind it
        self.gathering = 0  # > 0 while waiting for a burst (the wait's number)
        self.gather_t0 = 0.0
        self.waits = 0
        rec.record(
            "executor.config",
            model="(replay)",
            device="simulated",
            num_blocks=num_blocks,
            block_size=block_size,
            step_budget=budget.step_budget,
            chunk_cap=budget.chunk_cap,
            max_batch_size=budget.max_batch_size,
            long_prefill_threshold=budget.long_prefill_threshold,
            max_long_prefills=budget.max_long_prefills,
            decode_first=budget.decode_first,
            burst_wait_ms=burst_wait_s * 1000.0,
        )

    def handle(self, msg: Any) -> None:
        self.mailbox.append(msg)
        if self.gathering:
            self._drain()
            if not self.more_coming or self._fills_a_step():
                self._gathered(self.gathering)
        elif not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._iterate)

    # ------------------------------------------------------------------ loop
    def _drain(self) -> None:
        while self.mailbox:
            self._apply(self.mailbox.popleft())

    def _gathered(self, wait: int) -> None:
        """The burst the idle executor waited for is in (or the wait ran out): step."""
        if self.gathering != wait:
            return  # that wait already ended
        self.gathering = 0
        self.rec.record(
            "executor.burst_waited",
            waited_s=self.loop.now - self.gather_t0,
            requests=len(self.prefilling) + len(self.decoding),
            ended=burst_end(self.more_coming, self._fills_a_step()),
        )
        self.more_coming = False
        self._iterate()

    def _fills_a_step(self) -> bool:
        n = len(self.prefilling) + len(self.decoding)
        return fills_a_step(self.prefilling.values(), n, self.budget)

    def _iterate(self) -> None:
        idle = not (self.prefilling or self.decoding)
        self._drain()
        if idle and self.more_coming and self.burst_wait_s > 0 and self.prefilling:
            # as the actor: wait (bounded) for the rest of a burst before the first step
            self.waits += 1
            self.gathering = wait = self.waits
            self.gather_t0 = self.loop.now
            self.loop.at(self.loop.now + self.burst_wait_s, self._gathered, wait)
            return
        plan = None
        if self.prefilling or self.decoding:
            plan = plan_step(self.decoding.values(), self.prefilling.values(), self.budget, self.bs)
        if plan is None or not (plan.decodes or plan.chunks):
            self.busy = False  # idle, or every decode waits for a block: the next message wakes us
            return
        dctx = sum(r.computed for r in plan.decodes)
        pre = sum(c for _, c in plan.chunks)
        pctx = sum(c * (r.computed + c) for r, c in plan.chunks)
        dt = self.model.predict(pre, len(plan.decodes), len(plan.chunks), dctx, pctx)
        finals = plan.completing()
        for r in finals:  # the prompts this step completes, told when it is planned
            self.loop.send(
                "scheduler", PrefillDone(request_id=r.rid, attempt=self.flight[r.rid].attempt)
            )
        end = self.loop.now + max(dt, 1e-6)
        self.loop.at(end, self._step_done, plan, finals, dt, pre, dctx, pctx)

    def _step_done(
        self,
        plan: StepPlan,
        finals: list[RequestState],
        dt: float,
        pre: int,
        dctx: int,
        pctx: int,
    ) -> None:
        for r in plan.decodes:
            r.computed += 1
        for r, c in plan.chunks:
            r.computed += c
        events: list[TokenEvent] = []
        produce = self._produce
        for req in plan.decodes:
            produce(req, events)
        for req in finals:
            produce(req, events)
        if events:
            self.loop.send("tokenizer", TokenBatch(events=events), self.out_hop_s)
        self.steps += 1
        self.rec.record(
            "executor.step",
            step=self.steps,
            requests=len(plan.decodes) + len(plan.chunks),
            prefill_tokens=pre,
            decode_tokens=len(plan.decodes),
            skipped=len(plan.skipped),
            forward_s=dt,
            step_s=dt,
            control_s=0.0,
            decode_ctx=dctx,
            prefill_ctx=pctx,
        )
        self._iterate()

    def _produce(self, req: RequestState, events: list[TokenEvent]) -> None:
        """One sampled token: the executor's bookkeeping, then the actor's publishing."""
        rid = req.rid
        fl = self.flight[rid]
        out = req.out
        first = not out
        k = fl.seq_base + req.prior + len(out)
        tok = fl.seq[k] if k < len(fl.seq) else fl.fill
        out.append(tok)
        n_out = req.prior + len(out)
        finish = fl.reason if n_out >= fl.total else None
        if finish is not None:
            self.prefilling.pop(rid, None)
            self.decoding.pop(rid, None)
        elif first:
            del self.prefilling[rid]
            self.decoding[rid] = req
        fl.outputs.append(tok)
        events.append(TokenEvent(rid, tok, None, None, finish))
        send = self.loop.send
        if first:
            ttft = self.loop.now - fl.started
            self.rec.record("executor.prefill_done", request_id=rid, ttft_s=ttft)
        if finish is not None:
            del self.flight[rid]
            send("scheduler", finished(rid, fl, finish))
            return
        # (the recorded outputs already end where the model's length ended them)
        at_most = kv_tokens_at_most(len(req.prompt), req.params.max_tokens - req.prior, NO_LIMIT)
        want = grow_to(len(req.prompt) - req.prior + n_out, self.lookahead, at_most)
        if len(req.table) * self.bs < want and fl.grow_asked < want:
            fl.grow_asked = want
            send("kv_manager", Grow(request_id=rid, attempt=fl.attempt, total_tokens=want))

    # -------------------------------------------------------------- inbound
    def _apply(self, msg: Any) -> None:
        if isinstance(msg, xm.Run):
            self._run(msg)
            return
        fl = self.flight.get(msg.request_id)
        if fl is None or fl.attempt != msg.attempt:
            return
        if isinstance(msg, xm.Extend):
            req = self.prefilling.get(msg.request_id) or self.decoding[msg.request_id]
            req.table.extend(msg.blocks)
            self.rec.record("executor.extended", request_id=msg.request_id, blocks=msg.blocks)
        elif isinstance(msg, xm.Preempt):
            fl = self._end(msg.request_id, "preempted")
            n = len(fl.outputs)
            self.rec.record(
                "executor.preempted", request_id=msg.request_id, attempt=fl.attempt, output_tokens=n
            )
        elif isinstance(msg, xm.Stop):
            fl = self._end(msg.request_id, "aborted")
            self.rec.record(
                "executor.aborted",
                request_id=msg.request_id,
                attempt=fl.attempt,
                output_tokens=len(fl.outputs),
                reason=msg.reason,
            )

    def _run(self, msg: xm.Run) -> None:
        rid = msg.request_id
        self.more_coming = msg.more
        if rid in self.flight:
            self._forget(rid)
            self.flight.pop(rid)
        prompt = list(msg.prompt_ids)
        self.prefilling[rid] = RequestState(
            rid, prompt, msg.params, list(msg.block_table), msg.cached_tokens, 0, frozenset(),
            msg.output_offset,
        )  # fmt: skip
        self.flight[rid] = _Flight(msg.attempt, prompt, self.loop.now, self.script(rid))
        self.rec.record(
            "executor.running",
            request_id=rid,
            attempt=msg.attempt,
            prompt_tokens=len(prompt),
            cached_tokens=msg.cached_tokens,
            blocks=len(msg.block_table),
        )

    def _forget(self, rid: str) -> None:
        self.prefilling.pop(rid, None)
        self.decoding.pop(rid, None)

    def _end(self, rid: str, status: str) -> _Flight:
        fl = self.flight.pop(rid)
        self._forget(rid)
        self.loop.send(
            "scheduler",
            RequestDone(request_id=rid, attempt=fl.attempt, status=status, output_ids=fl.outputs),
        )
        return fl
