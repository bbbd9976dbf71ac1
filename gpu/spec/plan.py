"""Which decodes of a step verify drafts, and how many: pure, over the planned step.

A decode that speculates runs ``1 + k`` rows (its last token, then its ``k`` drafts at positions
``computed .. computed + k``). Each decode's proposal is capped by ``num_speculative_tokens``,
its block table's room (positions up to ``computed + k`` must be in it), its outputs left (a
step emits at most ``k + 1`` tokens, never past ``max_tokens`` nor ``max_model_len``) and the
step budget (draft rows count in it).

How many of the proposed drafts run is priced on the step-cost table (``gpu/spec/cost.py``):
a request's ``j``-th draft adds ``a ** j`` expected tokens, ``a`` its acceptance so far for
proposals found by a suffix of that length (``NgramTokens.accept``: drafts are kept in order,
each only if those before it were), and the
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

Estimates that say drafts do not pay are tested too (``gpu/spec/explore.py``): a request
whose acceptance is unknown or stale verifies its proposal anyway (as far as the band of rows
checked least recently), stalest first, while the exploration allowance lasts (at most a few
percent of the forward time).

What the plan says of itself (the ``executor.step`` event's ``spec_*`` fields): ``off``, why no
decode speculates this step: ``cost`` (no draft would raise the step's expected tokens per
second), ``budget`` (no step budget left), ``room`` (no block room, or one output left),
``no_match`` (no n-gram found), ``grammar`` (the grammar rejects the proposal's first token),
``no_decodes``; ``why``: that reason per decode that verifies none (``off`` too: admitted with
speculation off); ``explored``: the requests exploring; ``gain``: the kept drafts' expected
tokens and ``price_s`` what their rows are priced; ``turned_down``: the first draft not kept,
``(expected tokens, priced seconds)``, against the step's rate ``rate`` (tokens per second).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu.spec.config import SpecConfig
from gpu.spec.explore import HOPE, STEP_SHARE, Allowance, due
from gpu.spec.verify import SpecStats

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
    why: Counter[str] = field(default_factory=Counter)  # per decode verifying none, why
    explored: list[str] = field(default_factory=list)  # requests verifying as exploration
    gain: float = 0.0  # expected tokens of the drafts kept on their price (not explorations)
    price_s: float = 0.0  # the priced forward seconds those drafts add
    explore_s: float = 0.0  # and those the explorations add
    rate: float = 0.0  # the step's expected tokens per second as planned
    turned_down: tuple[float, float] | None = None  # the next draft's (tokens, seconds)

    def stats(self) -> SpecStats:
        """The step's counters, to be filled as its drafts are verified, with the plan's
        reasons as ``executor.step`` fields (``spec_why`` ... ``spec_turned_down``)."""
        down = self.turned_down
        return SpecStats(
            off=self.off,
            reasons={
                "spec_why": dict(self.why),
                "spec_gain": round(self.gain, 3),
                "spec_price_ms": round(self.price_s * 1e3, 3),
                "spec_explore_ms": round(self.explore_s * 1e3, 3),
                "spec_rate": round(self.rate, 2),
                "spec_turned_down": None
                if down is None
                else [round(down[0], 3), round(down[1] * 1e3, 3)],
            },
        )


def plan_drafts(
    decodes: list[RequestState],
    rows: int,
    cfg: SpecConfig,
    step_budget: int,
    cost: StepCost,
    block_size: int,
    max_model_len: int,
    allowance: Allowance | None = None,
) -> SpecPlan:
    """Drafts for ``decodes`` in a step that already runs ``rows`` rows; see the module doc.
    ``allowance``: what explorations may spend (None: no exploration)."""
    if not decodes:
        return SpecPlan(off="no_decodes")
    for r in decodes:
        if r.ngram is not None:
            r.ngram.since += 1
    left = step_budget - rows
    if left < 1:
        return _none(decodes, "budget")
    base = len(decodes)  # tokens the step emits without drafts
    price = _Price(cost, base, rows)
    if allowance is not None:
        allowance.earn(price.now)
    accepts = [r.ngram.best for r in decodes if r.ngram is not None]
    pays = price.may_pay(min(left, cfg.k * len(accepts)), max(accepts, default=0.0))
    stale = [r for r in decodes if r.ngram is not None and due(r.ngram.since)]
    if stale and not price.hopeful(min(left, cfg.k)):
        stale = []  # not even a copying request's drafts would pay: nothing to find out
    if not pays and (allowance is None or not stale):
        return _none(decodes, "cost")
    plan = SpecPlan(rate=price.bar)
    looked = decodes if pays else stale  # (the others: no draft of theirs would pay)
    proposals = _proposals(looked, cfg, left, block_size, max_model_len, plan)
    counts: Counter[int] = Counter()
    if pays and proposals:
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
        counts.update(n for _, n, _ in gains[:keep])
        plan.gain = -sum(g for g, _, _ in gains[:keep])
        plan.price_s = price.added(keep)
        plan.rate = best
        if keep < len(gains):
            plan.turned_down = (-gains[keep][0], price.added(keep + 1) - plan.price_s)
    for n, (req, drafts, _) in enumerate(proposals):
        if counts[n]:
            plan.drafts[req.rid] = drafts[: counts[n]]
    if allowance is not None:
        _explore(proposals, plan, price, left, allowance)
    if pays:
        if lost := sum(req.rid not in plan.drafts for req, _, _ in proposals):
            plan.why["cost"] += lost
    else:  # no draft would pay: that is why, whatever else the explorations' lookups found
        plan.why = Counter({"cost": n} if (n := len(decodes) - len(plan.explored)) else {})
    if not plan.drafts:
        plan.off = plan.why.most_common(1)[0][0]
    return plan


def _none(decodes: list[RequestState], why: str) -> SpecPlan:
    return SpecPlan(off=why, why=Counter({why: len(decodes)}))


def _proposals(
    decodes: list[RequestState],
    cfg: SpecConfig,
    left: int,
    block_size: int,
    max_model_len: int,
    plan: SpecPlan,
) -> list[tuple[RequestState, list[int], float]]:
    """``(request, drafts, acceptance)`` of each decode with a proposal; the others' reasons
    go to ``plan.why``."""
    out = []
    for req in decodes:
        if req.ngram is None:  # admitted with speculation off
            plan.why["off"] += 1
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
            plan.why["room"] += 1
            continue
        drafts = req.ngram.propose(cap, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if not drafts:
            plan.why["no_match"] += 1
            continue
        if req.grammar is not None:  # verified only as far as the grammar takes them
            drafts = drafts[: req.grammar.matcher.validate_tokens(drafts)]
            if not drafts:
                plan.why["grammar"] += 1
                continue
        out.append((req, drafts, req.ngram.accept))
    return out


def _explore(
    proposals: list[tuple[RequestState, list[int], float]],
    plan: SpecPlan,
    price: _Price,
    left: int,
    allowance: Allowance,
) -> None:
    """Give the due requests that verify nothing their proposal, stalest first, while
    the step budget and the allowance last, and past the first, while the explorations add at
    most ``STEP_SHARE`` to the step's priced time (``gpu/spec/explore.py``)."""

    def since(p: tuple[RequestState, list[int], float]) -> int:
        return p[0].ngram.since if p[0].ngram is not None else 0  # (a proposal has one)

    used = sum(len(d) for d in plan.drafts.values())
    due_now = [p for p in proposals if p[0].rid not in plan.drafts and due(since(p))]
    for req, drafts, _ in sorted(due_now, key=since, reverse=True):
        if used + len(drafts) > left:
            continue
        rows = price.rows + used  # as many drafts as reach the least recently checked band
        drafts = drafts[: price.cost.stalest(rows + 1, rows + len(drafts)) - rows]
        extra = price.added(used + len(drafts)) - price.added(used)
        if plan.explored and plan.explore_s + extra > STEP_SHARE * price.now:
            break
        if not allowance.spend(extra):
            break
        plan.drafts[req.rid] = drafts
        plan.explored.append(req.rid)
        plan.explore_s += extra
        used += len(drafts)


