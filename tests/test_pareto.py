"""The Pareto front of output tokens/s per user against per instance (reports/pareto.py), in
the sweep report and in servelab-plan's outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from reports.pareto import PER_DEVICE, PER_INSTANCE, PER_USER, front_mask, pareto_points
from reports.sweep import build_sweep_report
from workloads.plan_cli import main as plan_main


def test_front_mask_by_hand() -> None:
    # (throughput, per-user): (1,10) (2,8) (2,5) dominated by (2,8); (3,3); (1,9) dominated by (1,10).
    x, y = [1, 2, 2, 3, 1, float("nan")], [10, 8, 5, 3, 9, 100]
    assert front_mask(x, y).tolist() == [True, True, False, True, False, False]
    assert front_mask([1, 1], [2, 2]).tolist() == [True, True]  # equal points dominate nothing


def test_points_per_user_instance_and_device() -> None:
    rows = pd.DataFrame({"output_throughput": [100.0, 400.0, 300.0], "mean_tpot_ms": [10.0, 40.0, 50.0]})
    p = pareto_points(rows, ["a", "b", "c"], devices=[2, 2, 2])
    assert p[PER_USER].tolist() == pytest.approx([100.0, 25.0, 20.0])
    assert p[PER_INSTANCE].tolist() == [100.0, 400.0, 300.0] and p[PER_DEVICE].tolist() == [
        50.0,
        200.0,
        150.0,
    ]
    assert p["on_front"].tolist() == [True, True, False]
    assert PER_DEVICE not in pareto_points(rows, ["a", "b", "c"])


def test_sweep_report_has_the_pareto_section(tmp_path: Path) -> None:
    rows = []
    for i, (seqs, rate, tput, tpot) in enumerate(
        [(4, 1, 90, 10), (4, 8, 300, 30), (16, 8, 280, 35), (16, 32, 500, 60)]
    ):
        job = tmp_path / str(i)
        job.mkdir()
        (job / "config.yaml").write_text(
            "target: {kind: simulated}\nsim: {tp: 4}\nparallel: {tensor_parallel_size: 1}\n"
        )
        rows.append(
            {
                "job": i,
                "scheduler.max_num_seqs": seqs,
                "workload.arrival.rate": rate,
                "output_throughput": tput,
                "mean_tpot_ms": tpot,
                "p99_ttft_ms": 5 * tpot,
                "p99_tpot_ms": 2 * tpot,
                "p99_itl_ms": 2 * tpot,
                "p99_e2el_ms": 99 * tpot,
                "completed": 8,
                "run_dir": str(job),
            }
        )
    pd.DataFrame(rows).to_csv(tmp_path / "sweep.csv", index=False)
    page = build_sweep_report(tmp_path).read_text()
    assert "Pareto front: speed per user against throughput per instance" in page
    assert "3 of 4 points on the front" in page  # (16 seqs, 8/s) is slower and lower than (4, 8/s)
    assert "scheduler.max_num_seqs=16, workload.arrival.rate=32" in page and PER_DEVICE in page
    assert "could not render" not in page


def test_a_skipped_or_saturated_job_is_neither_a_point_nor_the_best(tmp_path: Path) -> None:
    # A rate sweep that stopped at its saturated rate: 50/s measured, 20000/s saturated (the
    # highest throughput, but the target no longer kept up), 40000/s skipped without figures.
    rows = [
        {"job": 0, "workload.arrival.rate": 50, "output_throughput": 300.0, "mean_tpot_ms": 20.0,
         "p99_ttft_ms": 50.0, "p99_tpot_ms": 30.0, "p99_itl_ms": 30.0, "p99_e2el_ms": 900.0,
         "completed": 8, "saturated": False, "error": ""},
        {"job": 1, "workload.arrival.rate": 20000, "output_throughput": 900.0, "mean_tpot_ms": 25.0,
         "p99_ttft_ms": 60.0, "p99_tpot_ms": 35.0, "p99_itl_ms": 35.0, "p99_e2el_ms": 950.0,
         "completed": 8, "saturated": True, "error": ""},
        {"job": 2, "workload.arrival.rate": 40000, "completed": 0, "saturated": None,
         "error": "skipped: rate 20000 already saturated"},
    ]  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "sweep.csv", index=False)
    page = build_sweep_report(tmp_path).read_text()
    assert "2 of 2 points on the front" in page and "1 job(s) without figures (skipped or failed) left out" in page
    assert "1 saturated job(s) excluded" in page
    assert "Best: workload.arrival.rate=50 " in page and "Best: workload.arrival.rate=20000" not in page


def test_plan_writes_the_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    argv = ["--model", "smollm2", "--hardware", "h100", "--tp", "3", "--plain", "--num-requests", "24",
            "--prompt-len", "96", "--output-len", "16", "--rates", "2,200", "--max-num-batched-tokens", "64,512",
            "--max-num-seqs", "4", "--out", str(out)]  # fmt: skip
    assert plan_main(argv) == 0
    assert "pareto front (" in capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    points = plan["pareto"]
    assert len(points) == 4 and any(p["on_front"] for p in points)
    for p, r in zip(points, plan["rows"], strict=True):
        assert p[PER_USER] == pytest.approx(1000 / r["mean_tpot_ms"])
        assert p[PER_DEVICE] == pytest.approx(r["output_throughput"] / 3)
        assert p["config"].startswith(f"budget {r['max_num_batched_tokens']}, seqs 4 @ ")
    html = (out / "plan.html").read_text()
    assert "<h2>Pareto front</h2>" in html and "data:image/png;base64," in html
