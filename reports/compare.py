"""Side-by-side comparison of two runs (or two sets of repeated runs).

`compare(a, b, config)` returns one row per numeric summary metric present in both:
`metric, A, B, A_cv, B_cv, change_pct, beyond_noise, method`. A and B are the means over a
side's runs, A_cv and B_cv their coefficients of variation (std / mean over runs). "Beyond
noise?" asks whether the interval of the change excludes 0:

- exact metrics (`kind: exact` in the gate config: steps, preemptions, prefix hits, ...) do
  not depend on the machine: |change| beyond the metric's tolerance, whatever the run count;
- every other metric needs at least `MIN_RUNS` (3) runs a side: with fewer, one run's luck (its
  load, its process placement) cannot be told from an effect, and the row says "too few runs
  to tell noise" instead of a verdict (`servelab-compare --runs N` makes the runs);
- latency metrics of one value per request (`*_ttft_ms`, `*_tpot_ms`, `*_e2el_ms`) with
  requests.csv in every run: a two-level bootstrap (`analysis.stats.cluster_bootstrap`): runs,
  then requests within each run; each resampled run's metric (mean, median, std or
  percentile of its resampled requests) is averaged over the resampled runs;
- other metrics (throughputs, ITL metrics, whose token gaps are correlated within a request):
  a bootstrap over runs of the per-run values.

A side is a run folder, or a folder whose subfolders are repeated run folders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.stats import (
    Interval,
    cluster_bootstrap,
    coefficient_of_variation,
    nan_quantile,
    relative_change,
)
from reports.page import Section, html_table, render_page
from reports.run_data import RunData, RunFolderError, load_run, numeric_summary

LATENCY_RE = re.compile(r"^(mean|median|std|p\d+)_(ttft|tpot|e2el)_ms$")
MIN_RUNS = 3
TOO_FEW = "too few runs to tell noise"


def load_side(path: str | Path) -> list[RunData]:
    """The run(s) of one side: the folder itself, or its subfolders holding summary.json."""
    p = Path(path)
    if not p.is_dir():
        raise RunFolderError(f"not a run folder: {p}")
    if (p / "summary.json").exists():
        return [load_run(p)]
    runs = [load_run(d) for d in sorted(p.iterdir()) if (d / "summary.json").exists()]
    if not runs:
        raise RunFolderError(f"no summary.json in {p} nor in its subfolders")
    return runs


def _per_request(runs: list[RunData], latency: str) -> list[np.ndarray] | None:
    """Each run's per-request values of `latency` (ttft, tpot, e2el); None when a run has none."""
    out = []
    for run in runs:
        req = run.completed_requests()
        if req is None or f"{latency}_ms" not in req:
            return None
        values = pd.to_numeric(req[f"{latency}_ms"], errors="coerce").dropna().to_numpy(dtype=float)
        if not len(values):
            return None
        out.append(values)
    return out


def _run_metric(kind: str, x: np.ndarray) -> np.ndarray:
    """[batch, runs, requests] NaN-padded -> [batch, runs]: each run's `kind` (mean, median, std, pNN)."""
    if kind == "mean":
        return np.nanmean(x, axis=2)
    if kind == "median":
        return nan_quantile(x, 0.5)
    if kind == "std":
        return np.nanstd(x, axis=2)
    return nan_quantile(x, float(kind[1:]) / 100)


def change_interval(a: list[np.ndarray], b: list[np.ndarray], kind: str, seed: int = 0) -> Interval:
    """Interval of the relative change B/A - 1 of the mean over runs of each run's `kind` metric,
    resampling runs, then values within each run (one value per run: runs only)."""

    def change(xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        ma, mb = _run_metric(kind, xa).mean(axis=1), _run_metric(kind, xb).mean(axis=1)  # [batch]
        return (mb - ma) / np.where(ma == 0, 1.0, np.abs(ma))

    return cluster_bootstrap([a, b], change, seed=seed)


def _noise(metric: str, a: list[float], b: list[float], ra: list[RunData], rb: list[RunData],
           change: float, config: dict[str, Any]) -> tuple[str, str]:  # fmt: skip
    spec = config.get("metrics", {}).get(metric, {})
    if spec.get("kind") == "exact":
        tol = float(spec.get("tolerance", 0.0))
        beyond = abs(change) > tol + 1e-9 if np.isfinite(change) else True
        return ("yes" if beyond else "no"), f"exact, tolerance {tol:.0%}"
    if len(a) < MIN_RUNS or len(b) < MIN_RUNS:
        return TOO_FEW, f"{len(a)} and {len(b)} run(s); {MIN_RUNS} a side needed"
    m = LATENCY_RE.match(metric)
    xa, xb = (_per_request(ra, m[2]), _per_request(rb, m[2])) if m else (None, None)
    if m and xa is not None and xb is not None:
        est, how = change_interval(xa, xb, m[1]), "runs, then requests within each"
    else:
        est, how = change_interval([np.array([v]) for v in a], [np.array([v]) for v in b], "mean"), "runs"
    return ("yes" if est.excludes_zero() else "no"), f"bootstrap over {how}, CI {est.low:+.1%}..{est.high:+.1%}"


def compare(a: str | Path, b: str | Path, config: dict[str, Any]) -> pd.DataFrame:
    """The comparison table (see module docstring)."""
    ra, rb = load_side(a), load_side(b)
    sa = [numeric_summary(r.summary) for r in ra]
    sb = [numeric_summary(r.summary) for r in rb]
    metrics = [k for k in sa[0] if all(k in s for s in sa + sb)]
    rows = []
    for k in metrics:
        va, vb = [s[k] for s in sa], [s[k] for s in sb]
        ma, mb = float(np.mean(va)), float(np.mean(vb))
        change = relative_change(ma, mb)
        beyond, method = _noise(k, va, vb, ra, rb, change, config)
        rows.append((k, ma, mb, coefficient_of_variation(va), coefficient_of_variation(vb),
                     change * 100 if np.isfinite(change) else np.nan, beyond, method))  # fmt: skip
    return pd.DataFrame(rows, columns=["metric", "A", "B", "A_cv", "B_cv", "change_pct", "beyond_noise", "method"])


def format_table(df: pd.DataFrame) -> str:
    """Plain-text table for the terminal."""

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [list(df.columns)] + [[fmt(v) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(df.columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_html(df: pd.DataFrame, a: str | Path, b: str | Path, out: str | Path) -> Path:
    section = Section("comparison", "Summary metrics, A vs B",
                      intro=f"A = {a}; B = {b}. change % = (B - A) / |A|; 'beyond noise?' method per row.",
                      tables=[html_table(df)])  # fmt: skip
    return render_page("servelab comparison", f"A: {a} · B: {b}", [section], Path(out))
