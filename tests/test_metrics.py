"""Every summary figure checked against hand-computed values from known token timings."""

import math

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import summarize
from analysis.record import token_times_from_chunks
from analysis.runfolder import read_requests, read_summary, records_from_frame, write_requests, write_summary
from workloads.spec import RequestSpec
from workloads.targets.scripted import Script, ScriptedTarget

SCRIPTS = {
    "w": Script(ttft_s=1.25, output_tokens=1),  # warm-up: would change the figures if counted
    "a": Script(ttft_s=0.1, chunk_gap_s=0.05, output_tokens=3),  # tokens 0.10 0.15 0.20
    "b": Script(ttft_s=0.2, chunk_gap_s=0.1, tokens_per_chunk=2, output_tokens=4),  # 0.7 0.7 | 0.75 0.8
    "c": Script(ttft_s=0.3, output_tokens=1),  # 1.3
    "d": Script(ttft_s=0.1, error="boom"),  # fails at 1.3
}
ARRIVALS = {"w": 0.0, "a": 0.0, "b": 0.5, "c": 1.0, "d": 1.2}
PROMPTS = {"w": 99, "a": 10, "b": 20, "c": 30, "d": 40}


def workload() -> list[RequestSpec]:
    return [RequestSpec(k, ARRIVALS[k], None, [1], PROMPTS[k], 8, is_warmup=k == "w") for k in SCRIPTS]


def target() -> ScriptedTarget:
    return ScriptedTarget(script=lambda spec: SCRIPTS[spec.request_id])


@pytest.fixture()
def records():
    return target().expected_records(workload())


def test_token_times_spread_chunk_gaps():
    assert token_times_from_chunks([1.0, 1.3, 1.4], [2, 3, 1]) == pytest.approx([1.0, 1.0, 1.1, 1.2, 1.3, 1.4])
    assert token_times_from_chunks([2.0, 2.5], [1, 0]) == [2.0]


def test_per_request_values(records):
    a, b, c, d = records[1:]
    assert a.ttft_s == pytest.approx(0.1) and a.e2el_s == pytest.approx(0.2) and a.tpot_s == pytest.approx(0.05)
    # b: chunks of 2 tokens at 0.7 and 0.8: one per-chunk gap (vLLM's ITL), three per-token gaps
    assert b.itls_s == pytest.approx([0.1]) and b.itls_per_token_s == pytest.approx([0.0, 0.05, 0.05])
    assert b.tpot_s == pytest.approx(0.1 / 3) and b.end_s == pytest.approx(0.8)
    assert c.tpot_s is None and c.itls_s == [] and c.itls_per_token_s == []
    assert a.engine_itls_s == [] and a.engine_tpot_s is None  # no engine timestamps
    assert not d.ok and d.ttft_s is None and d.done_s == pytest.approx(1.3)


