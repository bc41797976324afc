"""Loads a run folder (the workbench's file schema) for reports, tolerating gaps.

Contract: `load_run(path)` never raises for a missing or unreadable optional file;
it records why in `RunData.problems` and leaves the attribute None. It raises
`RunFolderError` only when `path` is not a folder. Reports read only these files,
never the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml


class RunFolderError(Exception):
    """The path given is not a run folder."""


@dataclass
class RunData:
    path: Path
    config: dict[str, Any] | None = None
    requests: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None
    summary: dict[str, Any] | None = None
    kernels: pd.DataFrame | None = None
    telemetry: pd.DataFrame | None = None
    telemetry_info: dict[str, Any] | None = None
    error: str | None = None  # error.txt content
    problems: dict[str, str] = field(default_factory=dict)  # file name -> why it was not loaded

    @property
    def name(self) -> str:
        return self.path.name

    def slo(self) -> dict[str, float]:
        """The configured SLOs that are set, e.g. {"ttft_ms": 400.0}."""
        slo = (self.config or {}).get("slo") or {}
        return {
            k: float(v) for k, v in slo.items() if v is not None and k in ("ttft_ms", "tpot_ms", "e2el_ms")
        }

    def measured_requests(self) -> pd.DataFrame | None:
        """Requests without warm-up ones."""
        if self.requests is None:
            return None
        req = self.requests
        if "is_warmup" in req:
            req = req[~req["is_warmup"].map(_truthy)]
        return req

    def completed_requests(self) -> pd.DataFrame | None:
        """Measured requests without an error and with a TTFT."""
        req = self.measured_requests()
        if req is None:
            return None
        ok = req["error"].astype(object).fillna("").astype(str).str.len() == 0 if "error" in req else True
        if "ttft_ms" in req:
            ok = ok & req["ttft_ms"].notna()
        return req[ok]


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes")
    return bool(v) and not (isinstance(v, float) and np.isnan(v))


def _read(run: RunData, name: str, reader: Any) -> Any:
    path = run.path / name
    if not path.exists():
        run.problems[name] = "missing"
        return None
    try:
        return reader(path)
    except Exception as e:  # a truncated file from an interrupted run must not stop the report
        run.problems[name] = f"unreadable ({type(e).__name__}: {e})"
        return None


def _read_csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) or {}


def load_run(path: str | Path) -> RunData:
    """Reads every file of the run folder that exists (see the module contract)."""
    p = Path(path)
    if not p.is_dir():
        raise RunFolderError(f"not a run folder: {p}")
    run = RunData(path=p)
    run.config = _read(run, "config.yaml", _read_yaml)
    run.requests = _read(run, "requests.csv", _read_csv)
    run.steps = _read(run, "steps.csv", _read_csv)
    run.summary = _read(run, "summary.json", _read_json)
    run.kernels = _read(run, "kernels.csv", _read_csv)
    run.telemetry = _read(run, "telemetry.csv", _read_csv)
    run.telemetry_info = _read(run, "telemetry.json", _read_json)
    err = p / "error.txt"
    if err.exists():
        run.error = err.read_text(errors="replace").strip() or "(error.txt is empty)"
    return run


def numeric_summary(summary: dict[str, Any] | None) -> dict[str, float]:
    """Numeric scalar entries of a summary.json (bools excluded)."""
    out = {}
    for k, v in (summary or {}).items():
        if isinstance(v, int | float) and not isinstance(v, bool) and v is not None:
            out[k] = float(v)
    return out
