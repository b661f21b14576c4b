"""Least squares with non-negative coefficients, small enough to need no solver: a time never shrinks with
more work, so a coefficient the noise makes negative is dropped and the rest refitted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_nonnegative(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients c >= 0 minimising |X c - y|, by refitting without the most negative one until none is."""
    x, target = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    if x.ndim != 2 or len(x) != len(target) or len(x) == 0:
        raise ValueError(f"need a row of features per sample, got {x.shape} rows for {len(target)} samples")
    active = list(range(x.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active], target, rcond=None)
        worst = int(np.argmin(coef))
        if coef[worst] >= 0:
            out = [0.0] * x.shape[1]
            for i, c in zip(active, coef):
                out[i] = float(c)
            return out
        del active[worst]
    return [0.0] * x.shape[1]


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(predicted, measured) if m > 0]
