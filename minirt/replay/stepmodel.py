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
from gpu.step.budget import Costs

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
TIED_SPREAD = 4.0  # decode steps' highest/lowest rows below which the per-row cost is tied
SCALE_Z = 50.0
KINDS = (
    "prefill",
    "mixed",
    "decode",
)  # steps past this many robust deviations (stalls) stay out of the scale


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


def kind(e: dict[str, Any]) -> str:
    """A step's kind: ``prefill`` (prompt tokens only), ``decode`` (decode rows only) or
    ``mixed``."""
    p, d = e.get("prefill_tokens", 0) > 0, e.get("decode_tokens", 0) > 0
    return "mixed" if p and d else ("prefill" if p else "decode")


def step_time(e: dict[str, Any]) -> float:
    """One executor cycle of a step event: the step and the control work around it."""
    return float(e["step_s"] + e.get("control_s", 0.0))


def kinds_of(steps: list[dict[str, Any]], model: StepModel | None = None) -> dict[str, dict]:
    """Per step kind: how many steps, their median time, and (given ``model``) the model's
    median relative error on them and its total over theirs (``bias``: +0.1 = 10% slow)."""
    out: dict[str, dict] = {}
    for k in KINDS:
        got = [e for e in steps if "step_s" in e and kind(e) == k]
        if not got:
            continue
        t = np.array([step_time(e) for e in got])
        row: dict[str, Any] = {"steps": len(got), "p50_ms": float(np.median(t)) * 1e3}
        if model is not None:
            pred = np.array([model.predict(*features(e)) for e in got])
            row["rel_err_p50"] = float(np.median(np.abs(pred - t) / np.maximum(t, 1e-9)))
            row["bias"] = float(pred.sum() / max(t.sum(), 1e-12) - 1)
        out[k] = row
    return out


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
    kinds: dict[str, dict] = field(default_factory=dict)  # its error on each kind of step

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
            + "".join(
                f"\n  {k} steps: {v['steps']}, median {v['p50_ms']:.1f} ms, model off by "
                f"{v['rel_err_p50']:.1%} (median), {v['bias']:+.1%} in total"
                for k, v in self.kinds.items()
                if "bias" in v
            )
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


def fit_runs(
    runs: list[list[dict[str, Any]]], source: str = "", seed: Costs | None = None
) -> StepModel:
    """One model fitted on the pooled steps of several runs of one model on one machine."""
    return fit([e for steps in runs for e in steps], source, seed)


def decode_spread(x: np.ndarray) -> float:
    """How much the decode steps' row counts vary: their 90th percentile over their 10th (1: all
    alike; 0: no decode-only steps)."""
    rows = x[(x[:, 0] == 0) & (x[:, 1] > 0), 1]
    return float(np.percentile(rows, 90) / np.percentile(rows, 10)) if len(rows) else 0.0


def fit(steps: list[dict[str, Any]], source: str = "", seed: Costs | None = None) -> StepModel:
    """Fit the model to ``step`` events (each needs ``step_s``; ``control_s`` is added).

    ``seed``: the run's start-time model (``executor.config``'s ``step_costs``, two forwards its
    executor timed). When the decode steps all decode about as many rows (``TIED_SPREAD``), the
    log cannot tell the per-row cost from the per-step cost; then they are tied in the ratio the
    seed timed (one scale fitted), so a replay at another batch size prices its steps right."""
    rows = [e for e in steps if e.get("event") in (None, "step", "executor.step") and "step_s" in e]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 step events to fit a step-time model, got {len(rows)}")
    x = np.array([features(e) for e in rows], dtype=float)
    y = np.array([step_time(e) for e in rows], dtype=float)
    notes = []
    for name in OPTIONAL:
        if not any(name in e for e in rows):
            notes.append(f"the log's step events have no {name}: fitted without it")
    a = np.column_stack([np.ones(len(y)), x])
    spread = decode_spread(x)
    tied = seed is not None and seed.c0 > 0 and x[:, 1].mean() > 0 and spread < TIED_SPREAD
    if tied:
        assert seed is not None
        ratio = seed.decode / seed.c0
        sol, z = robust_fit(np.column_stack([1 + ratio * x[:, 1], x[:, [0, *range(2, 6)]]]), y)
        sol = np.array([sol[0], sol[1], sol[0] * ratio, *sol[2:]])
        notes.append(
            f"the log's decode steps decode about as many rows each (90th/10th percentile "
            f"{spread:.2f}): the per-row and per-step costs are tied in the ratio the executor "
            f"timed at start (per step {seed.c0 * 1e3:.2f} ms, per row {seed.decode * 1e3:.3f} ms)"
        )
    else:
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
    model = StepModel(
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
    model.kinds = kinds_of(rows, model)
    return model
