"""Sweeps through a Hydra launcher plugin (issue 16 item 6).

A 2-job sweep runs through `hydra/launcher=joblib` (two worker processes); the sweep collector
still writes one sweep.csv and one report, and the job that failed (an unknown simulated
hardware) is listed in both with its error. The simulated target keeps it fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_joblib_sweep_collects_both_jobs_and_names_the_failure(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher not installed")
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.cli", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "target=simulated", "sim.hardware=h200,no_such_gpu", "sim.gpu_memory_utilization=0.01",
         "workload=fixed", "workload.num_requests=4", "workload.prompt_len.value=16",
         "workload.output_len.value=4", "run.time_reference=false", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    df = pd.read_csv(sweep / "sweep.csv")
    assert sorted(df["sim.hardware"]) == ["h200", "no_such_gpu"]
    ok = df[df["sim.hardware"] == "h200"].iloc[0]
    bad = df[df["sim.hardware"] == "no_such_gpu"].iloc[0]
    assert ok["completed"] == 4 and pd.isna(ok.get("error"))
    assert "no_such_gpu" in bad["error"]
    page = (sweep / "report.html").read_text()
    assert "Failed jobs" in page and "no_such_gpu" in page and "1 of 2 jobs failed" in page


def test_rate_sweep_stops_climbing_past_the_first_saturated_rate(tmp_path: Path) -> None:
    """Basic launcher (jobs in order): 20000 req/s saturates the simulated H200 sliver, so the
    40000 req/s job is skipped, named in sweep.csv; 50 req/s ran and is not saturated."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.cli", "-m", "workload.arrival.rate=50,20000,40000",
         "target=simulated", "sim.hardware=h200", "sim.gpu_memory_utilization=0.005", "workload=fixed",
         "workload.num_requests=120", "workload.prompt_len.value=2048", "workload.output_len.value=16",
         "workload.arrival.process=poisson", "run.time_reference=false", "report.html=false",
         f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    df = pd.read_csv(sweep / "sweep.csv").set_index("workload.arrival.rate")
    assert bool(df.loc[50, "saturated"]) is False and bool(df.loc[20000, "saturated"]) is True
    assert "already saturated" in df.loc[40000, "error"] and pd.isna(df.loc[40000].get("completed"))
