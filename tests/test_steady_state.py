"""Steady-state window and time slices (analysis/steady_state.py), in summary.json and the
run report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analysis.record import RequestRecord
from analysis.steady_state import csv_frame, request_frame, steady_summary, steady_window, time_slices


def _run(
    n: int = 33, gap: float = 0.25, tokens: int = 10, ttft: float = 0.1, last: float = 2.0
) -> list[RequestRecord]:
    """A request sent every `gap` s, each `tokens` tokens from `ttft` to `last` s after its send:
    8 in flight from 2 s to 8 s, a ramp-up before and a drain after."""
    recs = []
    for i in range(n):
        t = i * gap
        times = [t + ttft + k * (last - ttft) / (tokens - 1) for k in range(tokens)]
        recs.append(RequestRecord(f"r{i}", t, t, token_times=times, done_s=t + last, prompt_tokens=4,
                                  output_tokens=tokens, finish_reason="length"))  # fmt: skip
    return recs


def test_window_is_the_plateau_and_its_figures_leave_out_ramp_and_drain() -> None:
    recs = _run()
    frame = request_frame(recs)
    window = steady_window(frame)
    assert not isinstance(window, str)
    t0, t1 = window
    assert t0 == pytest.approx(2.0, abs=0.3) and t1 == pytest.approx(8.0, abs=0.3)
    s = steady_summary(recs)
    # 4 requests a second x 10 tokens: 40 tok/s on the plateau, 330 tokens over 10 s for the run
    assert s["steady_output_throughput"] == pytest.approx(40.0, rel=0.05)
    assert s["steady_mean_in_flight"] == pytest.approx(8.0, abs=0.3)
    assert s["steady_request_throughput"] == pytest.approx(4.0, rel=0.1)
    assert s["steady_mean_ttft_ms"] == pytest.approx(100.0) and s["steady_p99_tpot_ms"] == pytest.approx(
        1900 / 9
    )
    sent = [r for r in recs if t0 <= r.start_s < t1]
    assert s["steady_requests"] == len(sent) == s["steady_completed"]


def test_no_window_without_a_plateau() -> None:
    assert "too few" in steady_summary(_run(n=5))["steady_state"]
    # all sent at once, then a long drain: in flight only falls
    recs = [RequestRecord(f"r{i}", 0, 0, token_times=[0.1, 0.1 + i], done_s=0.1 + i, output_tokens=2)
            for i in range(40)]  # fmt: skip
    assert "no plateau" in steady_summary(recs)["steady_state"]


def test_time_slices_add_up_to_the_run() -> None:
    frame = request_frame(_run())
    slices = time_slices(frame, 1.0)
    assert len(slices) == 11 and slices["slice_start_s"].tolist()[:2] == [0.0, 1.0]
    assert (slices["output_throughput"] * 1.0).sum() == pytest.approx(330)
    assert slices["requests"].sum() == 33
    assert len(time_slices(frame)) == 11  # default: about ten slices of a round size (1 s here)


def test_summary_and_report_carry_the_steady_state(tmp_path: Path) -> None:
    from conf.schema import RunConfig, compose_typed
    from reports.run_report import build_report
    from workloads.experiment import run_experiment

    cfg = compose_typed(RunConfig, "run", [
        "target=simulated", "sim.hardware=h200", "sim.gpu_memory_utilization=0.005", "report.html=false",
        "run.time_reference=false", "run.time_slice_s=0.5", "workload=fixed", "workload.num_requests=200",
        "workload.prompt_len.value=256", "workload.output_len.value=64", "workload.arrival.rate=40",
        "workload.arrival.process=poisson",
    ])  # fmt: skip
    assert not run_experiment(cfg, tmp_path).error
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steady_state"] == "found" and summary["saturated"] is False
    assert summary["steady_start_s"] < summary["steady_end_s"] and summary["steady_requests"] >= 10
    # the run's own frame read back from requests.csv gives the same figures
    again = steady_window(csv_frame(pd.read_csv(tmp_path / "requests.csv")))
    assert again == pytest.approx((summary["steady_start_s"], summary["steady_end_s"]))
    page = build_report(tmp_path).read_text()
    assert (
        "Steady state and time slices" in page
        and "slices of 0.5 s" in page
        and "could not render" not in page
    )


def test_an_older_requests_csv_without_token_times_or_errors_still_has_a_window() -> None:
    recs = _run()
    old = pd.DataFrame({"start_s": [r.start_s for r in recs], "done_s": [r.done_s for r in recs],
                        "ttft_ms": [100.0] * len(recs)})  # fmt: skip
    frame = csv_frame(old)
    assert frame["ok"].all() and steady_window(frame) == steady_window(request_frame(recs))