class _Price:
    """The decodes' expected tokens per second with ``d`` drafts: ``tokens / (cost(base) +
    DRAFT_PRICE * (cost(rows + d) - cost(rows)))`` (``base`` decodes in a step of ``rows``
    rows)."""

    def __init__(self, cost: StepCost, base: int, rows: int) -> None:
        self.cost, self.base, self.rows = cost, base, rows
        self.now = cost(rows)
        self.decodes = cost(base) if base != rows else self.now
        self.bar = self.rate(0, base)  # the rate drafts must beat

    def added(self, d: int) -> float:
        """The table's seconds that ``d`` draft rows add to the step."""
        return self.cost(self.rows + d) - self.now if d else 0.0

    def rate(self, d: int, tokens: float, scale: float = DRAFT_PRICE) -> float:
        """Tokens per second with ``d`` draft rows, each priced ``scale`` times the table."""
        if not d:
            return tokens / self.decodes
        return tokens / (self.decodes + scale * self.added(d))

    def hopeful(self, most: int) -> bool:
        """Whether up to ``most`` drafts of a request that copies (each kept with chance
        :data:`~gpu.spec.explore.HOPE`) would raise the rate at the table's own price."""
        return any(
            self.rate(d, self.base + sum(HOPE**j for j in range(1, d + 1)), 1.0) > self.bar
            for d in range(1, most + 1)
        )

    def may_pay(self, most: int, accept: float, scale: float = DRAFT_PRICE) -> bool:
        """Whether some number of drafts, up to ``most``, each kept with chance ``accept`` at
        best, could raise the rate (their rows priced ``scale`` times the table); checked where
        the cost table bends (between those points the rate moves one way), so a large batch is
        turned away before any proposal is looked up."""
        bends = {r + e - self.rows for r in self.cost.rows for e in (0, 1)}  # band edges too
        ds = {1, most} | {d for d in bends if 1 <= d <= most}
        return any(self.rate(d, self.base + d * accept, scale) > self.bar for d in ds)
