"""Side-by-side comparison of two runs (or two sets of repeated runs).

`compare(a, b, config)` returns one row per numeric summary metric present in both:
`metric, A, B, change_pct, beyond_noise, method`. "Beyond noise?" is decided by, in
order of preference:

- repeats: both sides have >= 2 runs -> bootstrap CI of the change of the per-run
  medians; beyond noise when the CI excludes 0 (method "bootstrap over runs");
- per-request data: latency metrics (`*_ttft_ms`, `*_tpot_ms`, `*_e2el_ms`, `*_itl_ms`)
  with requests.csv on both sides -> bootstrap CI of the change of per-request medians
  (method "bootstrap over requests");
- otherwise |change| > the metric's tolerance from the gate config
  (`compare_default_tolerance` for metrics the gate does not list).

A side is a run folder, or a folder whose subfolders are repeated run folders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reports.page import Section, html_table, render_page
from reports.run_data import RunData, RunFolderError, json_list, load_run, numeric_summary
from reports.stats import bootstrap_median_change, relative_change

LATENCY_RE = re.compile(r"^(?:mean|median|std|p\d+)_(ttft|tpot|e2el|itl)_ms$")


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


def _per_request(runs: list[RunData], latency: str) -> np.ndarray:
    values: list[float] = []
    for run in runs:
        req = run.completed_requests()
        if req is None:
            return np.asarray([])
        if latency == "itl":
            values += [g for cell in req.get("itls_ms", []) for g in json_list(cell)]
        elif f"{latency}_ms" in req:
            values += pd.to_numeric(req[f"{latency}_ms"], errors="coerce").dropna().tolist()
    return np.asarray(values)


def _noise(metric: str, a: list[float], b: list[float], ra: list[RunData], rb: list[RunData],
           change: float, config: dict[str, Any]) -> tuple[str, str]:  # fmt: skip
    if len(a) >= 2 and len(b) >= 2:
        lo, hi = bootstrap_median_change(a, b)
        return ("yes" if not lo <= 0 <= hi else "no"), f"bootstrap over runs, CI {lo:+.1%}..{hi:+.1%}"
    m = LATENCY_RE.match(metric)
    if m:
        xa, xb = _per_request(ra, m[1]), _per_request(rb, m[1])
        if len(xa) >= 2 and len(xb) >= 2:
            lo, hi = bootstrap_median_change(xa, xb)
            return ("yes" if not lo <= 0 <= hi else "no"), f"bootstrap over requests, CI {lo:+.1%}..{hi:+.1%}"
    spec = config.get("metrics", {}).get(metric, {})
    tol = float(spec.get("tolerance", config.get("compare_default_tolerance", 0.05)))
    beyond = abs(change) > tol + 1e-9 if np.isfinite(change) else True
    return ("yes" if beyond else "no"), f"tolerance {tol:.0%}"


def compare(a: str | Path, b: str | Path, config: dict[str, Any]) -> pd.DataFrame:
    """The comparison table (see module docstring)."""
    ra, rb = load_side(a), load_side(b)
    sa = [numeric_summary(r.summary) for r in ra]
    sb = [numeric_summary(r.summary) for r in rb]
    metrics = [k for k in sa[0] if all(k in s for s in sa + sb)]
    rows = []
    for k in metrics:
        va, vb = [s[k] for s in sa], [s[k] for s in sb]
        ma, mb = float(np.median(va)), float(np.median(vb))
        change = relative_change(ma, mb)
        beyond, method = _noise(k, va, vb, ra, rb, change, config)
        rows.append((k, ma, mb, change * 100 if np.isfinite(change) else np.nan, beyond, method))
    return pd.DataFrame(rows, columns=["metric", "A", "B", "change_pct", "beyond_noise", "method"])


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
