"""servelab-compare: change and "beyond noise?" per summary metric (issue 37 item 3: runs, then
requests within a run; too few runs is said; `--runs N` makes the runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from report_fixtures import make_run

from reports.compare import TOO_FEW, change_interval, compare
from reports.gate import load_gate_config
from workloads import compare_runs
from workloads.compare_cli import compare_main

TESTS = Path(__file__).resolve().parent


def test_one_run_a_side_is_too_few_to_tell_noise(tmp_path):
    a = make_run(tmp_path / "a", profile=False, telemetry=False)
    b = make_run(tmp_path / "b", slow=1.5, profile=False, telemetry=False)
    df = compare(a, b, load_gate_config()).set_index("metric")
    assert df.loc["median_tpot_ms", "change_pct"] == pytest.approx(50, rel=1e-6)
    # one run a side: its luck cannot be told from an effect, whatever the requests say
    assert df.loc["median_tpot_ms", "beyond_noise"] == TOO_FEW == "too few runs to tell noise"
    assert df.loc["output_throughput", "beyond_noise"] == TOO_FEW
    # exact metrics do not depend on the machine: they keep their verdict
    assert df.loc["num_steps", "method"].startswith("exact, tolerance")
    same = compare(a, a, load_gate_config())
    assert (same["beyond_noise"].isin(["no", TOO_FEW])).all() and (same["change_pct"] == 0).all()


def test_three_runs_a_side_resample_runs_then_requests(tmp_path):
    for i in range(3):
        make_run(tmp_path / "A" / f"r{i}", seed=i, profile=False, telemetry=False)
        make_run(tmp_path / "B" / f"r{i}", seed=10 + i, slow=1.5, profile=False, telemetry=False)
        make_run(tmp_path / "C" / f"r{i}", seed=20 + i, profile=False, telemetry=False)
    df = compare(tmp_path / "A", tmp_path / "B", load_gate_config()).set_index("metric")
    assert df.loc["median_tpot_ms", "method"].startswith("bootstrap over runs, then requests within each")
    assert df.loc["median_tpot_ms", "beyond_noise"] == "yes"
    assert df.loc["output_throughput", "method"].startswith("bootstrap over runs, CI")
    assert df.loc["p99_itl_ms", "method"].startswith("bootstrap over runs, CI")  # gaps: per-run values
    assert 0 < df.loc["mean_ttft_ms", "A_cv"] < 0.5
    same = compare(tmp_path / "A", tmp_path / "C", load_gate_config()).set_index("metric")
    assert same.loc["median_tpot_ms", "beyond_noise"] == "no"


def test_run_luck_widens_the_interval_that_pooled_requests_would_narrow():
    """Three runs a side, no effect, but each run carries its own offset (+-8%): resampling runs
    first spans 0; treating the requests as independent (each its own cluster) gives an interval
    less than half as wide, which the runs' luck would pass for an effect."""
    rng = np.random.default_rng(4)
    a = [rng.normal(100 * f, 3, 200) for f in (0.92, 1.0, 1.08)]
    b = [rng.normal(100 * f, 3, 200) for f in (1.07, 1.02, 0.97)]
    runs_first = change_interval(a, b, "median")
    assert runs_first.low < 0 < runs_first.high
    pooled = change_interval([np.concatenate(a)[i::150] for i in range(150)],
                             [np.concatenate(b)[i::150] for i in range(150)], "median")  # fmt: skip
    assert pooled.high - pooled.low < (runs_first.high - runs_first.low) / 2


def test_compare_cli_prints_table_and_html(tmp_path, capsys):
    a = make_run(tmp_path / "a", profile=False, telemetry=False)
    out = tmp_path / "cmp.html"
    assert compare_main([str(a), str(a), "--html", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean_tpot_ms" in text and "beyond_noise" in text
    assert 'id="comparison"' in out.read_text()
    assert compare_main([str(a), str(tmp_path / "missing")]) == 2
    assert compare_main([str(a)]) == 2  # one folder and no --runs


# A scripted servelab-run: writes a fixture run folder at hydra.run.dir, `slow=` from the overrides.
FAKE_RUN = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
from report_fixtures import make_run
args = dict(a.split("=", 1) for a in sys.argv[1:])
if args.get("fail"):
    sys.exit("servelab-run: no such target")
run = Path(args["hydra.run.dir"])
seed = int(run.name.split("_")[1]) + (10 if run.parent.name == "b" else 0)
make_run(run, n=12, seed=seed, slow=float(args.get("slow", 1)), profile=False, telemetry=False)
"""


@pytest.fixture
def fake_servelab_run(tmp_path, monkeypatch):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(compare_runs, "SERVELAB_RUN", (sys.executable, str(script)))
    return script


def test_runs_repeats_two_configurations_then_compares(tmp_path, fake_servelab_run, capsys):
    out = tmp_path / "cmp"
    assert compare_main(["--runs", "3", "slow=1", "slow=1.5", "--out", str(out)]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("*/run_*")) == [
        "a/run_0", "a/run_1", "a/run_2", "b/run_0", "b/run_1", "b/run_2"]
    text = capsys.readouterr().out
    assert "B run 2/3" in text and "A_cv" in text and (out / "compare.csv").exists()
    row = next(line for line in text.splitlines() if line.startswith("median_tpot_ms"))
    assert " yes " in row and "runs, then requests" in row


def test_runs_of_one_configuration_report_mean_cv_and_interval(tmp_path, fake_servelab_run, capsys):
    out = tmp_path / "one"
    assert compare_main(["--runs", "3", "slow=1", "--out", str(out)]) == 0
    df = compare_runs.repeatability(out / "a").set_index("metric")
    ttft = df.loc["mean_ttft_ms"]
    assert ttft["runs"] == 3 and ttft["ci_low"] < ttft["mean"] < ttft["ci_high"] and 0 < ttft["cv"] < 0.5
    assert "ci_high" in capsys.readouterr().out
    assert compare_main(["--runs", "1", "fail=1", "--out", str(tmp_path / "bad")]) == 2
    assert "no such target" in capsys.readouterr().err
