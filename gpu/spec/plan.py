"""Which decodes of a step verify drafts, and how many: pure, over the planned step.

A decode that speculates runs ``1 + k`` rows (its last token, then its ``k`` drafts at positions
``computed .. computed + k``). Each decode's proposal is capped by ``num_speculative_tokens``,
its block table's room (positions up to ``computed + k`` must be in it), its outputs left (a
step emits at most ``k + 1`` tokens, never past ``max_tokens`` nor ``max_model_len``) and the
step budget (draft rows count in it).

How many of the proposed drafts run is priced on the step-cost table (``gpu/spec/cost.py``):
a request's ``j``-th draft adds ``a ** j`` expected tokens, ``a`` its acceptance so far
(``NgramTokens.accept``: drafts are kept in order, each only if those before it were), and the
step keeps the ``D`` drafts of most expected tokens for the ``D`` that makes ``(decodes +
expected drafts kept) / (cost(decodes) + DRAFT_PRICE * (cost(rows + D) - cost(rows)))``
largest: drafts run only where they raise the decodes' expected tokens per second, their rows
priced at ``DRAFT_PRICE`` times the table's. A step's prompt rows are work to be done anyway:
they set what the drafts' rows cost, they do not dilute the rate the drafts must beat. So a
lone request on a CPU drafts long (rows 5 to 10 cost about what 5 do), and a large batch,
whose every row costs arithmetic, drafts only what is nearly sure, or nothing.

Every request may speculate: a draft row samples what the request would sample there without
speculation, its penalties counting the drafts before it (``gpu/logits_processors.py``),
``logit_bias`` and ``min_tokens`` at its output index, its logprobs its own. A constrained
request (structured output, required tool calls) drafts only the tokens its grammar accepts (the
proposal is cut at the first it rejects), and each of its rows is masked as the grammar stands
after the drafts before it (``gpu/structured/masks.py``), so its targets are the tokens it
would emit without speculation.

``off``: why no decode speculates this step: ``cost`` (no draft would raise the step's expected
tokens per second), ``budget`` (no step budget left), ``room`` (no block room, or one output
left), ``no_match`` (no n-gram found), ``grammar`` (the grammar rejects the
proposal's first token), ``no_decodes``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu.spec.config import SpecConfig

# draft rows' price in times the table's (``gpu/spec/cost.py``, timed on forwards alone): at the
# table's price large batches lost to their drafts (docs/benchmarks/spec-decode/README.md)
DRAFT_PRICE = 1.5

if TYPE_CHECKING:
    from gpu.requests import RequestState
    from gpu.spec.cost import StepCost


@dataclass
class SpecPlan:
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> its drafts
    off: str | None = None  # why no decode speculates (None: some do)


def plan_drafts(
    decodes: list[RequestState],
    rows: int,
    cfg: SpecConfig,
    step_budget: int,
    cost: StepCost,
    block_size: int,
    max_model_len: int,
) -> SpecPlan:
    """Drafts for ``decodes`` in a step that already runs ``rows`` rows; see the module doc."""
    if not decodes:
        return SpecPlan(off="no_decodes")
    left = step_budget - rows
    if left < 1:
        return SpecPlan(off="budget")
    base = len(decodes)  # tokens the step emits without drafts
    accepts = [r.ngram.accept for r in decodes if r.ngram is not None]
    price = _Price(cost, base, rows)
    if not price.may_pay(min(left, cfg.k * len(accepts)), max(accepts, default=0.0)):
        return SpecPlan(off="cost")
    why: Counter[str] = Counter()
    proposals: list[tuple[RequestState, list[int], float]] = []
    for req in decodes:
        if req.ngram is None:  # admitted with speculation off
            continue
        total = len(req.prompt) + len(req.out)
        cap = min(
            cfg.k,
            left,
            len(req.table) * block_size - req.computed - 1,
            req.params.max_tokens - req.prior - len(req.out) - 1,
            max_model_len - total - 1,
        )
        if cap < 1:
            why["room"] += 1
            continue
        drafts = req.ngram.propose(cap, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if not drafts:
            why["no_match"] += 1
            continue
        if req.grammar is not None:  # verified only as far as the grammar takes them
            drafts = drafts[: req.grammar.matcher.validate_tokens(drafts)]
            if not drafts:
                why["grammar"] += 1
                continue
        proposals.append((req, drafts, req.ngram.accept))
    plan = SpecPlan()
    if not proposals:
        plan.off = why.most_common(1)[0][0]
        return plan
    # each draft's expected tokens: a ** j for the j-th of a request (a: its acceptance)
    gains = sorted(
        (-(a**j), n, j)
        for n, (_, drafts, a) in enumerate(proposals)
        for j in range(1, len(drafts) + 1)
    )[:left]
    best, keep, got = price.bar, 0, float(base)
    for d, (g, _, _) in enumerate(gains, 1):
        got -= g
        if (v := price.rate(d, got)) > best:
            best, keep = v, d
    if not keep:
        plan.off = "cost"
        return plan
    counts = Counter(n for _, n, _ in gains[:keep])
    for n, (req, drafts, _) in enumerate(proposals):
        if counts[n]:
            plan.drafts[req.rid] = drafts[: counts[n]]
    return plan


class _Price:
    """The decodes' expected tokens per second with ``d`` drafts: ``tokens / (cost(base) +
    DRAFT_PRICE * (cost(rows + d) - cost(rows)))`` (``base`` decodes in a step of ``rows``
    rows)."""

    def __init__(self, cost: StepCost, base: int, rows: int) -> None:
        self.cost, self.base, self.rows = cost, base, rows
        self.now = cost(rows)
        self.decodes = cost(base) if base != rows else self.now
        self.bar = self.rate(0, base)  # the rate drafts must beat

    def rate(self, d: int, tokens: float) -> float:
        if not d:
            return tokens / self.decodes
        return tokens / (self.decodes + DRAFT_PRICE * (self.cost(self.rows + d) - self.now))

    def may_pay(self, most: int, accept: float) -> bool:
        """Whether some number of drafts, up to ``most``, each kept with chance ``accept`` at
        best, could raise the rate; checked where the cost table bends (between those points
        the rate moves one way), so a large batch is turned away before any proposal is looked
        up."""
        bends = {r + e - self.rows for r in self.cost.rows for e in (0, 1)}  # band edges too
        ds = {1, most} | {d for d in bends if 1 <= d <= most}
        return any(self.rate(d, self.base + d * accept) > self.bar for d in ds)
