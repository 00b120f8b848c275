"""The fit of tools/bench/hdp_calibrate.py, pure numpy: the cost t = a·Σs² + b·Σs + c of one block over the
measured micro-batches (`fit_cost`), a straight line for the head and the memory (`fit_line`), and the micro-batches
to time (`design_points`).

Why a module of its own: it needs no device and no model, so tests/unit/test_hdp_calibrate.py checks it on
synthetic timings."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Fit:
    a: float
    b: float
    c: float
    relative_residuals: list[float]  # (fit − measured) / measured, per point

    @property
    def rms(self) -> float:
        r = self.relative_residuals
        return math.sqrt(sum(x * x for x in r) / len(r)) if r else float("nan")

    def predict(self, sum_sq: float, tokens: float) -> float:
        return self.a * sum_sq + self.b * tokens + self.c


def fit_cost(sum_sq: Sequence[float], tokens: Sequence[float], seconds: Sequence[float]) -> Fit:
    """a, b, c ≥ 0 of t = a·Σs² + b·Σs + c minimising Σ((fit − t)/t)²: relative error, because timing noise grows
    with the time and the small micro-batches are what pin c.

    Exact non-negative least squares for three unknowns: the optimum is the unconstrained least-squares solution on
    some subset of the columns (the KKT conditions), so every subset is solved and the best feasible one kept.
    Columns are scaled to unit norm first (Σs² is ~1e8 times the constant column)."""
    t = np.asarray(seconds, dtype=np.float64)
    if len(t) < 3 or not (len(sum_sq) == len(tokens) == len(t)) or np.any(t <= 0):
        raise ValueError(f"fit_cost needs at least 3 points with positive times, got {len(t)}")
    design = np.stack([np.asarray(sum_sq, np.float64), np.asarray(tokens, np.float64), np.ones_like(t)], axis=1)
    weighted = design / t[:, None]
    target = np.ones_like(t)  # t / t
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    scaled = weighted / norms
    best, best_cost = np.zeros(3), float(np.sum(target**2))
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            sol, *_ = np.linalg.lstsq(scaled[:, cols], target, rcond=None)
            if np.any(sol < 0):
                continue
            theta = np.zeros(3)
            theta[list(cols)] = sol
            cost = float(np.sum((scaled @ theta - target) ** 2))
            if cost < best_cost - 1e-15:
                best, best_cost = theta, cost
    a, b, c = (best / norms).tolist()
    residuals = ((design @ np.array([a, b, c]) - t) / t).tolist()
    return Fit(a, b, c, residuals)


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of ordinary least squares y = slope·x + intercept (two points: the line through them)."""
    slope, intercept = np.polyfit(np.asarray(x, np.float64), np.asarray(y, np.float64), 1)
    return float(slope), float(intercept)


def design_points(max_tokens: int, min_doc: int) -> list[tuple[int, ...]]:
    """Micro-batches (document lengths) to time, in the order to time them: first, for each total T (ascending,
    powers of two from 2·min_doc to max_tokens) one document of T and T/min_doc documents of min_doc (the extremes of
    Σs² at that Σs), so a run cut short by its budget still spans both axes; then the lengths in between; then mixed
    lengths (T/2 + T/4 + … + min_doc + min_doc), which check that Σs² describes unequal documents too."""
    totals = [t for t in (max_tokens >> k for k in range(12)) if t >= 2 * min_doc][::-1]
    first = [p for t in totals for p in ((t,), (min_doc,) * (t // min_doc))]
    between = [(s,) * (t // s) for t in totals for s in (t >> k for k in range(1, 12)) if min_doc < s < t]
    mixed = []
    for t in totals[-2:]:
        lengths, s = [], t // 2
        while s >= min_doc:
            lengths.append(s)
            s //= 2
        mixed.append((*lengths, t - sum(lengths)))
    return list(dict.fromkeys(first + between + [m for m in mixed if len(m) > 2]))
