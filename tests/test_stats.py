"""The one statistics module (analysis/stats.py; issue 37 items 1-2): a cluster bootstrap on
scipy.stats, the rank test beside it, and the paired gate resampling whole generations."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from analysis.stats import (
    cluster_bootstrap,
    coefficient_of_variation,
    mean_interval,
    nan_quantile,
    pooled_median,
    rank_test,
)
from workloads.gate_stats import MetricRule, judge

ROOT = Path(__file__).resolve().parents[1]


def test_one_bootstrap_in_the_workbench():
    """`grep -rn "def .*bootstrap" analysis workloads reports` finds only analysis/stats.py."""
    found = []
    for folder in ("analysis", "workloads", "reports"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if re.search(r"def .*bootstrap", line)]  # fmt: skip
    assert [f.split(":")[0] for f in found] == ["analysis/stats.py"], found


def _shared_offsets(seed: int = 3) -> tuple[list[float], list[float], list[int]]:
    """16 pairs in 4 generations: the candidate is the baseline's code (no effect), but each
    generation's pair of workers carries its own placement luck (+10%, +8%, -3%, +6%: the size
    seen on identical code), shared by all of that generation's pairs; 1% noise per pair."""
    rng = np.random.default_rng(seed)
    base, cand, gens = [], [], []
    for g, offset in enumerate([0.10, 0.08, -0.03, 0.06]):
        for _ in range(4):
            b = 10.0 * rng.uniform(1.0, 1.5)  # load both sides of the pair share
            base.append(b)
            cand.append(b * (1.0 + offset) * rng.normal(1.0, 0.01))
            gens.append(g)
    return base, cand, gens


def test_generation_offsets_are_not_an_effect():
    """Pairs of one generation share its workers' luck: the pair bootstrap (the old design) calls
    that luck a regression; resampling generations does not."""
    base, cand, gens = _shared_offsets()
    rule = MetricRule("lower", 0.05)
    pairs = judge("cpu_ms_per_token", rule, base, cand, generations=None)  # every pair independent
    assert pairs.interval is not None and pairs.interval[0] > 0.0 and pairs.verdict == "REGRESSION"
    clusters = judge("cpu_ms_per_token", rule, base, cand, generations=gens)
    assert clusters.change == pytest.approx(pairs.change)  # same estimate, honest interval
    assert clusters.interval is not None and clusters.interval[0] < 0.0 < clusters.interval[1]
    assert clusters.verdict == "ok" and clusters.generations == 4
    # the cross-check: 3 of 4 generations slower is no evidence (exact signed-rank, smallest p 2/16)
    assert clusters.p_value == pytest.approx(0.25)


def test_a_real_slowdown_still_fails_with_generations():
    rng = np.random.default_rng(5)
    base = list(10.0 * rng.uniform(1.0, 1.5, 16))
    gens = [i // 2 for i in range(16)]  # 8 generations of 2 pairs
    luck = rng.normal(0.0, 0.02, 8)
    cand = [b * 1.15 * (1.0 + luck[g]) for b, g in zip(base, gens, strict=True)]
    check = judge("cpu_ms_per_token", MetricRule("lower", 0.05), base, cand, generations=gens)
    assert check.verdict == "REGRESSION" and check.interval is not None and check.interval[0] > 0.05
    assert check.p_value == pytest.approx(2 / 2**8)  # all 8 generations slower: the exact test's floor


def test_cluster_bootstrap_contract():
    rng = np.random.default_rng(0)
    runs = [rng.normal(100.0, 5.0, 50) for _ in range(4)]
    est = cluster_bootstrap([runs], pooled_median, resamples=500, seed=1)
    assert est.low < est.point < est.high and est.clusters == 4
    assert est.point == pytest.approx(np.median(np.concatenate(runs)))
    again = cluster_bootstrap([runs], pooled_median, resamples=500, seed=1)
    assert (again.low, again.high) == (est.low, est.high)  # seeded: reproducible
    # clusters of unequal size keep their own size in every resample
    sizes = []
    cluster_bootstrap([[np.ones(3), np.ones(7)]], lambda x: sizes.append((~np.isnan(x)).sum(axis=2)) or x[:, 0, 0],
                      resamples=50)  # fmt: skip
    counts = np.concatenate(sizes).ravel()
    assert set(counts.tolist()) <= {3, 7}
    with pytest.raises(ValueError, match="sample 0 has 1 non-empty cluster"):
        cluster_bootstrap([[np.ones(5), np.array([])]], pooled_median)


def test_two_samples_resample_independently():
    rng = np.random.default_rng(2)
    a = [rng.normal(10.0, 1.0, 40) for _ in range(3)]
    b = [rng.normal(12.0, 1.0, 40) for _ in range(3)]
    est = cluster_bootstrap([a, b], lambda xa, xb: pooled_median(xb) - pooled_median(xa), resamples=500)
    assert est.excludes_zero() and 1.5 < est.point < 2.5


def test_rank_test_and_run_summaries():
    assert rank_test([0.1, 0.2, 0.3, 0.4]) == (pytest.approx(0.125), "Wilcoxon signed-rank, exact")
    p, name = rank_test([0.1, 0.1, 0.0, 0.2])  # ties and a zero: the sign test
    assert name == "sign test" and p == pytest.approx(0.25)
    low, high = mean_interval([10.0, 11.0, 12.0])
    assert low < 11.0 < high and high - low == pytest.approx(2 * 4.302653 * 1.0 / np.sqrt(3), rel=1e-4)
    assert np.isnan(mean_interval([1.0])[0])
    assert coefficient_of_variation([9.0, 10.0, 11.0]) == pytest.approx(0.1)


def test_nan_quantile_matches_numpy_on_ragged_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 3, 9))
    x[rng.random(x.shape) < 0.3] = np.nan  # clusters of unequal size
    x[0, 0, :] = np.nan
    for q in (0.0, 0.5, 0.99, 1.0):
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):  # numpy warns on the all-NaN row
            expected = np.nanquantile(x, q, axis=-1)
        assert np.allclose(nan_quantile(x, q), expected, equal_nan=True)
