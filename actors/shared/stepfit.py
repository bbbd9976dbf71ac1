"""The step-time fit the executor's adaptive budget (``gpu/step/budget.py``) and the replay's
step model (``minirt/replay/stepmodel.py``) share: non-negative least squares, made robust to
the odd slow step."""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, by the Lawson-Hanson active-set method (columns
    are scaled to unit norm first, for conditioning)."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, grad)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            alpha = np.min(x[bad] / np.maximum(x[bad] - z[bad], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
    return x / norms


def robust_fit(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares, reweighted (Huber) on *relative* residuals so a step that
    took much longer than steps of its shape (a kernel built, the machine busy) counts less,
    whatever its size. Returns the solution and the final relative residuals."""
    w = np.ones(len(y))
    for _ in range(10):
        sw = np.sqrt(w)
        sol = nnls(a * sw[:, None], y * sw)
        fitted = np.maximum(a @ sol, 1e-9)
        rel = (y - fitted) / fitted
        scale = 1.4826 * float(np.median(np.abs(rel - np.median(rel)))) + 1e-6
        w = np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(rel), 1e-12))
    return sol, rel / scale
