"""What the workbench reads from a server it does not run in-process (issue 16, item 7):
counters scraped from /metrics, a /metrics that answers 404, prompt-length mismatches, prompt salts."""

from __future__ import annotations

import asyncio
import logging

import pytest

from analysis.metrics import scraped_summary, summarize
from analysis.runfolder import scraped_frame
from workloads.driver import run_workload
from workloads.factory import resolve_salt, salt_prompts
from workloads.spec import RequestSpec
from workloads.targets.openai import parse_gauges
from workloads.targets.scripted import Script, ScriptedTarget

METRICS_TEXT = """# HELP vllm:num_requests_running Requests in the running batch.
vllm:num_requests_running{model_name="m"} 3.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
vllm:prefix_cache_hits_total{model_name="m"} 400.0
vllm:num_preemptions_total{model_name="m"} 2.0
vllm:request_queue_time_seconds_sum{model_name="m"} 1.5
vllm:request_queue_time_seconds_count{model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{model_name="m"} 2.0
vllm:request_prefill_time_seconds_count{model_name="m"} 10.0
"""


def _spec(i: int, plen: int = 4) -> RequestSpec:
    return RequestSpec(f"r{i}", 0.0, None, list(range(plen)), plen, 3)


def test_counters_are_scraped_and_their_change_over_the_run_summarised() -> None:
    row0 = parse_gauges(METRICS_TEXT)
    assert row0["num_running"] == 3.0 and row0["prefix_cache_hits"] == 400.0 and row0["queue_time_count"] == 10.0
    row1 = {**row0, "prefix_cache_queries": 3000.0, "prefix_cache_hits": 1900.0, "num_preemptions": 5.0,
            "queue_time_sum": 3.5, "queue_time_count": 20.0, "prefill_time_sum": 2.0, "prefill_time_count": 10.0}
    frame = scraped_frame([{"time": 0.0, **row0}, {"time": 1.0, **row1}])
    got = scraped_summary(frame)
    assert got["prefix_cache_hit_rate"] == pytest.approx(1500 / 2000)
    assert got["num_preemptions"] == 3
    assert got["mean_server_queued_ms"] == pytest.approx(200.0)  # 2.0 s over 10 requests
    assert "mean_server_prefill_ms" not in got  # no request finished its prefill in between
    # the run summary takes them for an HTTP target (whose records carry no server phases)
    result = asyncio.run(run_workload([_spec(i) for i in range(3)], ScriptedTarget(Script(output_tokens=2))))
    summary = summarize(result.records, steps=frame)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.75) and summary["num_preemptions"] == 3


class _NoMetrics(ScriptedTarget):
    """A server whose /metrics answers 404."""

    def __init__(self) -> None:
        super().__init__(Script(ttft_s=0.05, output_tokens=2))
        self.metrics_error: str | None = None
        self.polls = 0

    async def scrape_metrics(self) -> dict[str, float] | None:
        self.polls += 1
        self.metrics_error = "GET /metrics answered HTTP 404"
        return None


def test_a_404_metrics_endpoint_is_reported_once_and_not_polled_again(caplog: pytest.LogCaptureFixture) -> None:
    target = _NoMetrics()
    with caplog.at_level(logging.WARNING, logger="workloads.driver"):
        result = asyncio.run(run_workload([_spec(i) for i in range(4)], target, scrape_interval_s=0.01))
    assert target.polls == 1
    assert result.metrics_error == "GET /metrics answered HTTP 404"
    assert sum("server metrics unavailable" in r.message for r in caplog.records) == 1


def test_server_prompt_counts_that_differ_are_flagged() -> None:
    # the server counts 231 prompt tokens for a 128-token prompt (a chat template added them)
    target = ScriptedTarget(Script(output_tokens=2, prompt_tokens=231))
    result = asyncio.run(run_workload([_spec(i, plen=128) for i in range(3)], target))
    summary = summarize(result.records)
    assert summary["prompt_token_mismatch"] == 3
    assert "sent 128, server counted 231" in summary["prompt_token_mismatch_note"]
    same = summarize(asyncio.run(run_workload([_spec(0, plen=128)], ScriptedTarget(Script(output_tokens=2)))).records)
    assert same["prompt_token_mismatch"] == 0


def test_prompt_salt_changes_every_prompt_start_and_keeps_shared_prefixes_shared() -> None:
    from engine.config import ModelConfig
    from engine.tokenizer import get_tokenizer
    from workloads.prompts import PromptBuilder

    builder = PromptBuilder(get_tokenizer(ModelConfig(dtype="float32")))
    a, b = resolve_salt("auto"), resolve_salt("auto")
    assert a != b and resolve_salt("") == "" and resolve_salt("x ") == "x "
    shared = builder.token_ids(40, 5)
    specs = [RequestSpec("ids0", 0.0, None, shared + [1, 2], 42, 4), RequestSpec("ids1", 0.0, None, shared + [3], 41, 4),
             RequestSpec("text", 0.0, "Hello there", None, 2, 4)]
    salt_prompts(specs, a, builder)
    salt_ids = builder.encode(a)
    assert specs[0].prompt_token_ids[: len(salt_ids)] == salt_ids and specs[0].prompt_len == 42 + len(salt_ids)
    assert specs[0].prompt_token_ids[: len(salt_ids) + 40] == specs[1].prompt_token_ids[: len(salt_ids) + 40]
    assert specs[2].prompt == a + "Hello there"
    assert specs[2].prompt_len == len(builder.encode(a + "Hello there"))
