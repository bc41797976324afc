"""The workbench's statistics, on `scipy.stats`: the paired gate, `servelab-ab` and `servelab-compare`.

Design note: resample what is independent. A benchmark's measurements come in clusters that
share luck: the requests of one run share that run's machine load and process placement, the
pairs of one gate generation share its two worker processes (whose placement alone moved
identical code by up to ±12%, workloads/paired_gate.py). Treating the members of a cluster as
independent draws makes an interval as narrow as if there were many clusters, and a cluster's
luck then passes for an effect. So every interval here is a cluster bootstrap
(`cluster_bootstrap`): resample the clusters with replacement, then the values within each
chosen cluster; a one-level bootstrap is the case of one value per cluster.

- The outer level is `scipy.stats.bootstrap` over cluster indices (its percentile interval);
  the inner level is drawn inside the statistic from a generator seeded from `seed`, so the
  result is reproducible. Percentile, not BCa: BCa's acceleration comes from a jackknife of
  the statistic, which is not defined for a statistic that itself resamples, and with 3-8
  clusters that jackknife would be noise anyway. With few clusters the percentile interval is
  somewhat narrow (the bootstrap variance is (k-1)/k of the true one): read it with the
  cluster count, which every caller reports.
- `rank_test`: the exact Wilcoxon signed-rank test of per-cluster values against 0
  (`scipy.stats.wilcoxon`, method "exact"), with the sign test (`scipy.stats.binomtest`) when
  ties or zeros leave no exact rank distribution. Its smallest two-sided p-value with k
  clusters is 2 / 2^k (0.125 at 4, 0.0078 at 8): a cross-check of the interval, not a gate.
- `mean_interval`: Student's t interval of a mean over repeated runs (`scipy.stats.t`): the
  runs of one configuration are few and each run's value is itself an average.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats as sps

# A statistic of one sample: a [batch, clusters, values] array, NaN-padded, to a [batch] array.
Statistic = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate, its interval, and how many clusters (independent units) stand behind it."""

    point: float
    low: float
    high: float
    clusters: int  # the smallest cluster count over the samples

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0


def _padded(clusters: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """([clusters, max size] values NaN-padded, [clusters] sizes)."""
    sizes = np.array([len(c) for c in clusters])
    out = np.full((len(clusters), int(sizes.max())), np.nan)
    for k, c in enumerate(clusters):
        out[k, : len(c)] = c
    return out, sizes


def _inner_resample(values: np.ndarray, sizes: np.ndarray, idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Values of the chosen clusters `idx` [batch, k], each resampled within itself: [batch, k, max size]."""
    chosen = sizes[idx]  # [batch, k]
    width = values.shape[1]
    draw = np.floor(rng.random((*idx.shape, width)) * chosen[..., None]).astype(np.int64)  # [batch, k, width]
    out = values[idx[..., None], draw]
    out[np.arange(width) >= chosen[..., None]] = np.nan  # a smaller cluster keeps its own size
    return out


def cluster_bootstrap(
    samples: Sequence[Sequence[ArrayLike]], statistic: Callable[..., np.ndarray], *, resamples: int = 2000,
    confidence: float = 0.95, seed: int = 0,
) -> Interval:
    """The percentile interval of `statistic` under a two-level bootstrap of each sample.

    `samples[s]` is one sample's clusters (runs, repeats or generations), each an array of its
    values (requests or pairs). `statistic(x_0, x_1, ...)` takes one [batch, clusters, values]
    array per sample (NaN-padded: use NaN-aware reductions) and returns [batch]. Samples are
    resampled independently of each other. The point estimate is the statistic of the data as
    they are. Needs at least 2 clusters per sample (ValueError otherwise); empty clusters are
    dropped.
    """
    data = []
    for s, clusters in enumerate(samples):
        kept = [np.asarray(c, dtype=float).ravel() for c in clusters]
        kept = [c for c in kept if len(c)]
        if len(kept) < 2:
            raise ValueError(f"cluster bootstrap: sample {s} has {len(kept)} non-empty cluster(s), needs 2")
        data.append(_padded(kept))
    point = float(statistic(*(v[None] for v, _ in data))[0])
    inner = np.random.default_rng([seed, 1])

    def resampled(*idx: np.ndarray, axis: int = -1) -> np.ndarray:
        # idx[s]: [batch, clusters of sample s] cluster indices drawn by scipy
        return statistic(*(_inner_resample(v, n, i.astype(np.int64), inner) for (v, n), i in zip(data, idx, strict=True)))

    per_resample = sum(v.size for v, _ in data)  # values one resample holds, all samples together
    batch = max(1, min(resamples, 4_000_000 // per_resample))  # about 32 MB of float64 at a time
    res = sps.bootstrap(tuple(np.arange(len(n)) for _, n in data), resampled, n_resamples=resamples, batch=batch,
                        vectorized=True, axis=-1, confidence_level=confidence, method="percentile",
                        rng=np.random.default_rng([seed, 0]))  # fmt: skip
    low, high = res.confidence_interval
    return Interval(point, float(low), float(high), min(len(n) for _, n in data))


def nan_quantile(x: np.ndarray, q: float) -> np.ndarray:
    """The q-quantile (0..1, linear interpolation as numpy's default) over the last axis, NaNs
    ignored (an all-NaN row gives NaN). numpy's nanquantile goes row by row once a NaN is
    present; this sorts once (NaNs sort last) and interpolates."""
    xs = np.sort(x, axis=-1)
    n = (~np.isnan(xs)).sum(axis=-1)  # [...]
    pos = q * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
    below = np.take_along_axis(xs, lo[..., None], axis=-1)[..., 0]
    above = np.take_along_axis(xs, hi[..., None], axis=-1)[..., 0]
    out = below + (above - below) * (pos - lo)
    return np.where(n > 0, out, np.nan)


def pooled_median(x: np.ndarray) -> np.ndarray:
    """[batch, clusters, values] -> [batch]: the median of every value of a resample."""
    return nan_quantile(x.reshape(len(x), -1), 0.5)


def rank_test(values: ArrayLike) -> tuple[float, str]:
    """(two-sided p-value, test name) that per-cluster `values` centre on 0 (module docstring)."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return float("nan"), "none"
    nonzero = x[x != 0]
    if len(nonzero) and len(np.unique(np.abs(nonzero))) == len(nonzero) and len(nonzero) == len(x):
        return float(sps.wilcoxon(x, method="exact").pvalue), "Wilcoxon signed-rank, exact"
    if len(nonzero) == 0:
        return 1.0, "sign test"
    return float(sps.binomtest(int((nonzero > 0).sum()), len(nonzero)).pvalue), "sign test"


def mean_interval(values: ArrayLike, confidence: float = 0.95) -> tuple[float, float]:
    """Student's t interval of the mean of `values` (repeated runs); (nan, nan) under 2 values."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float("nan"), float("nan")
    half = float(sps.t.ppf(0.5 + confidence / 2, len(x) - 1)) * float(np.std(x, ddof=1)) / np.sqrt(len(x))
    return float(x.mean()) - half, float(x.mean()) + half


def coefficient_of_variation(values: ArrayLike) -> float:
    """Sample standard deviation over |mean| (nan under 2 values or a zero mean)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2 or x.mean() == 0:
        return float("nan")
    return float(np.std(x, ddof=1) / abs(x.mean()))


def relative_change(a: float, b: float) -> float:
    """(b - a) / |a|; +inf/-inf when a is 0 and b is not, 0 when both are 0."""
    if a == 0:
        return 0.0 if b == 0 else float(np.sign(b) * np.inf)
    return (b - a) / abs(a)
