"""servelab-calibrate (workloads/calibrate.py; issue 16 item 5).

Three workbench run folders with engine steps (simulated target: fast, and its step times come
from a known model) and one HTTP run folder (scraped gauges only, skipped with the reason)
give a profile with held-out fidelity; servelab-plan accepts the profile as its step model.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from workloads.calibrate import main

RUN = ["target=simulated", "sim.hardware=cpu-2core", "report.html=false", "run.time_reference=false",
       "workload.num_requests=24", "workload.warmup_requests=0", "workload.output_len.value=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from conf.schema import RunConfig, compose_typed
    from workloads.experiment import run_experiment

    root = tmp_path_factory.mktemp("runs")
    out = []
    for i, (rate, budget) in enumerate([(2, 64), (8, 256), (4, 128)]):
        cfg = compose_typed(RunConfig, "run", [*RUN, f"workload.arrival.rate={rate}",
                                               f"scheduler.max_num_batched_tokens={budget}"])
        assert not run_experiment(cfg, root / f"r{i}").error
        out.append(root / f"r{i}")
    http = root / "http"  # what an HTTP target leaves: scraped gauges, no step times
    http.mkdir()
    pd.DataFrame({"time": [0.0, 0.5], "num_running": [1, 2], "source": "metrics"}).to_csv(http / "steps.csv")
    return [*out, http]


def test_calibrate_writes_a_profile_plan_accepts(runs: list[Path], tmp_path: Path, capsys) -> None:
    profile = tmp_path / "profiles" / "mine.yaml"
    main([*map(str, runs), "--out", str(profile), "--holdout-every", "3"])
    out, err = capsys.readouterr()
    assert f"skipped {runs[-1]}: steps.csv has no engine step times" in err
    assert "held-out fidelity (held-out runs: " in out and str(runs[2]) in out
    data = yaml.safe_load(profile.read_text())
    assert data["kind"] == "calibrated" and data["meta"]["fitted_from"] == [str(r) for r in runs[:3]]
    held = data["meta"]["held_out"]
    assert held["steps"] > 0 and 0 <= held["median_abs_rel_error"] < 0.5

    from workloads.plan_cli import main as plan_main

    rc = plan_main(["--model", "smollm2", "--hardware", "cpu-2core", "--plain", "--num-requests", "8",
                    "--prompt-len", "32", "--output-len", "4", "--rates", "2", "--step-model", str(profile),
                    "--out", str(tmp_path / "plan")])
    assert rc == 0
    assert str(profile) in (tmp_path / "plan" / "plan.json").read_text()  # the plan ran on it


def test_no_usable_run_is_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--out", str(tmp_path / "p.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "servelab-calibrate: no run folder with engine steps (steps.csv with step_time) among the ones given"
