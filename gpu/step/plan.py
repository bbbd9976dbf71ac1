"""Which tokens go into the next forward: the per-step budget policy, pure and synchronous.

``plan_step`` picks decodes (one token per running request) and prefill chunks of
``min(step budget left, chunk cap, prompt left)`` tokens, under ``max_batch_size`` requests and
``step_budget`` tokens in all. Knobs:

- ``decode_first`` (default): decodes are scheduled before prefill chunks, so a burst of long
  prompts cannot stall token streaming (lower TPOT/ITL); ``False`` puts prefill first (lower TTFT
  for new requests, at the cost of decode latency).
- ``long_prefill_threshold`` / ``max_long_prefills``: a prompt longer than the threshold is
  *long*; at most ``max_long_prefills`` long prompts get a chunk in one step, so short prompts
  behind them are not blocked (0 disables the rule).

A decode whose block table has no room for its next token is skipped this step (reported), never
waited on. Nothing is mutated; the caller applies the plan.

``fills_a_step`` / ``burst_end``: how long an idle executor waits for a burst being admitted
(``x_run.more``) before its first step: until the burst is in, the step's budget is full, or
``burst_wait_ms`` runs out (the actor and the replay's simulated executor share them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu.requests import RequestState


@dataclass(frozen=True)
class StepBudget:
    step_budget: int = 8192
    chunk_cap: int = 1024
    max_batch_size: int = 256
    long_prefill_threshold: int = 0
    max_long_prefills: int = 1
    decode_first: bool = True
    budget_policy: str = "fixed"  # or adaptive: a cap on each step's prefill (gpu/step/budget.py)
    step_target_ms: float = 0.0  # adaptive: the step time to keep to (0: from the start's model)

    def check(self) -> None:
        if min(self.step_budget, self.chunk_cap, self.max_batch_size) < 1:
            raise ValueError("chunk_cap, step_budget, max_batch_size must be >= 1")
        if self.budget_policy not in ("fixed", "adaptive"):
            raise ValueError(f"budget_policy must be fixed or adaptive, not {self.budget_policy!r}")
        if self.step_target_ms < 0:
            raise ValueError("step_target_ms must be >= 0")
        if self.long_prefill_threshold < 0 or self.max_long_prefills < 1:
            raise ValueError("long_prefill_threshold must be >= 0 and max_long_prefills >= 1")


@dataclass(frozen=True)
class StepShape:
    """A planned step's size, what step-time models fit on: prompt tokens, decode rows, prefill
    chunks, the keys the decodes' attention reads (``decode_ctx``) and the chunks' attention
    work (``prefill_ctx``: sum of chunk x (start + chunk))."""

    prefill_tokens: int
    decodes: int
    chunks: int
    decode_ctx: int
    prefill_ctx: int


@dataclass
class StepPlan:
    decodes: list[RequestState]
    chunks: list[tuple[RequestState, int]]
    skipped: list[str]

    def shape(self) -> StepShape:
        """The step's size (before the step is applied)."""
        return StepShape(
            sum(c for _, c in self.chunks),
            len(self.decodes),
            len(self.chunks),
            sum(r.computed for r in self.decodes),
            sum(c * (r.computed + c) for r, c in self.chunks),
        )

    def completing(self) -> list[RequestState]:
        """The requests whose prompt this step's chunks complete (before the step is applied)."""
        return [r for r, c in self.chunks if r.computed + c == len(r.prompt)]


def plan_step(
    decoding: Iterable[RequestState],
    prefilling: Iterable[RequestState],
    b: StepBudget,
    block_size: int,
    prefill_cap: int | None = None,
    max_loras: int = 0,
) -> StepPlan:
    """``prefill_cap``: prompt tokens this step may prefill at most (the adaptive budget,
    ``gpu/step/budget.py``); None: as many as the step budget leaves. ``max_loras``: LoRA
    adapters in one step at most (``--max-loras``; 0: no adapters served): a request of another
    adapter waits for a later step."""
    plan = StepPlan([], [], [])
    budget = b.step_budget
    prefill_left = b.step_budget if prefill_cap is None else prefill_cap
    loras: set[str] = set()

    def fits(req: RequestState) -> bool:
        a = req.lora
        if a is None or a.key in loras:
            return True
        if len(loras) >= max_loras:
            return False
        loras.add(a.key)
        return True

    def add_decodes() -> None:
        nonlocal budget
        for req in decoding:
            if len(plan.decodes) + len(plan.chunks) >= b.max_batch_size or budget < 1:
                break
            if req.computed >= len(req.table) * block_size:
                plan.skipped.append(req.rid)
                continue
            if not fits(req):
                continue
            plan.decodes.append(req)
            budget -= 1

    def add_chunks() -> None:
        nonlocal budget, prefill_left
        longs = 0
        for req in prefilling:
            if len(plan.decodes) + len(plan.chunks) >= b.max_batch_size:
                break
            if budget < 1 or prefill_left < 1:
                break
            if not fits(req):
                continue
            if b.long_prefill_threshold and len(req.prompt) > b.long_prefill_threshold:
                if longs >= b.max_long_prefills:
                    continue  # let shorter prompts behind it in
                longs += 1
            c = min(budget, prefill_left, b.chunk_cap, len(req.prompt) - req.computed)
            plan.chunks.append((req, c))
            budget -= c
            prefill_left -= c

    if b.decode_first:
        add_decodes()
        add_chunks()
    else:
        add_chunks()
        add_decodes()
    return plan


def fills_a_step(prefilling: Iterable[RequestState], num_requests: int, budget: StepBudget) -> bool:
    """Whether the requests held fill one step: ``max_batch_size`` of them, or prompt tokens
    still to prefill of at least ``step_budget``."""
    if num_requests >= budget.max_batch_size:
        return True
    return sum(len(r.prompt) - r.computed for r in prefilling) >= budget.step_budget


def burst_end(more_coming: bool, full: bool) -> str:
    """Why a wait for a burst ended (``executor.burst_waited``'s ``ended``)."""
    return "step_full" if full else ("timeout" if more_coming else "burst_in")
