"""`servelab-compare --runs N A [B]`: each configuration run N times afresh, then compared.

A configuration is a file of `key=value` overrides or the overrides themselves separated by
spaces (as servelab-ab takes them). Each run is its own `servelab-run` process (fresh
processes: a process's placement luck stays with that run) writing `<out>/a/run_<k>` (and
`<out>/b/run_<k>`), the configurations taking turns (A B, B A, ...) so a drift of the
machine's load falls on both. With one configuration the table is its repeatability: per
summary metric the mean over the runs, the standard deviation, the coefficient of variation
and Student's t interval of the mean (`analysis.stats.mean_interval`), as vLLM's sweeps and
AIPerf's multi-run mode report them. With two, the runs are compared (`reports.compare`). It
lives in `workloads` because it runs experiments; `reports` only reads the folders.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.stats import coefficient_of_variation, mean_interval
from reports.run_data import load_run, numeric_summary
from workloads.ab import read_overrides

SERVELAB_RUN = (sys.executable, "-m", "workloads.cli")


def run_configurations(
    configs: Sequence[list[str]], runs: int, out: Path, command: Sequence[str] | None = None,
) -> list[Path]:
    """`runs` runs of each configuration (overrides) into `out/<a|b>/run_<k>`; the side folders.

    `command` is servelab-run's (default `SERVELAB_RUN`); it gets the overrides and
    `hydra.run.dir=<run folder>`. ValueError (one line) when a run fails."""
    command = SERVELAB_RUN if command is None else command
    if runs < 1:
        raise ValueError(f"--runs: expected at least 1, got {runs}")
    sides = [out / name for name in "ab"[: len(configs)]]
    for k in range(runs):
        order = list(zip(sides, configs, strict=True))
        for side, overrides in order if k % 2 == 0 else order[::-1]:
            run_dir = side / f"run_{k}"
            print(f"servelab-compare: {side.name.upper()} run {k + 1}/{runs} -> {run_dir}", flush=True)
            res = subprocess.run([*command, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
            if res.returncode != 0 or not (run_dir / "summary.json").exists():
                last = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
                raise ValueError(f"run {run_dir} failed: {last[0]}")
    return sides


def repeatability(side: Path, confidence: float = 0.95) -> pd.DataFrame:
    """Per numeric summary metric of the runs under `side`: runs, mean, std, CV, t interval of the mean."""
    summaries = [numeric_summary(load_run(d).summary) for d in sorted(side.iterdir()) if (d / "summary.json").exists()]
    metrics = [k for k in summaries[0] if all(k in s for s in summaries)] if summaries else []
    rows = []
    for k in metrics:
        values = np.array([s[k] for s in summaries])
        low, high = mean_interval(values, confidence)
        std = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
        rows.append((k, len(values), float(values.mean()), std, coefficient_of_variation(values), low, high))
    return pd.DataFrame(rows, columns=["metric", "runs", "mean", "std", "cv", "ci_low", "ci_high"])


def default_out() -> Path:
    return Path("runs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")


def configurations(a: str, b: str | None) -> list[list[str]]:
    return [read_overrides(a)] + ([read_overrides(b)] if b is not None else [])
