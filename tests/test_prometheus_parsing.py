"""Prometheus text read by prometheus_client's parser in both workbench readers: a sample's
optional timestamp is not its value, and labels, `_total` / `_created` series and HELP / TYPE
lines are read as the exposition format defines them."""

from __future__ import annotations

import pytest

from workloads.targets.openai import parse_gauges
from workloads.targets.pd import parse_connector_counters


def test_a_timestamp_after_the_value_is_not_read_as_the_value() -> None:
    assert parse_gauges("vllm:num_requests_running 3 1700000000000\n") == {"num_running": 3.0}
    page = (
        "# TYPE servelab:kv_connector_loaded_blocks counter\n"
        'servelab:kv_connector_loaded_blocks_total{model_name="m"} 3 1700000000000\n'
    )
    assert parse_connector_counters(page)["loaded_blocks"] == 3.0


def test_labels_with_spaces_and_braces_and_counter_families() -> None:
    page = (
        "# HELP vllm:num_preemptions Preemptions.\n"
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="a b} c"} 4.0\n'
        'vllm:num_preemptions_created{model_name="a b} c"} 1.7e9\n'
        'vllm:kv_cache_usage_perc{model_name="x y"} 0.5 1700000000000\n'
    )
    assert parse_gauges(page) == {"num_preemptions": 4.0, "kv_usage": 0.5}


def test_text_that_is_not_the_exposition_format_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_gauges('vllm:num_requests_running{model_name="m" 3\n')
