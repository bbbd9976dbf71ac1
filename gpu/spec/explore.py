"""Drafts the planner verifies although its estimates say they do not pay: exploration.

The planner (``gpu/spec/plan.py``) prices drafts on two estimates: each request's acceptance so
far and the step-cost table. An estimate that says "drafts do not pay" is never tested again if
it alone decides: a request whose prior acceptance (a third) is too low to draft would never
show that it copies its prompt, and a table timed while another process was starting (two
servers side by side) would keep pricing the rows it overcharges, since only served steps
correct a band (``StepCost.observe``) and no step runs in a band priced out.

So a request is *due* when its acceptance is unknown (it never verified a draft) or stale
(:data:`STALE_STEPS` of its decode steps since it last did): the planner verifies its
proposal, stalest request first, while the :class:`Allowance` lasts, cut to as many drafts as
bring the step into the band of rows that served steps checked least recently
(``StepCost.stalest``; the whole proposal while none is checked). That step is served: its time
checks the table in that band, and the request's acceptance is measured. So every band a
proposal can reach is checked in turn, whether or not the planner would choose it.

What it costs when drafts do not pay is bounded by the allowance: a budget of forward time
that each step fills with :data:`SHARE` of its own priced cost and each exploration spends by
the priced cost of its draft rows, holding at most :data:`HOLD_STEPS` steps' worth (so a burst
of fresh requests does not explore all at once: past the first, a step's explorations add at
most :data:`STEP_SHARE` of its priced time). So
explorations take at most :data:`SHARE` of the forward time whatever the batch (at one request
on SmolLM2, one in ~6 steps at most; a request explores again only once stale). When drafts pay, the planner drafts on its own and the request is no
longer due. Where even a copying request's drafts would not pay (:data:`HOPE`, at the table's
own price: a large batch, whose every row is arithmetic), nothing explores: there the share was
lost for nothing (batch 32: 0.94x the server without speculation; docs/benchmarks/spec-decode).
"""

from __future__ import annotations

import math

SHARE = 0.04  # of forward time explorations may take when no draft pays
STALE_STEPS = 16  # a request's decode steps without a verification before it is due again
HOLD_STEPS = 64  # the allowance holds at most this many steps' share
STEP_SHARE = 0.25  # past its first, a step's explorations add at most this share of its time
# explorations run only where the drafts of a request that copies its prompt (each kept with
# this chance; grounded prompts keep 70-90%) would pay at the table's own price
HOPE = 0.8


class Allowance:
    """The forward time explorations may still spend (seconds, priced on the cost table); it
    starts full, so the first requests are measured at once."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left: float | None = None

    def earn(self, step_cost: float) -> None:
        """A step priced ``step_cost`` seconds runs: add its share, up to the hold."""
        if not math.isfinite(step_cost):  # a step past --spec-max-rows: no drafts at all
            return
        hold = HOLD_STEPS * SHARE * step_cost
        self.left = hold if self.left is None else min(self.left + SHARE * step_cost, hold)

    def spend(self, cost: float) -> bool:
        """Take ``cost`` seconds for one exploration if they are left."""
        if self.left is None or not cost <= self.left:  # (an infinite or undefined price too)
            return False
        self.left -= cost
        return True


def due(since: int) -> bool:
    """Whether a request ``since`` decode steps past its last verification (never: at least
    :data:`STALE_STEPS`) should explore."""
    return since >= STALE_STEPS
