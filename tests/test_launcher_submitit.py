"""The 2x2 sweep through `hydra/launcher=submitit_local` (issue 43 item 2).

submitit's local mode runs each job as its own process, as its SLURM mode runs each as a job on
the cluster (docs/distributed.md, "From one machine to a cluster", has the SLURM form). The sweep
folder, sweep.csv and the sweep report must equal the basic launcher's (tests/launcher_sweep.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launcher_sweep import ROOT, assert_same_sweep, basic_sweep, run_sweep


def test_submitit_local_sweep_equals_the_basic_launchers(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher missing (the `cluster` extra; scripts/setup.sh --test installs it)")
    basic, local = basic_sweep(), tmp_path / "submitit"
    run_sweep(local, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1",
                      "hydra.launcher.gpus_per_node=0", f"hydra.launcher.submitit_folder={tmp_path}/submitit_jobs/%j"])
    assert_same_sweep(local, basic)
    # each job ran as a submitit job of its own: one folder with its result pickle per job
    results = sorted((tmp_path / "submitit_jobs").glob("*/*_result.pkl"))
    assert len(results) == 4, sorted(p.name for p in (tmp_path / "submitit_jobs").rglob("*"))


def test_the_documented_slurm_command_composes() -> None:
    """docs/distributed.md's SLURM command (no SLURM here): its overrides give the SLURM launcher
    the partition, GPUs per task and time limit it names."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher missing (the `cluster` extra; scripts/setup.sh --test installs it)")
    text = (ROOT / "docs" / "distributed.md").read_text()
    start = text.index("servelab-run -m", text.index("# SLURM"))
    command = re.sub(r"\\\n\s*", " ", text[start:]).split("\n", 1)[0].split()
    overrides = [o for o in command[2:] if "," not in o]  # the swept values need -m; --cfg shows one job
    assert "hydra/launcher=submitit_slurm" in overrides
    proc = subprocess.run([sys.executable, "-m", "workloads.cli", *overrides, "--cfg", "hydra", "-p", "hydra.launcher"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    launcher = yaml.safe_load(proc.stdout)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert launcher["partition"] == "gpu" and launcher["gpus_per_task"] == 1 and launcher["timeout_min"] == 60
