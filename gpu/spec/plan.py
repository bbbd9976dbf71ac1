"""Which decodes of a step verify drafts, and how many: pure, over the planned step.

A decode that speculates runs ``1 + k`` rows (its last token, then its ``k`` drafts at positions
``computed .. computed + k``). ``k`` is its proposal's length, capped by:

- ``num_speculative_tokens``;
- its block table's room: positions up to ``computed + k`` must be in it;
- its outputs left: a step emits at most ``k + 1`` tokens, never past ``max_tokens`` nor
  ``max_model_len``;
- the step's rows: draft rows count in ``step_budget`` and stop at the cost model's
  ``cheap_rows`` (``gpu/spec/cost.py``), decodes first come first served.

A request speculates only when its sampling is exact under verification (``NgramTokens`` held;
``gpu/executor.py`` decides at admission): no penalty (which would have to see the drafts before
each row); ``logit_bias``, ``min_tokens`` and logprobs are exact and allowed. A constrained
request (structured output, required tool calls) drafts only the tokens its grammar accepts (the
proposal is cut at the first it rejects), and each of its rows is masked as the grammar stands
after the drafts before it (``gpu/structured/masks.py``), so its targets are the tokens it
would emit without speculation.

``off``: why no decode speculates this step: ``batch`` (the step's rows already reach
``cheap_rows``), ``budget`` (no step budget left), ``params`` (penalties), ``room`` (no block
room, or one output left), ``no_match`` (no n-gram found), ``grammar`` (the grammar rejects the
proposal's first token), ``no_decodes``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu.spec.config import SpecConfig

if TYPE_CHECKING:
    from gpu.requests import RequestState


@dataclass
class SpecPlan:
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> its drafts
    off: str | None = None  # why no decode speculates (None: some do)


def plan_drafts(
    decodes: list[RequestState],
    rows: int,
    cfg: SpecConfig,
    step_budget: int,
    cheap_rows: int,
    block_size: int,
    max_model_len: int,
) -> SpecPlan:
    """Drafts for ``decodes`` in a step that already runs ``rows`` rows; see the module doc."""
    if not decodes:
        return SpecPlan(off="no_decodes")
    if rows >= cheap_rows:
        return SpecPlan(off="batch")
    left = min(cheap_rows, step_budget) - rows
    if left < 1:
        return SpecPlan(off="budget")
    plan = SpecPlan()
    why: Counter[str] = Counter()
    for req in decodes:
        if left < 1:
            why["batch"] += 1
            break
        if req.ngram is None:
            why["params"] += 1
            continue
        total = len(req.prompt) + len(req.out)
        cap = min(
            req.ngram.k or cfg.k,
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
        plan.drafts[req.rid] = drafts
        left -= len(drafts)
    if not plan.drafts:
        plan.off = why.most_common(1)[0][0]
    return plan
