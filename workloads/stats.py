"""A small paired bootstrap for A/B comparisons on identical traffic (servelab-ab).

Two configurations ran the same requests, `repeats` times each, alternating. A request's
paired difference is B - A for the same request id within the same repeat. The statistic is
the median of the paired differences, as in the paired gate (workloads/gate_stats.py): a burst
of machine noise that slows a few requests of one run moves a mean a long way and a median
hardly at all. Its interval resamples on two levels (repeats, then requests within each
repeat), so run-to-run drift (a busier machine during one repeat) widens the interval instead
of passing as an effect. A difference is significant when the interval excludes 0 and the
relative effect (median difference / median of A) is at least `min_effect`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Difference:
    """B - A of one metric: the median paired difference, its interval, relative to A's median."""

    metric: str
    median_a: float
    median_b: float
    diff: float
    low: float
    high: float
    n_pairs: int
    significant: bool

    @property
    def relative(self) -> float:
        return self.diff / self.median_a if self.median_a else float("nan")


def paired_bootstrap(
    metric: str,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    *,
    iterations: int = 2000,
    confidence: float = 0.95,
    min_effect: float = 0.05,
    seed: int = 0,
) -> Difference | None:
    """`pairs[k]` = (A values, B values) of repeat k, aligned by request; None without data."""
    pairs = [(np.asarray(a, float), np.asarray(b, float)) for a, b in pairs if len(a)]
    if not pairs:
        return None
    diffs = [b - a for a, b in pairs]
    median_a = float(np.median(np.concatenate([a for a, _ in pairs])))
    median_b = float(np.median(np.concatenate([b for _, b in pairs])))
    point = float(np.median(np.concatenate(diffs)))
    rng = np.random.default_rng(seed)
    stats = np.empty(iterations)
    for i in range(iterations):
        chosen = rng.integers(0, len(diffs), size=len(diffs))
        sample = [diffs[k][rng.integers(0, len(diffs[k]), size=len(diffs[k]))] for k in chosen]
        stats[i] = np.median(np.concatenate(sample))
    alpha = (1.0 - confidence) / 2.0
    low, high = (float(v) for v in np.quantile(stats, [alpha, 1.0 - alpha]))
    effect = abs(point) / abs(median_a) if median_a else float("inf")
    significant = (low > 0 or high < 0) and effect >= min_effect
    n = sum(len(d) for d in diffs)
    return Difference(metric, median_a, median_b, point, low, high, n, significant)
