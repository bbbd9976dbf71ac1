"""The executor in a replay: the real ``ExecutorCore`` (``gpu/core.py``: the flight ledger, runs
and ends, the burst wait, what a step publishes) around a stand-in for the model. Only the
forward is replaced: a step plans with the real ``plan_step``, takes as long as the fitted
step-time model says, and each request produces the tokens its replayed sequence holds,
finishing after as many tokens as it produced in the recorded run. The loop around them is the
actor's (``gpu/actor.py``) on the virtual clock: drain the mailbox into the core, wait for a
burst when the core says so, step, send the core's outbox. A request that speculated in the
recording verifies, in its decode steps, the drafts of its recorded verifying steps, in order,
and emits the accepted ones too; the draft rows count in the step's predicted time."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

from actors.shared.grammar import Compiled
from gpu.core import ExecutorCore
from gpu.disk.io import DiskIO, DiskRead, DiskWritten
from gpu.request_table import RequestTable
from gpu.requests import RequestState, StepResult, TokenOutput
from gpu.spec.verify import SpecStats
from gpu.step.budget import AdaptiveBudget, Costs, step_target
from gpu.step.plan import StepBudget, StepPlan, StepShape
from messages.executor import DiskDrop, Run
from minirt.replay.loop import Loop
from minirt.replay.stepmodel import StepModel
from minirt.replay.workload import DiskModel

NO_LIMIT = 1 << 62  # the model's length, unknown here

# (sequence, index of its first generated token, outputs in all, finish reason, filler token)
Script = tuple[list[int], int, int, str, int]


class ScriptedRunner:
    """The ``Runner`` the core drives (``gpu.core.Runner``): the executor's request table and
    step planning, its forward replaced by each request's script."""

    def __init__(
        self,
        budget: StepBudget,
        block_size: int,
        num_blocks: int,
        script: Callable[[str], Script],
        spec: Callable[[str], list[tuple[int, int, bool]]] = lambda rid: [],
    ) -> None:
        # (the recorded outputs already end where the model's length ended them)
        self.requests = RequestTable(budget, block_size, num_blocks, NO_LIMIT)
        self.script = script  # request id -> what it generates and when it finishes
        self.scripts: dict[str, Script] = {}
        self.block_size = block_size
        self.spec = spec  # request id -> its recorded verifying steps: (drafts, accepted, explored)
        self.verifying: dict[str, deque[tuple[int, int, bool]]] = {}

    def start(self, run: Run, grammar: Compiled | None) -> None:
        self.requests.add(
            RequestState(
                run.request_id,
                list(run.prompt_ids),
                run.params,
                list(run.block_table),
                run.cached_tokens,
                0,
                frozenset(),
                run.output_offset,
            )
        )
        self.scripts[run.request_id] = self.script(run.request_id)
        if run.request_id not in self.verifying:  # (a new attempt goes on where it was)
            self.verifying[run.request_id] = deque(self.spec(run.request_id))

    def plan(self, prefill_cap: int | None = None) -> StepPlan | None:
        return self.requests.plan(prefill_cap) if self.requests.has_work() else None

    def drafts(self, plan: StepPlan) -> dict[str, tuple[int, int, bool]]:
        """The step's speculation: each decode's next recorded (drafts, accepted), as many
        drafts as its blocks have room for."""
        out = {}
        for r in plan.decodes:
            left = self.verifying.get(r.rid)
            if left:
                d, a, explored = left.popleft()
                d = min(d, len(r.table) * self.block_size - r.computed - 1)
                if d > 0:
                    out[r.rid] = (d, min(a, d), explored)
        return out

    def finish(
        self,
        plan: StepPlan,
        shape: StepShape,
        dt: float,
        drafts: dict[str, tuple[int, int, bool]] | None = None,
    ) -> StepResult:
        """What the step ``plan`` (of ``shape``) produced after ``dt`` seconds: each sampling
        request's next token from its script (and the drafts it accepted, ``drafts``)."""
        drafts = drafts or {}
        sampling = [*plan.decodes, *plan.completing()]
        for r in plan.decodes:
            r.computed += 1 + drafts.get(r.rid, (0, 0, False))[1]
        for r, c in plan.chunks:
            r.computed += c
        outputs = []
        stats = SpecStats() if drafts else None
        for r in sampling:
            d, a, explored = drafts.get(r.rid, (0, 0, False))
            if stats is not None and d:
                stats.add(r.rid, d, a, explored)
            for _ in range(1 + a):
                outputs.append(self._produce(r))
                if r.rid not in self.scripts:
                    break  # it finished
        return StepResult(
            outputs,
            shape.prefill_tokens,
            shape.decodes,
            shape.decodes + shape.chunks,
            plan.skipped,
            dt,
            dt,
            decode_ctx=shape.decode_ctx,
            prefill_ctx=shape.prefill_ctx,
            spec=stats,
        )

    def _produce(self, req: RequestState) -> TokenOutput:
        rid = req.rid
        seq, base, total, reason, fill = self.scripts[rid]
        first = not req.out
        k = base + req.prior + len(req.out)
        tok = seq[k] if k < len(seq) else fill
        req.out.append(tok)
        n_out = req.prior + len(req.out)
        finish = reason if n_out >= total else None
        if finish is not None:
            self.requests.abort(rid)
            del self.scripts[rid]
            self.verifying.pop(rid, None)
        elif first:
            self.requests.decodes(req)
        return TokenOutput(rid, tok, None, None, finish, first, len(req.prompt) - req.prior, n_out)


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
        disk: DiskModel | None = None,
        spec: Callable[[str], list[tuple[int, int, bool]]] = lambda rid: [],
        draft_tokens: int = 0,
        step_target_s: float = 0.0,
        step_costs: Costs | None = None,
    ) -> None:
        self.loop = loop
        self.model = model
        self.out_hop_s = out_hop_s
        self.runner = ScriptedRunner(budget, block_size, num_blocks, script, spec)
        # the adaptive budget, as the executor runs it: seeded as the recorded run's was (the
        # two forwards its executor timed at start), else from the model that times the
        # replay's steps; refitted on the replayed steps
        self.adaptive: AdaptiveBudget | None = None
        if budget.budget_policy == "adaptive":
            c = model.coef
            seed = step_costs or Costs(
                max(model.intercept, 1e-6),
                max(c.get("prefill_tokens", 0.0), 1e-9),
                max(c.get("decode_tokens", 0.0), 1e-9),
                c.get("decode_ctx", 0.0),
            )
            target = step_target(seed, budget.step_target_ms)
            if step_costs is None and not budget.step_target_ms:
                target = step_target_s or target  # (an older log's target, without its seed)
            self.adaptive = AdaptiveBudget(seed, budget.step_budget, target)
        io = DiskIO(lambda blocks, payloads: None, block_size) if disk is not None else None
        self.core = ExecutorCore(
            self.runner,
            lookahead_tokens,
            burst_wait_s,
            rec,
            loop.clock,
            draft_tokens=draft_tokens,
            disk=io,
        )
        self.disk = disk
        self.lanes = {"read": 0.0, "write": 0.0}  # when each disk lane is next free
        self.mailbox: deque[Any] = deque()
        self.busy = False
        self.gathering = 0  # > 0 while waiting for a burst (the wait's number)
        self.gather_t0 = 0.0
        self.waits = 0
        rec.record(
            "executor.config",
            model="(replay)",
            device="simulated",
            num_blocks=num_blocks,
            block_size=block_size,
            **dataclasses.asdict(budget),
            burst_wait_ms=burst_wait_s * 1000.0,
        )

    @property
    def steps(self) -> int:
        return self.core.steps

    def handle(self, msg: Any) -> None:
        self.mailbox.append(msg)
        if self.gathering:
            self._drain()
            if self.core.gathered():
                self._gathered(self.gathering)
        elif not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._iterate)

    # ------------------------------------------------------------------ the actor's loop
    def _drain(self) -> None:
        while self.mailbox:
            self.core.apply(self.mailbox.popleft())
            self._disk_work()
        self._flush()

    def _disk_work(self) -> None:
        """The disk tier's reads and writes, as the actor's worker threads do them (one read
        and one write at a time), each block taking the recorded run's time."""
        for work in self.core.take_disk():
            assert self.disk is not None
            if isinstance(work, DiskDrop):
                continue
            read = isinstance(work, Run)
            n = len(work.load_keys) if isinstance(work, Run) else len(work.keys)
            lane = "read" if read else "write"
            start = max(self.loop.now, self.lanes[lane])
            took = n * (self.disk.load_s if read else self.disk.write_s)
            self.lanes[lane] = start + took
            if isinstance(work, Run):
                done: Any = DiskRead(work, [b""] * n, None, took)
            else:
                done = DiskWritten(work, [], n * self.disk.block_bytes, took)
            self.loop.at(start + took, self.handle, done)

    def _flush(self) -> None:
        for peer, msg in self.core.take_outbox():
            self.loop.send(peer, msg, self.out_hop_s if peer == "tokenizer" else None)

    def _gathered(self, wait: int) -> None:
        """The burst the idle executor waited for is in (or the wait ran out): step."""
        if self.gathering != wait:
            return  # that wait already ended
        self.gathering = 0
        self.core.burst_waited(self.loop.now - self.gather_t0)
        self._iterate()

    def _iterate(self) -> None:
        idle = not self.runner.requests.has_work()
        self._drain()
        if self.core.gathers(idle):  # as the actor: wait (bounded) for the rest of a burst
            self.waits += 1
            self.gathering = wait = self.waits
            self.gather_t0 = self.loop.now
            self.loop.at(self.loop.now + self.core.burst_wait_s, self._gathered, wait)
            return
        cap = None
        table = self.runner.requests
        if self.adaptive is not None and table.prefilling:
            cap = self.adaptive.cap(*table.decode_load())
        plan = self.runner.plan(cap)
        if plan is None or not (plan.decodes or plan.chunks):
            self.busy = False  # idle, or every decode waits for a block: the next message wakes us
            return
        shape = plan.shape()
        drafts = self.runner.drafts(plan)
        dt = self.model.predict(
            shape.prefill_tokens,
            shape.decodes,
            shape.chunks,
            shape.decode_ctx,
            shape.prefill_ctx,
            sum(d for d, *_ in drafts.values()),
        )
        self.core.planned([r.rid for r in plan.completing()])
        self._flush()
        self.loop.at(self.loop.now + max(dt, 1e-6), self._step_done, plan, shape, dt, drafts, cap)

    def _step_done(
        self,
        plan: StepPlan,
        shape: StepShape,
        dt: float,
        drafts: dict[str, tuple[int, int, bool]],
        cap: int | None = None,
    ) -> None:
        result = self.runner.finish(plan, shape, dt, drafts)
        result.prefill_cap = cap
        if self.adaptive is not None:
            rows = shape.decodes + sum(d for d, *_ in drafts.values())
            if self.adaptive.observe(shape.prefill_tokens, rows, shape.decode_ctx, dt):
                result.refit = self.adaptive.costs
        self.core.stepped(result, dt, 0.0)
        self._flush()
        self._iterate()
