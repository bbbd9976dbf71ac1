"""Step time as a function of the step's shape, fitted from a run's ``step`` events.

One executor cycle (``step_s + control_s``: planning, the forward, sampling, publishing) is
modelled as a linear function of the step's shape:

    t = c0 + c1 * prefill_tokens + c2 * decode_tokens + c3 * prefill_chunks
           + c4 * decode_ctx + c5 * prefill_ctx + c6 * spec_draft_tokens

``decode_ctx`` is the sum of the decodes' context lengths (keys read by decode attention) and
``prefill_ctx`` the sum over prefill chunks of ``chunk * (start + chunk)`` (query-key pairs of
prefill attention); logs without those fields are fitted without them. ``spec_draft_tokens``:
the draft rows speculative decoding verified in the step (0 without speculation). Non-negative least
squares (every coefficient >= 0, Lawson-Hanson), reweighted on relative residuals (Huber) so
that outlying steps (a kernel built on first use, the machine busy with something else) count
less; steps past 5 robust deviations are reported as outliers. The typical step of each shape is then
scaled by the ratio of the measured to the fitted total time (steps past ``SCALE_Z`` robust
deviations, stalls, left out), so that a replay takes about as long as the run did on a machine
as busy as it was. The fit reports R^2 and percentiles of the relative error, and is
stored as JSON (``minirt replay --fit``) so one machine's fit can replay another run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actors.shared.stepfit import robust_fit

FEATURES = (
    "prefill_tokens",
    "decode_tokens",
    "prefill_chunks",
    "decode_ctx",
    "prefill_ctx",
    "spec_draft_tokens",
)
OPTIONAL = ("decode_ctx", "prefill_ctx")
FILENAME = "stepmodel.json"
SCALE_Z = 50.0  # steps past this many robust deviations (stalls) stay out of the scale


def features(e: dict[str, Any]) -> list[float]:
    """The feature vector of one ``step`` event (missing optional fields count as 0)."""
    dec = float(e.get("decode_tokens", 0))
    return [
        float(e.get("prefill_tokens", 0)),
        dec,
        float(e.get("requests", 0)) - dec,
        float(e.get("decode_ctx", 0)),
        float(e.get("prefill_ctx", 0)),
        float(e.get("spec_draft_tokens", 0)),
    ]


@dataclass
class StepModel:
    intercept: float
    coef: dict[str, float]
    n: int = 0
    outliers: int = 0
    r2: float = 0.0
    rel_err_p50: float = 0.0
    rel_err_p90: float = 0.0
    rel_err_p99: float = 0.0
    total_bias: float = 0.0  # sum(predicted) / sum(measured) - 1
    contention: float = 1.0  # the mean step over the typical one (the fit is scaled by it)
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def predict(
        self,
        prefill_tokens: float,
        decode_tokens: float,
        prefill_chunks: float,
        decode_ctx: float,
        prefill_ctx: float,
        spec_draft_tokens: float = 0.0,
    ) -> float:
        c = self.coef
        return (
            self.intercept
            + c.get("prefill_tokens", 0.0) * prefill_tokens
            + c.get("decode_tokens", 0.0) * decode_tokens
            + c.get("prefill_chunks", 0.0) * prefill_chunks
            + c.get("decode_ctx", 0.0) * decode_ctx
            + c.get("prefill_ctx", 0.0) * prefill_ctx
            + c.get("spec_draft_tokens", 0.0) * spec_draft_tokens
        )

    def summary(self) -> str:
        terms = " + ".join(f"{v:.3g}*{k}" for k, v in self.coef.items() if v)
        return (
            f"step_s = {self.intercept:.3g} + {terms or '0'}\n"
            f"fit on {self.n} steps ({self.outliers} outliers): R^2 {self.r2:.3f}, "
            f"relative error p50 {self.rel_err_p50:.1%} p90 {self.rel_err_p90:.1%} "
            f"p99 {self.rel_err_p99:.1%}, total time {self.total_bias:+.1%} "
            f"(mean over typical step: x{self.contention:.2f})"
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        if p.is_dir():
            p = p / FILENAME
        p.write_text(json.dumps(asdict(self), indent=1))
        return p

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        p = Path(path)
        if p.is_dir():
            p = p / FILENAME
        data = json.loads(p.read_text())
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"{p}: not a step model ({e})") from None


def fit_runs(runs: list[list[dict[str, Any]]], source: str = "") -> StepModel:
    """One model fitted on the pooled steps of several runs of one model on one machine."""
    return fit([e for steps in runs for e in steps], source)


def fit(steps: list[dict[str, Any]], source: str = "") -> StepModel:
    """Fit the model to ``step`` events (each needs ``step_s``; ``control_s`` is added)."""
    rows = [e for e in steps if e.get("event") in (None, "step", "executor.step") and "step_s" in e]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 step events to fit a step-time model, got {len(rows)}")
    x = np.array([features(e) for e in rows], dtype=float)
    y = np.array([e["step_s"] + e.get("control_s", 0.0) for e in rows], dtype=float)
    notes = []
    for name in OPTIONAL:
        if not any(name in e for e in rows):
            notes.append(f"the log's step events have no {name}: fitted without it")
    a = np.column_stack([np.ones(len(y)), x])
    sol, z = robust_fit(a, y)
    if sol[2] == 0 and x[:, 1].mean() > 0:
        notes.append(
            "the fit finds no per-decode cost: this log's steps cannot tell it from the per-step "
            "cost (every step decodes about as many requests); replays that change the batch "
            "size need a fit pooled with a run of varied batches (--fit --fit-also RUN)"
        )
    # The robust fit is the typical step of each shape; contention with other processes makes
    # steps slower on average, never faster, and a replay should take as long as the run did:
    # scale the fit so its total is the measured total, stalls aside (a stall is one step's bad
    # luck; spread over every step it would slow all of them).
    keep = np.abs(z) <= SCALE_Z
    scale = float(y[keep].sum() / max((a @ sol)[keep].sum(), 1e-12)) if keep.any() else 1.0
    sol = sol * scale
    b0, coef = float(sol[0]), {i: float(v) for i, v in enumerate(sol[1:])}
    pred = a @ sol
    pred = np.maximum(pred, 1e-9)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    return StepModel(
        intercept=b0,
        coef={FEATURES[i]: coef.get(i, 0.0) for i in range(len(FEATURES))},
        n=len(y),
        outliers=int((np.abs(z) > 5).sum()),
        contention=scale,
        r2=r2,
        rel_err_p50=float(np.percentile(rel, 50)),
        rel_err_p90=float(np.percentile(rel, 90)),
        rel_err_p99=float(np.percentile(rel, 99)),
        total_bias=float(pred.sum() / y.sum() - 1) if y.sum() else 0.0,
        source=source,
        notes=notes,
    )
