"""Sweeps: each Hydra job records its overrides; a callback gathers the jobs into sweep.csv.

The collector reads only job folders, so it works with any Hydra launcher (the basic one,
`hydra/launcher=joblib` for parallel local jobs, `submitit_slurm`, `ray`; docs/benchmarks.md):
the jobs may run in other processes or on other machines sharing the sweep folder. A job
whose run failed has an `error` cell (the first line of its error.txt); one that left no
summary.json and no error.txt (killed, or lost by the launcher) is listed as not finished.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SCALAR = (int, float, str, bool, type(None))


def write_job_overrides(run_dir: str | Path, overrides: list[str]) -> None:
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "overrides.json").write_text(json.dumps(overrides))


def saturated_below(job_dir: str | Path, overrides: list[str]) -> str | None:
    """Why this sweep job need not run: a finished sibling job with the same overrides but a lower
    request rate (an override whose key ends in `rate`) was saturated (workloads/saturation.py),
    so a higher rate only queues faster. None: run it. Sees the jobs finished so far (all of
    them with the sequential basic launcher; a parallel launcher may run a job it could skip)."""
    mine = _override_values(overrides)
    rate_key = next((k for k in mine if k.endswith("rate")), None)
    if rate_key is None:
        return None
    try:
        rate = float(mine[rate_key])
    except ValueError:
        return None
    for job in sorted(Path(job_dir).parent.iterdir()):
        other_path, summary_path = job / "overrides.json", job / "summary.json"
        if job == Path(job_dir) or not (other_path.exists() and summary_path.exists()):
            continue
        other = _override_values(json.loads(other_path.read_text()))
        same = {k: v for k, v in other.items() if k != rate_key} == {k: v for k, v in mine.items() if k != rate_key}
        try:
            lower = float(other.get(rate_key, "nan")) < rate
        except ValueError:
            continue
        if same and lower and json.loads(summary_path.read_text()).get("saturated") is True:
            return f"skipped: {rate_key}={other[rate_key]} was already saturated ({job.name})"
    return None


def _override_values(overrides: list[str]) -> dict[str, str]:
    out = {}
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key.startswith("hydra") or key == "sweep":
            continue
        out[key] = value
    return out


def collect_sweep(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per job folder holding a summary.json: the swept values + every scalar summary key."""
    rows = []
    for job in sorted(Path(sweep_dir).iterdir(), key=lambda p: p.name):
        summary_path = job / "summary.json"
        if not job.is_dir():
            continue
        row: dict[str, Any] = {"job": job.name, "run_dir": str(job)}
        overrides_path = job / "overrides.json"
        if overrides_path.exists():
            row |= _override_values(json.loads(overrides_path.read_text()))
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            row |= {k: v for k, v in summary.items() if isinstance(v, SCALAR)}
        err = job / "error.txt"
        if err.exists():  # a failed job, or one that stopped early (its partial summary is kept)
            row["error"] = err.read_text().strip().splitlines()[0] if err.read_text().strip() else "failed"
        elif not summary_path.exists():
            row["error"] = "no summary.json (the job did not finish: killed, or its launcher failed)"
        rows.append(row)
    return pd.DataFrame(rows)


def write_sweep(sweep_dir: str | Path) -> Path:
    df = collect_sweep(sweep_dir)
    path = Path(sweep_dir) / "sweep.csv"
    df.to_csv(path, index=False)
    return path


class SweepCollector(Callback):
    """Hydra callback: after a multirun, write sweep.csv and the sweep report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        path = write_sweep(sweep_dir)
        print(f"sweep table: {path}")
        try:
            from reports.sweep import build_sweep_report

            options = config.get("report")
            report_cfg = OmegaConf.to_container(options, resolve=True) if options is not None else None
            print(f"sweep report: {build_sweep_report(sweep_dir, report_cfg)}")  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the table is written; say why the page is not
            print(f"sweep report failed: {type(exc).__name__}: {exc}")
