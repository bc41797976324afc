"""Performance regression gate over summary.json files.

Baseline file (JSON, written by `make_baseline`): `{"kind": "servelab-gate-baseline",
"runs": [{"path", "summary": {metric: value, "time_reference_s", "reference_ratio_*"}}]}`.

`check(baseline, summaries, config)` compares, per metric listed in the gate config
(conf/gate/default.yaml), the median over the baseline's runs with the median over the
new runs:

- exact metrics (num_steps, preemptions, prefix hits, ...) are compared as they are;
- time metrics are compared as `metric / time_reference_s` and rates as
  `metric * time_reference_s` when every run on both sides has that reference (a run
  provides it as summary.json `"time_reference_s"`: the seconds a fixed reference
  computation took in the same process) or a precomputed `"reference_ratio_<metric>"`;
  otherwise raw values are compared and the check says so;
- a metric regresses when its relative change in the bad direction exceeds its
  tolerance and, with >= 2 runs on both sides, the bootstrap CI of the change of
  medians (runs resampled on each side, `analysis.stats.cluster_bootstrap` with one value
  per run) excludes 0 (the change is not noise).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import conf
from analysis.stats import cluster_bootstrap, relative_change

DEFAULT_CONFIG = Path(conf.__file__).parent / "gate" / "default.yaml"
EPS = 1e-9


def load_gate_config(path: str | Path | None = None) -> dict[str, Any]:
    return yaml.safe_load(Path(path or DEFAULT_CONFIG).read_text())


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"no summary.json in {run_dir}")
    return json.loads(path.read_text())


# What a run ran on, not how fast: kept in baselines and compared, so that a time change that
# comes from a different kernel or dtype (a start-up probe's choice, `dtype: auto` on another
# CPU) is reported as such beside the verdict.
CONTEXT_KEYS = ("target", "dtype", "float32_linear", "bfloat16_linear", "block_linear")


def make_baseline(run_dirs: list[str | Path], out: str | Path, config: dict[str, Any]) -> dict[str, Any]:
    """Writes the baseline file from one or more runs' summary.json; returns it."""
    keep = set(config["metrics"]) | {config.get("reference_key", "time_reference_s")}
    runs = []
    for rd in run_dirs:
        s = load_summary(rd)
        kept = {k: v for k, v in s.items() if k in keep or k in CONTEXT_KEYS or k.startswith("reference_ratio_")}
        runs.append({"path": str(Path(rd).resolve()), "summary": kept})
    baseline = {"kind": "servelab-gate-baseline", "runs": runs}
    Path(out).write_text(json.dumps(baseline, indent=2))
    return baseline


@dataclass
class Check:
    metric: str
    baseline: float  # median of raw values
    current: float
    change: float  # relative change of the compared values (normalised when `normalised`)
    tolerance: float
    direction: str
    normalised: bool
    ci: tuple[float, float] | None
    regressed: bool

    def line(self) -> str:
        """One readable line, e.g. "REGRESSION mean_tpot_ms: 12.3 -> 19.8 (+61%, tolerance 10%)"."""
        tag = "REGRESSION" if self.regressed else "ok"
        change = "new" if not np.isfinite(self.change) else f"{self.change * 100:+.0f}%"
        extra = ", vs time reference" if self.normalised else ""
        if self.ci is not None:
            extra += f", 95% CI {self.ci[0] * 100:+.0f}%..{self.ci[1] * 100:+.0f}%"
        return (f"{tag} {self.metric}: {self.baseline:.4g} -> {self.current:.4g} "
                f"({change}, tolerance {self.tolerance * 100:.0f}%{extra})")  # fmt: skip


def _compared_values(
    summaries: list[dict[str, Any]], metric: str, kind: str, ref_key: str
) -> list[float] | None:
    """Per-run values normalised by the run's time reference, or None if one run lacks it."""
    out = []
    for s in summaries:
        if f"reference_ratio_{metric}" in s:
            out.append(float(s[f"reference_ratio_{metric}"]))
        elif s.get(ref_key):
            ref = float(s[ref_key])
            out.append(float(s[metric]) / ref if kind == "time" else float(s[metric]) * ref)
        else:
            return None
    return out


