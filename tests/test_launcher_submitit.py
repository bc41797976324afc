"""The 2x2 sweep through `hydra/launcher=submitit_local` (issue 43 item 2).

submitit's local mode runs each job as its own process, as its SLURM mode runs each as a job on
the cluster (docs/distributed.md, "From one machine to a cluster", has the SLURM form). The sweep
folder, sweep.csv and the sweep report must equal the basic launcher's (tests/launcher_sweep.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher_sweep import assert_same_sweep, run_sweep


def test_submitit_local_sweep_equals_the_basic_launchers(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher missing (the `cluster` extra; scripts/setup.sh --test installs it)")
    basic, local = tmp_path / "basic", tmp_path / "submitit"
    run_sweep(basic, [])
    run_sweep(local, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1",
                      "hydra.launcher.gpus_per_node=0", f"hydra.launcher.submitit_folder={tmp_path}/submitit_jobs/%j"])
    assert_same_sweep(local, basic)
    # each job ran as a submitit job of its own: one folder with its result pickle per job
    results = sorted((tmp_path / "submitit_jobs").glob("*/*_result.pkl"))
    assert len(results) == 4, sorted(p.name for p in (tmp_path / "submitit_jobs").rglob("*"))
