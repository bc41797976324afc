"""Over-saturation (workloads/saturation.py): found from in-flight requests and TTFT that keep
rising, marked in summary.json, a run stopped early with run.stop_when_saturated, and a rate
search that stops climbing at the first saturated rate."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from workloads.driver import Driver
from workloads.rate_search import SLO, find_max_rate
from workloads.saturation import SaturationMonitor, detect
from workloads.spec import RequestSpec
from workloads.targets.scripted import Script, ScriptedTarget


def _queue(rate: float, service_rate: float, n: int, service_s: float = 0.05) -> tuple[list, list, list]:
    """Times of a single-server FIFO queue: arrivals every 1/rate, one start every 1/service_rate."""
    sends = np.arange(n) / rate
    firsts, free = [], 0.0
    for s in sends:
        free = max(free, s) + 1 / service_rate
        firsts.append(free)
    firsts = np.array(firsts)
    return sends.tolist(), firsts.tolist(), (firsts + service_s).tolist()


def test_detect_tells_a_growing_queue_from_a_steady_one() -> None:
    s, f, e = _queue(rate=100, service_rate=25, n=300)
    v = detect(s, f, e, now=s[-1])
    assert v.saturated and v.rho_in_flight > 0.9 and v.rho_ttft > 0.9, v.reason
    s, f, e = _queue(rate=20, service_rate=25, n=300)
    assert not detect(s, f, e, now=s[-1]).saturated
    # long requests ramp the in-flight count up for a third of the run, then it settles; TTFT never rises
    rng = np.random.default_rng(0)
    s = np.sort(rng.uniform(0, 30, 600))
    f = s + rng.uniform(0.01, 0.03, 600)
    v = detect(s, f, f + 10.0, now=float(s[-1]))
    assert not v.saturated, v.reason
    assert not detect(s[:5], f[:5], f[:5], now=1.0).saturated  # too few to tell


def _specs(n: int, rate: float) -> list[RequestSpec]:
    return [RequestSpec(f"r-{i}", i / rate, "x", None, 4, 2) for i in range(n)]


def _queued_script(rate: float, service_rate: float):
    """A scripted server that starts one request every 1/service_rate seconds (FIFO)."""

    def script(spec: RequestSpec) -> Script:
        i = int(spec.request_id.split("-")[1])
        return Script(ttft_s=max(0.0, (i + 1) / service_rate - i / rate), chunk_gap_s=0.001)

    return script


def test_driver_stops_a_saturated_open_loop_early() -> None:
    monitor = SaturationMonitor(check_interval_s=0.1, min_duration_s=0.6)
    target = ScriptedTarget(script=_queued_script(rate=100, service_rate=25))
    result = asyncio.run(Driver(target, saturation=monitor).run(_specs(300, rate=100)))
    assert result.stop_reason == "saturated" and monitor.verdict is not None and monitor.verdict.saturated
    assert result.wall_s < 2.5  # the 300 sends would take 3 s and their answers 12 s
    assert any(r.error for r in result.records)  # the ones in flight were cut

    monitor = SaturationMonitor(check_interval_s=0.1, min_duration_s=0.3)
    steady = ScriptedTarget(default=Script(ttft_s=0.005, chunk_gap_s=0.001))
    result = asyncio.run(Driver(steady, saturation=monitor).run(_specs(80, rate=100)))
    assert result.stop_reason == "" and len(result.records) == 80 and not any(r.error for r in result.records)


@pytest.mark.parametrize(("rate", "saturated"), [(50.0, False), (20000.0, True)])
def test_summary_marks_a_simulated_run(tmp_path: Path, rate: float, saturated: bool) -> None:
    from conf.schema import RunConfig, compose_typed
    from workloads.experiment import run_experiment

    cfg = compose_typed(RunConfig, "run", [
        "target=simulated", "sim.hardware=h200", "sim.gpu_memory_utilization=0.005", "report.html=false",
        "run.time_reference=false", "workload=fixed", "workload.num_requests=120", "workload.prompt_len.value=2048",
        "workload.output_len.value=16", f"workload.arrival.rate={rate}", "workload.arrival.process=poisson",
    ])  # fmt: skip
    assert not run_experiment(cfg, tmp_path).error
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["saturated"] is saturated, summary["saturation"]


def test_rate_search_stops_at_the_first_saturated_rate() -> None:
    tried: list[float] = []

    def run(rate: float) -> dict:
        tried.append(rate)
        # latency looks fine at every rate (the run was short), but above 10 req/s the queue grows
        return {"p99_ttft_ms": 100.0, "saturated": rate > 10}

    result = find_max_rate(run, SLO(max={"p99_ttft_ms": 1000}), start=1.0, rel_tol=0.05)
    assert 9.5 <= result.max_rate <= 10 and max(tried) == 16
    assert any("saturated" in v for e in result.evaluations for v in e.violations)


def test_plan_rates_stop_climbing_past_the_first_saturated_rate(tmp_path: Path) -> None:
    from workloads.plan_cli import main as plan_main

    out = tmp_path / "plan"
    argv = ["--model", "smollm2", "--hardware", "h100", "--tp", "1", "--plain", "--num-requests", "40",
            "--prompt-len", "96", "--output-len", "16", "--rates", "4000,2,8000", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "4", "--out", str(out)]  # fmt: skip
    assert plan_main(argv) == 0
    rows = json.loads((out / "plan.json").read_text())["rows"]
    assert [(r["rate"], r["saturated"]) for r in rows] == [(2, False), (4000, True)]  # 8000 never ran
    assert "saturated" in rows[1]["violations"] and not rows[1]["meets_slo"]


def test_warm_up_counts_in_neither_the_monitor_nor_the_summary() -> None:
    """One rule for both (issue 60 item 6): a cold start queues the warm-up requests (served one
    every 40 ms while they arrive every 10 ms: in flight and TTFT climb, the look of an
    over-saturated run), then the measured requests are answered at once. The summary leaves
    warm-up out and finds no saturation; the monitor must not stop the run on the warm-up."""
    from workloads.saturation import saturation_summary

    warm, measured, rate, cold_rate = 60, 100, 100.0, 25.0
    specs = [RequestSpec(f"w-{i}", i / rate, "x", None, 4, 2, is_warmup=True) for i in range(warm)]
    specs += [RequestSpec(f"r-{i}", (warm + i) / rate, "x", None, 4, 2) for i in range(measured)]

    def script(spec: RequestSpec) -> Script:
        kind, i = spec.request_id.split("-")
        if kind == "w":  # FIFO behind the cold start
            return Script(ttft_s=max(0.0, (int(i) + 1) / cold_rate - int(i) / rate), chunk_gap_s=0.001)
        return Script(ttft_s=0.005, chunk_gap_s=0.001)

    monitor = SaturationMonitor(check_interval_s=0.05, min_duration_s=0.4)
    result = asyncio.run(Driver(ScriptedTarget(script=script), saturation=monitor).run(specs))
    assert result.stop_reason == "", (result.stop_reason, monitor.verdict)
    summary = saturation_summary(result.records)
    assert summary["saturated"] is False, summary["saturation"]
    assert len(result.records) == warm + measured and not any(r.error for r in result.records)
    assert monitor.verdict is not None and not monitor.verdict.saturated
