"""The requests an executor holds: prefilling (prompt not yet all computed) and decoding, by id.

What the executor core asks of any runner (``gpu/core.py``): whether there is work, how much, a
request's block table and what it can hold; the real ``ModelRunner`` and the replay's stand-in
(``minirt/replay/execsim.py``) keep their requests in one of these, and plan steps over it.
"""

from __future__ import annotations

from actors.shared.reservation import kv_tokens_at_most
from gpu.requests import ExecutorInputError, RequestState
from gpu.step.plan import StepBudget, StepPlan, fills_a_step, plan_step


class RequestTable:
    def __init__(
        self, budget: StepBudget, block_size: int, num_blocks: int, max_model_len: int
    ) -> None:
        self.budget = budget
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.prefilling: dict[str, RequestState] = {}
        self.decoding: dict[str, RequestState] = {}
        self.max_loras = 0  # LoRA adapters in one step at most (--max-loras; 0: none served)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.prefilling or request_id in self.decoding

    def get(self, request_id: str) -> RequestState:
        """The request in flight (KeyError if none)."""
        return self.prefilling.get(request_id) or self.decoding[request_id]

    def add(self, req: RequestState) -> None:
        self.prefilling[req.rid] = req

    def extend(self, request_id: str, new_blocks: list[int]) -> None:
        """Append ``new_blocks`` to the request's block table. Raises ExecutorInputError."""
        req = self.prefilling.get(request_id) or self.decoding.get(request_id)
        if req is None:
            raise ExecutorInputError(request_id, "request_id", "no such request in flight")
        blocks = list(new_blocks)
        if blocks and not (min(blocks) >= 0 and max(blocks) < self.num_blocks):
            raise ExecutorInputError(
                request_id, "new_blocks", f"block ids must be in [0, {self.num_blocks})"
            )
        req.table.extend(blocks)

    def abort(self, request_id: str) -> bool:
        """Forget the request (abort, preemption, end); True if it was in flight."""
        found = self.prefilling.pop(request_id, None) or self.decoding.pop(request_id, None)
        return found is not None

    def decodes(self, req: RequestState) -> None:
        """``req`` produced its first output: it decodes from now on."""
        del self.prefilling[req.rid]
        self.decoding[req.rid] = req

    def loras_in_use(self) -> set[str]:
        """The LoRA adapters (digests) the requests in flight run with."""
        reqs = (*self.prefilling.values(), *self.decoding.values())
        return {r.lora.key for r in reqs if r.lora is not None}

    def has_work(self) -> bool:
        return bool(self.prefilling or self.decoding)

    def num_requests(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def fills_a_step(self) -> bool:
        """Whether the requests held fill one step (``gpu.step.plan.fills_a_step``)."""
        return fills_a_step(self.prefilling.values(), self.num_requests(), self.budget)

    def plan(self, prefill_cap: int | None = None) -> StepPlan:
        return plan_step(
            self.decoding.values(),
            self.prefilling.values(),
            self.budget,
            self.block_size,
            prefill_cap,
            self.max_loras,
        )

    def decode_load(self) -> tuple[int, int]:
        """What the next step's decodes are: rows (at most the batch size) and the keys their
        attention reads (the adaptive budget prices them)."""
        rows = min(len(self.decoding), self.budget.max_batch_size)
        return rows, sum(r.computed for r in self.decoding.values())

    def capacity(self, request_id: str) -> int:
        """Tokens the request's block table can hold (KeyError if not in flight). O(1)."""
        return len(self.get(request_id).table) * self.block_size

    def kv_tokens_at_most(self, request_id: str) -> int:
        """The most tokens of K/V the request will ever hold (``reservation.kv_tokens_at_most``;
        KeyError if not in flight). O(1)."""
        req = self.get(request_id)
        return kv_tokens_at_most(
            len(req.prompt), req.params.max_tokens - req.prior, self.max_model_len
        )

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (KeyError if not in flight)."""
        return list(self.get(request_id).table)
