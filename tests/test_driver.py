"""The load driver: open-loop timing, closed loop, bounds, and metrics end to end."""

import asyncio
import time

import pytest
from test_metrics import target as metric_target
from test_metrics import workload as metric_workload

from analysis.metrics import summarize
from workloads.driver import Driver, run_workload
from workloads.spec import RequestSpec
from workloads.targets.scripted import Script, ScriptedTarget

SLACK = 0.03  # seconds of scheduling noise tolerated on a shared 2-core machine


def spec(i: int, t: float, max_tokens: int = 2) -> RequestSpec:
    return RequestSpec(f"r{i}", t, None, [1, 2], 2, max_tokens)


def test_slow_response_does_not_delay_next_send():
    slow = {"r0": Script(ttft_s=0.6, output_tokens=1)}
    tgt = ScriptedTarget(Script(ttft_s=0.01, output_tokens=1), script=lambda s: slow.get(s.request_id, tgt.default))
    specs = [spec(0, 0.0), spec(1, 0.05), spec(2, 0.1), spec(3, 0.15)]
    result = asyncio.run(run_workload(specs, tgt))
    recs = {r.request_id: r for r in result.records}
    for i in (1, 2, 3):
        r = recs[f"r{i}"]
        assert r.start_s - r.scheduled_s < SLACK and r.lateness_s < SLACK
        assert r.done_s < recs["r0"].done_s  # finished while r0 was still streaming
    assert summarize(result.records)["max_concurrent_requests"] >= 2


def test_metrics_through_driver_match_the_ideal_run():
    result = asyncio.run(run_workload(metric_workload(), metric_target()))
    real = summarize(result.records)
    ideal = summarize(metric_target().expected_records(metric_workload()))
    assert (real["completed"], real["failed"], real["total_output_tokens"]) == (3, 1, 8)
    for key in ("duration", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "mean_itl_ms"):
        scale = 1.0 if key == "duration" else 1000.0
        assert real[key] == pytest.approx(ideal[key], abs=SLACK * scale), key
    assert real["p99_lateness_ms"] < SLACK * 1000


def test_closed_loop_keeps_n_in_flight():
    tgt = ScriptedTarget(Script(ttft_s=0.05, output_tokens=1))
    specs = [spec(i, 0.0) for i in range(6)]
    result = asyncio.run(run_workload(specs, tgt, closed_loop=True, concurrency=2))
    wall = result.wall_s
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    assert summarize(result.records)["max_concurrent_requests"] == 2
    assert 0.15 - 0.01 < wall < 0.15 + 0.5  # three rounds of two
    third = sorted(result.records, key=lambda r: r.start_s)[2]
    assert third.start_s >= min(r.done_s for r in result.records) - 1e-3


def test_open_loop_concurrency_cap_is_queue_not_lateness():
    tgt = ScriptedTarget(Script(ttft_s=0.1, output_tokens=1))
    result = asyncio.run(run_workload([spec(i, 0.0) for i in range(2)], tgt, concurrency=1))
    second = max(result.records, key=lambda r: r.start_s)
    assert second.client_queue_s == pytest.approx(0.1, abs=SLACK)
    assert second.lateness_s < SLACK


def test_max_duration_returns_what_was_measured():
    tgt = ScriptedTarget(Script(ttft_s=0.02, chunk_gap_s=0.05, output_tokens=100))
    t = time.perf_counter()
    result = asyncio.run(run_workload([spec(0, 0.0, 100), spec(1, 5.0)], tgt, max_duration_s=0.2))
    assert time.perf_counter() - t < 1.0
    assert result.stop_reason == "max_duration" and result.interrupted
    (rec,) = result.records  # r1 was never sent
    assert rec.error.startswith("interrupted") and rec.finish_reason == "abort"
    assert 2 <= len(rec.token_times) <= 6  # the partial stream is kept


def test_cancelling_the_run_returns_partial_result():
    async def main():
        three_done = asyncio.Event()
        driver = Driver(ScriptedTarget(Script(ttft_s=0.01, output_tokens=1)),
                        on_progress=lambda n, rate: three_done.set() if n >= 3 else None)
        task = asyncio.ensure_future(driver.run([spec(i, 0.05 * i) for i in range(40)]))
        await asyncio.wait_for(three_done.wait(), timeout=10)
        task.cancel()
        return await task

    result = asyncio.run(main())
    assert result.stop_reason == "cancelled"
    assert 3 <= sum(r.ok for r in result.records) < 40


def test_progress_callback_and_target_exception():
    class Broken(ScriptedTarget):
        async def send(self, spec, on_token=None):
            raise RuntimeError("target bug")

    seen = []
    result = asyncio.run(run_workload([spec(0, 0.0)], Broken(), on_progress=lambda n, r: seen.append(n)))
    assert seen == [1] and result.records[0].error == "RuntimeError: target bug"
