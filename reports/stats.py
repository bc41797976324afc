"""Bootstrap confidence intervals for run-to-run comparisons."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bootstrap_median_change(
    a: Sequence[float], b: Sequence[float], resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """CI of (median(b) - median(a)) / |median(a)|, resampling each side independently.

    Inputs are per-request values or per-run values of repeated runs; both sides need
    at least 2 values. Returns (low, high) as fractions (0.1 = +10%).
    """
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(xa) < 2 or len(xb) < 2:
        raise ValueError("bootstrap needs at least 2 values on each side")
    rng = np.random.default_rng(seed)
    ma = np.median(xa[rng.integers(0, len(xa), (resamples, len(xa)))], axis=1)  # [resamples]
    mb = np.median(xb[rng.integers(0, len(xb), (resamples, len(xb)))], axis=1)  # [resamples]
    scale = abs(float(np.median(xa))) or 1.0
    change = (mb - ma) / scale
    tail = (1.0 - confidence) / 2 * 100
    lo, hi = np.percentile(change, [tail, 100 - tail])
    return float(lo), float(hi)


def relative_change(a: float, b: float) -> float:
    """(b - a) / |a|; +inf/-inf when a is 0 and b is not, 0 when both are 0."""
    if a == 0:
        return 0.0 if b == 0 else float(np.sign(b) * np.inf)
    return (b - a) / abs(a)