def median_change_interval(a: list[float], b: list[float], resampling: dict[str, Any]) -> tuple[float, float]:
    """Interval of (median(b) - median(a)) / |median(a)| over per-run values, each run one draw."""
    scale = abs(float(np.median(a))) or 1.0

    def change(xa: np.ndarray, xb: np.ndarray) -> np.ndarray:  # [batch, runs, 1] each
        return (np.nanmedian(xb[..., 0], axis=1) - np.nanmedian(xa[..., 0], axis=1)) / scale

    est = cluster_bootstrap([[[v] for v in a], [[v] for v in b]], change, resamples=int(resampling.get("resamples", 2000)),
                            confidence=float(resampling.get("confidence", 0.95)), seed=int(resampling.get("seed", 0)))  # fmt: skip
    return est.low, est.high


def _check_metric(
    metric: str,
    spec: dict[str, Any],
    base: list[dict[str, Any]],
    cur: list[dict[str, Any]],
    config: dict[str, Any],
) -> Check | None:
    base = [s for s in base if s.get(metric) is not None]
    cur = [s for s in cur if s.get(metric) is not None]
    if not base or not cur:
        return None
    kind, ref_key = spec.get("kind", "exact"), config.get("reference_key", "time_reference_s")
    a = b = None
    if kind in ("time", "rate"):
        a, b = _compared_values(base, metric, kind, ref_key), _compared_values(cur, metric, kind, ref_key)
    normalised = a is not None and b is not None
    if not normalised:
        a, b = [float(s[metric]) for s in base], [float(s[metric]) for s in cur]
    change = relative_change(float(np.median(a)), float(np.median(b)))
    worse = change if spec["direction"] == "lower" else -change
    tol = float(spec.get("tolerance", 0.0))
    regressed = worse > tol + EPS
    ci = None
    if len(a) >= 2 and len(b) >= 2:
        bs = config.get("bootstrap", {})
        ci = median_change_interval(a, b, bs)
        regressed = regressed and not (ci[0] <= 0.0 <= ci[1])
    raw_a, raw_b = (float(np.median([float(s[metric]) for s in x])) for x in (base, cur))
    return Check(metric, raw_a, raw_b, change, tol, spec["direction"], normalised, ci, regressed)


def check(baseline: dict[str, Any], summaries: list[dict[str, Any]], config: dict[str, Any]) -> list[Check]:
    """Every configured metric present on both sides, compared (see module docstring)."""
    base = [r["summary"] for r in baseline["runs"]]
    checks = [_check_metric(m, spec, base, summaries, config) for m, spec in config["metrics"].items()]
    return [c for c in checks if c is not None]


def context_notes(baseline: dict[str, Any], summaries: list[dict[str, Any]]) -> list[str]:
    """A line per `CONTEXT_KEYS` entry whose values differ between the baseline's runs and
    these, e.g. "NOTE float32_linear: baseline blas, now onednn-prepacked+gemv"."""
    base = [r["summary"] for r in baseline["runs"]]
    notes = []
    for key in CONTEXT_KEYS:
        was = sorted({str(s[key]) for s in base if key in s})
        now = sorted({str(s[key]) for s in summaries if key in s})
        if was and now and was != now:
            notes.append(f"NOTE {key}: baseline {', '.join(was)}, now {', '.join(now)} "
                         "(time metrics compare different configurations)")  # fmt: skip
    return notes


def write_verdicts(
    run_dirs: list[str | Path], checks: list[Check], baseline_path: str | Path, notes: list[str] | None = None
) -> None:
    """Writes gate.json (verdict, regressions, every check) into each run folder."""
    verdict = {
        "verdict": "fail" if any(c.regressed for c in checks) else "pass",
        "baseline": str(baseline_path),
        "runs": [str(r) for r in run_dirs],
        "regressions": [c.line() for c in checks if c.regressed],
        "notes": notes or [],
        "checks": [asdict(c) | {"change": c.change if np.isfinite(c.change) else None} for c in checks],
    }
    text = json.dumps(verdict, indent=2, default=float)
    for rd in run_dirs:
        (Path(rd) / "gate.json").write_text(text)