def test_summary_hand_computed(records):
    s = summarize(records, slo={"ttft_ms": 250.0, "tpot_ms": None, "e2el_ms": None})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["duration"] == pytest.approx(1.3)  # first send 0.0 -> last completion 1.3
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(3 / 1.3)
    assert s["output_throughput"] == pytest.approx(8 / 1.3)
    assert s["total_token_throughput"] == pytest.approx(68 / 1.3)
    assert s["request_goodput"] == pytest.approx(2 / 1.3)  # a (100 ms) and b (200 ms) meet TTFT 250
    # TTFT ms [100, 200, 300]
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert s["p90_ttft_ms"] == pytest.approx(280) and s["p99_ttft_ms"] == pytest.approx(298)
    # TPOT ms [50, 33.33]: c has one token, unweighted mean
    assert s["mean_tpot_ms"] == pytest.approx(125 / 3) and s["p50_tpot_ms"] == pytest.approx(125 / 3)
    # ITL (vLLM, per chunk) ms pooled [50, 50 | 100]
    assert s["mean_itl_ms"] == pytest.approx(200 / 3) and s["median_itl_ms"] == pytest.approx(50)
    assert s["p90_itl_ms"] == pytest.approx(90) and s["std_itl_ms"] == pytest.approx(math.sqrt(5000 / 9))
    # ITL per token ms pooled [50, 50 | 0, 50, 50]
    assert s["mean_itl_per_token_ms"] == pytest.approx(40) and s["median_itl_per_token_ms"] == pytest.approx(50)
    assert s["p90_itl_per_token_ms"] == pytest.approx(50) and s["std_itl_per_token_ms"] == pytest.approx(20)
    assert not any(k.startswith("engine_") for k in s)  # no engine timestamps: no engine figures
    # E2EL ms [200, 300, 300]
    assert s["mean_e2el_ms"] == pytest.approx(800 / 3) and s["p50_e2el_ms"] == pytest.approx(300)
    assert s["max_output_tokens_per_s"] == 5  # vLLM counts chunks: 3 + 2 in [0, 1), 1 in [1, 2)
    assert s["peak_output_tokens_per_s"] == 7  # 3 + 4 tokens in [0, 1), 1 in [1, 2)
    assert s["max_concurrent_requests"] == 1  # completed only (vLLM): a, b, c never overlap
    assert s["mean_client_queue_ms"] == 0 and s["p99_lateness_ms"] == 0 and not s["driver_bottleneck"]
    assert s["errors"] == ["boom"]
    assert "mean_server_queued_ms" not in s and s["num_steps"] == 0
    assert set(s["definitions"]) >= {"ttft", "tpot", "itl", "e2el", "request_goodput"}


def test_goodput_with_tpot_slo_and_without_slo(records):
    s = summarize(records, slo={"ttft_ms": 250.0, "tpot_ms": 45.0})
    assert s["request_goodput"] == pytest.approx(1 / 1.3)  # a's TPOT 50 ms fails, c's TTFT fails
    assert summarize(records)["request_goodput"] is None


def test_server_times_and_steps(records):
    records[1].server_queued_s, records[2].server_queued_s = 0.01, 0.03
    steps = pd.DataFrame({"num_prefill_tokens": [30, 0, 0], "num_decode_tokens": [0, 2, 4],
                          "prefix_cache_queries": [40, 0, 0], "prefix_cache_hits": [10, 0, 0],
                          "num_preemptions": [0, 1, 0]})
    s = summarize(records, steps=steps)
    assert s["mean_server_queued_ms"] == pytest.approx(20)
    assert (s["num_steps"], s["num_preemptions"]) == (3, 1)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25) and s["mean_tokens_per_step"] == pytest.approx(12)


def test_no_completed_requests_gives_nulls():
    recs = ScriptedTarget(Script(error="down")).expected_records(workload()[1:2])
    s = summarize(recs)
    assert s["completed"] == 0 and s["failed"] == 1 and s["mean_ttft_ms"] is None
    assert s["request_throughput"] == 0.0 and s["errors"] == ["down"]


def test_run_folder_round_trip(records, tmp_path):
    write_requests(tmp_path, records)
    df = read_requests(tmp_path)
    assert list(df["request_id"]) == ["w", "a", "b", "c", "d"]
    row_d = df.iloc[4]
    assert row_d["error"] == "boom" and np.isnan(row_d["ttft_ms"]) and np.isnan(row_d["tpot_ms"])
    assert df.iloc[1]["ttft_ms"] == pytest.approx(100) and df.iloc[3]["tpot_ms"] != df.iloc[3]["tpot_ms"]
    again = summarize(records_from_frame(df), slo={"ttft_ms": 250.0})
    first = summarize(records, slo={"ttft_ms": 250.0})
    write_summary(tmp_path, first)
    loaded = read_summary(tmp_path)
    for key, value in first.items():
        if isinstance(value, float):
            assert again[key] == pytest.approx(value) and loaded[key] == pytest.approx(value), key
        else:
            assert again[key] == value and loaded[key] == value, key
