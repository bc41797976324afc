"""Verdicts of the paired gate: per metric, the change of the candidate over the baseline.

Each pair i ran the baseline and the candidate back to back, so whatever else loaded the
machine then loaded both: the ratio `candidate_i / baseline_i` cancels it, and the
statistic is the median of those ratios minus 1 (robust to a pair hit by a burst).

The pairs are not independent draws: the pairs of one generation ran on the same two worker
processes, whose placement luck (up to ±12% on identical code, workloads/paired_gate.py) they
all share. The interval therefore resamples whole generations, then pairs within each
(`analysis.stats.cluster_bootstrap`, percentile), so the real sample, the generations, sets
its width. Beside it the gate prints the exact Wilcoxon signed-rank p-value of the
per-generation median ratios (`analysis.stats.rank_test`) as a cross-check; it does not
decide (with 4 generations it cannot go below 0.125). A time metric regresses only when both
hold:

- the change in the bad direction exceeds the metric's tolerance (a slowdown that matters);
- the interval lies wholly on the bad side of 0 (the slowdown is not noise).

Exact metrics (steps, tokens per step, prefix hits, preemptions, output tokens) do not
depend on the machine: the medians are compared with their tolerance (usually 0).
Metrics marked `gate: false` are reported with what their verdict would be, and never fail.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.stats import Interval, cluster_bootstrap, pooled_median, rank_test

EPS = 1e-9


@dataclass(frozen=True, slots=True)
class MetricRule:
    """How one metric is judged (an entry of conf/gate/paired.yaml `metrics`)."""

    direction: str  # "lower" or "higher" is better
    tolerance: float  # relative change in the bad direction that is allowed
    kind: str = "time"  # "time": paired ratios with an interval; "exact": medians compared
    gate: bool = True  # False: reported only

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> MetricRule:
        rule = cls(str(raw.get("direction", "lower")), float(raw.get("tolerance", 0.0)),
                   str(raw.get("kind", "time")), bool(raw.get("gate", True)))  # fmt: skip
        if rule.direction not in ("lower", "higher") or rule.kind not in ("time", "exact"):
            raise ValueError(f"gate metric {name}: direction lower|higher and kind time|exact, got {dict(raw)}")
        return rule


@dataclass(frozen=True, slots=True)
class PairedCheck:
    metric: str
    baseline: float  # median over the baseline's reps
    candidate: float  # median over the candidate's reps
    change: float  # median paired ratio - 1 (time) or relative change of medians (exact)
    interval: tuple[float, float] | None  # cluster-bootstrap interval of `change` (time metrics)
    rule: MetricRule
    verdict: str  # "ok", "REGRESSION", "faster", or "(ok)" / "(slower)" for report-only metrics
    p_value: float | None = None  # rank test of the per-generation median ratios (time metrics)
    generations: int = 0  # independent units behind the interval

    @property
    def regressed(self) -> bool:
        return self.verdict == "REGRESSION"

    def row(self) -> list[str]:
        interval = "" if self.interval is None else f"{self.interval[0]:+.1%} .. {self.interval[1]:+.1%}"
        p = "" if self.p_value is None else f"{self.p_value:.3g} ({self.generations})"
        return [self.metric, f"{self.baseline:.4g}", f"{self.candidate:.4g}", f"{self.change:+.1%}", interval, p,
                self.verdict]  # fmt: skip


def by_generation(values: Sequence[float], generations: Sequence[int] | None) -> list[np.ndarray]:
    """`values` split by generation label, in label order; None: each value its own generation."""
    x = np.asarray(values, dtype=float)
    if generations is None:
        return [x[i : i + 1] for i in range(len(x))]
    labels = np.asarray(generations)
    if len(labels) != len(x):
        raise ValueError(f"paired change: {len(x)} pairs but {len(labels)} generation labels")
    return [x[labels == g] for g in np.unique(labels)]


def paired_change(
    baseline: Sequence[float], candidate: Sequence[float], resamples: int = 2000, confidence: float = 0.95,
    seed: int = 0, generations: Sequence[int] | None = None,
) -> tuple[Interval, float | None]:
    """(median of candidate_i / baseline_i - 1 with its cluster-bootstrap interval, rank-test p).

    `generations[i]` is pair i's generation: the interval resamples generations, then pairs
    within them. None treats every pair as its own generation (independent pairs). The p-value
    is None with fewer than 2 generations."""
    a, b = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired change: need >= 2 pairs of equal length, got {len(a)} and {len(b)}")
    ratios = b / np.where(a == 0, EPS, a)  # [pairs]
    clusters = by_generation(ratios, generations)
    if len(clusters) < 2:  # one generation: its pairs are all there is to resample
        clusters = by_generation(ratios, None)
    interval = cluster_bootstrap([clusters], lambda x: pooled_median(x) - 1.0, resamples=resamples,
                                 confidence=confidence, seed=seed)  # fmt: skip
    medians = [float(np.median(c)) - 1.0 for c in by_generation(ratios, generations)]
    p = rank_test(medians)[0] if len(medians) >= 2 else None
    return interval, p


def _verdict(rule: MetricRule, change: float, interval: tuple[float, float] | None) -> str:
    worse = change if rule.direction == "lower" else -change
    if interval is None:
        beyond_noise = True
    else:
        bad_side = interval if rule.direction == "lower" else (-interval[1], -interval[0])
        beyond_noise = bad_side[0] > 0.0
    if worse > rule.tolerance + EPS and beyond_noise:
        return "REGRESSION" if rule.gate else "(slower)"
    if worse < -(rule.tolerance + EPS) and (interval is None or not (interval[0] <= 0.0 <= interval[1])):
        return "faster" if rule.gate else "(faster)"
    return "ok" if rule.gate else "(ok)"


def judge(
    metric: str, rule: MetricRule, baseline: Sequence[float], candidate: Sequence[float],
    bootstrap: Mapping[str, Any] | None = None, generations: Sequence[int] | None = None,
) -> PairedCheck:
    """One metric's check from its per-pair values (baseline[i] and candidate[i] ran as pair i,
    in generation `generations[i]`; None: every pair independent)."""
    bs = dict(bootstrap or {})
    med_a, med_b = float(np.median(baseline)), float(np.median(candidate))
    if rule.kind == "exact":
        change = 0.0 if med_a == med_b else (med_b - med_a) / (abs(med_a) or 1.0)
        return PairedCheck(metric, med_a, med_b, change, None, rule, _verdict(rule, change, None))
    est, p = paired_change(baseline, candidate, int(bs.get("resamples", 2000)), float(bs.get("confidence", 0.95)),
                           int(bs.get("seed", 0)), generations)  # fmt: skip
    interval = (est.low, est.high)
    units = len(set(generations)) if generations is not None else len(baseline)
    return PairedCheck(metric, med_a, med_b, est.point, interval, rule, _verdict(rule, est.point, interval), p, units)


def judge_all(
    rules: Mapping[str, MetricRule], baseline_reps: Sequence[Mapping[str, float]],
    candidate_reps: Sequence[Mapping[str, float]], bootstrap: Mapping[str, Any] | None = None,
    generations: Sequence[int] | None = None,
) -> list[PairedCheck]:
    """Every metric of `rules` that every rep of both sides measured (`generations[i]`: pair i's)."""
    checks = []
    for metric, rule in rules.items():
        if not all(metric in r and r[metric] is not None for r in [*baseline_reps, *candidate_reps]):
            continue
        a = [float(r[metric]) for r in baseline_reps]
        b = [float(r[metric]) for r in candidate_reps]
        checks.append(judge(metric, rule, a, b, bootstrap, generations))
    return checks


def format_table(checks: Sequence[PairedCheck]) -> str:
    header = ["metric", "baseline", "candidate", "change", "95% interval", "p (generations)", "verdict"]
    rows = [header, *(c.row() for c in checks)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)
