"""Change points of a metric's history: e-divisive's procedure with ruptures' kernel search.

The idea (Matteson & James' e-divisive, as MongoDB and Apache Otava run it on performance
series): split a series where two segments differ most, keep the split only if a permutation
test says a split that strong is rare in the same values shuffled, and go on splitting the
segments. Here:

- **Where**: in each segment, the best single split by ruptures' `KernelCPD` with an RBF
  kernel (a kernel two-sample statistic, as e-divisive's energy distance is one: it reacts to
  a change of the distribution, and a bounded kernel keeps one wild point from pulling a split
  to itself). The bandwidth is the median heuristic over the segment's values.
- **Whether**: the statistic is the cost that split removes; its p-value is the share of
  `permutations` shuffles of the segment whose best split removes as much (exchangeable under
  no change, so the p-value holds at any noise level). Of all segments' candidates the one with
  the smallest p is taken while p < `alpha`; then its two halves are searched in turn.
- **How much**: the relative change of the means of the segments on either side of the point
  (between its neighbouring change points), with a bootstrap percentile interval.

A series is one metric on one machine fingerprint under one config digest (never two CPUs or
two workloads in one series), one point per commit (the median of that commit's records),
ordered by commit time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import ruptures as rpt

HIGHER_IS_BETTER = ("throughput", "hit_rate", "goodput", "tokens_per_step", "tokens_per_s", "output_tokens")


@dataclass(frozen=True, slots=True)
class Settings:
    alpha: float = 0.01  # a split is kept when its permutation p-value is below this
    permutations: int = 499
    min_size: int = 3  # fewest points in a segment
    bootstrap: int = 2000
    confidence: float = 0.95
    min_change: float = 0.0  # smaller relative changes are not reported, however significant
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Split:
    index: int  # first point of the new segment
    p_value: float
    statistic: float


@dataclass(frozen=True, slots=True)
class Point:
    commit: str
    time: float
    value: float  # median of this commit's values
    n: int  # values behind it
    verdict: str | None = None  # the gate's worst verdict at this commit ("fail" / "pass"), if gated


@dataclass(frozen=True, slots=True)
class SeriesKey:
    machine: str
    config: str
    metric: str
    config_name: str = ""
    cpu_model: str = ""

    def label(self) -> str:
        return f"{self.metric} [{self.config_name or self.config} @ {self.machine}]"


@dataclass(frozen=True)
class Series:
    key: SeriesKey
    points: list[Point]
    direction: str  # "lower" | "higher" is better

    @property
    def values(self) -> np.ndarray:
        return np.array([p.value for p in self.points], dtype=float)


@dataclass(frozen=True, slots=True)
class ChangePoint:
    series: SeriesKey
    index: int
    last_before: str  # the last commit of the old level
    first_after: str  # the first commit of the new level (the change is in last_before..first_after)
    before: float  # mean of the segment before
    after: float
    change: float  # after / before - 1
    interval: tuple[float, float]
    p_value: float
    n_before: int
    n_after: int
    direction: str = "lower"

    @property
    def kind(self) -> str:
        worse = self.change > 0 if self.direction == "lower" else self.change < 0
        return "regression" if worse else "improvement"

    def line(self) -> str:
        lo, hi = self.interval
        return (f"{self.series.label()}: {self.last_before[:10]}..{self.first_after[:10]} {self.change:+.1%} "
                f"({lo:+.1%} .. {hi:+.1%}) p={self.p_value:.3g} {self.kind} "
                f"[{self.before:.4g} -> {self.after:.4g}, {self.n_before}+{self.n_after} commits]")  # fmt: skip


def direction_of(metric: str, stated: str | None = None) -> str:
    if stated in ("lower", "higher"):
        return stated
    return "higher" if any(metric.endswith(s) or s in metric for s in HIGHER_IS_BETTER) else "lower"


def _best_split(x: np.ndarray, gamma: float, min_size: int) -> tuple[int, float]:
    """(split index, cost removed) of the best single split of `x` (ruptures' KernelCPD, RBF)."""
    algo = rpt.KernelCPD(kernel="rbf", min_size=min_size, params={"gamma": gamma}).fit(x)
    bkps = algo.predict(n_bkps=1)
    return bkps[0], float(algo.cost.error(0, len(x)) - algo.cost.sum_of_costs(bkps))


def _gamma(x: np.ndarray) -> float:
    """The median heuristic: 1 / the median squared distance between distinct points."""
    d = (x[:, None] - x[None, :]) ** 2
    med = float(np.median(d[np.triu_indices(len(x), 1)]))
    return 1.0 / med if med > 0 else 1.0


def segment_split(x: np.ndarray, settings: Settings, rng: np.random.Generator) -> Split | None:
    """The best split of `x` and its permutation p-value (None: too short, or constant)."""
    if len(x) < 2 * settings.min_size or np.ptp(x) == 0:
        return None
    gamma = _gamma(x)
    index, stat = _best_split(x, gamma, settings.min_size)
    as_strong = sum(_best_split(rng.permutation(x), gamma, settings.min_size)[1] >= stat - 1e-12
                    for _ in range(settings.permutations))  # fmt: skip
    return Split(index, (as_strong + 1) / (settings.permutations + 1), stat)


def find_splits(values: Sequence[float] | np.ndarray, settings: Settings = Settings()) -> list[Split]:
    """The significant change points of `values` (sorted by index): module docstring."""
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(settings.seed)
    bounds = [0, len(x)]
    tested: dict[tuple[int, int], Split | None] = {}
    found: list[Split] = []
    while True:
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if (a, b) not in tested:
                s = segment_split(x[a:b], settings, rng)
                tested[(a, b)] = None if s is None else Split(a + s.index, s.p_value, s.statistic)
        candidates = [s for s in tested.values() if s is not None and s.index not in bounds]
        if not candidates:
            break
        best = min(candidates, key=lambda s: (s.p_value, -s.statistic))
        if best.p_value >= settings.alpha:
            break
        found.append(best)
        bounds = sorted([*bounds, best.index])
        tested = {k: v for k, v in tested.items() if not (k[0] < best.index < k[1])}
    return sorted(found, key=lambda s: s.index)


def magnitude(before: np.ndarray, after: np.ndarray, settings: Settings,
              rng: np.random.Generator) -> tuple[float, tuple[float, float]]:  # fmt: skip
    """after.mean() / before.mean() - 1 and its bootstrap percentile interval."""
    change = float(after.mean() / before.mean() - 1)
    b = rng.choice(before, size=(settings.bootstrap, len(before))).mean(axis=1)
    a = rng.choice(after, size=(settings.bootstrap, len(after))).mean(axis=1)
    tail = (1 - settings.confidence) / 2 * 100
    lo, hi = np.percentile(a / b - 1, [tail, 100 - tail])
    return change, (float(lo), float(hi))


def series_changes(series: Series, settings: Settings = Settings()) -> list[ChangePoint]:
    """The change points of one series, each with its commit range, magnitude and p-value."""
    x = series.values
    splits = find_splits(x, settings)
    bounds = [0, *(s.index for s in splits), len(x)]
    rng = np.random.default_rng(settings.seed + 1)
    out = []
    for i, s in enumerate(splits):
        before, after = x[bounds[i]:s.index], x[s.index:bounds[i + 2]]
        change, interval = magnitude(before, after, settings, rng)
        if abs(change) < settings.min_change:
            continue
        out.append(ChangePoint(series.key, s.index, series.points[s.index - 1].commit, series.points[s.index].commit,
                               float(before.mean()), float(after.mean()), change, interval, s.p_value,
                               len(before), len(after), series.direction))  # fmt: skip
    return out


def build_series(rows: pd.DataFrame) -> list[Series]:
    """Series from `Store.measurements()` rows: one per (machine, config, metric), a point per commit."""
    out: list[Series] = []
    if rows.empty:
        return out
    for (machine, config, metric), g in rows.groupby(["machine_fp", "config_digest", "metric"], sort=True):
        points = []
        for (sha, when), c in g.groupby(["commit_sha", "commit_time"], sort=False):
            gated = c[c["role"] == "candidate"]["run_verdict"].dropna()
            verdict = None if gated.empty else ("fail" if (gated == "fail").any() else "pass")
            points.append(Point(str(sha), float(when), float(c["value"].median()), len(c), verdict))
        points.sort(key=lambda p: p.time)
        stated = next((d for d in g["direction"].dropna()), None)
        key = SeriesKey(str(machine), str(config), str(metric), str(g["config_name"].iloc[0]),
                        str(g["cpu_model"].iloc[0]))  # fmt: skip
        out.append(Series(key, points, direction_of(str(metric), stated)))
    return out


@dataclass
class Scan:
    """Every series' change points (`scan`)."""

    series: list[Series]
    changes: dict[SeriesKey, list[ChangePoint]] = field(default_factory=dict)

    def all_changes(self) -> list[ChangePoint]:
        return sorted((c for cs in self.changes.values() for c in cs), key=lambda c: (c.p_value, -abs(c.change)))


def scan(rows: pd.DataFrame, settings: Settings = Settings()) -> Scan:
    series = build_series(rows)
    return Scan(series, {s.key: series_changes(s, settings) for s in series})
