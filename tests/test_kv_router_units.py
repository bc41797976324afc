"""servelab-router's instance pools and the PD target's counter parsing, without servers."""

from __future__ import annotations

import pytest

from engine.entrypoints.router import InstancePool, Router
from workloads.targets.pd import parse_connector_counters


def test_round_robin_and_least_loaded_skip_instances_marked_down() -> None:
    rr = InstancePool(["a", "b", "c"])
    assert [rr.pick() for _ in range(4)] == ["a", "b", "c", "a"]
    rr.mark_down("b")
    assert {rr.pick() for _ in range(4)} == {"a", "c"}
    ll = InstancePool(["a", "b"], policy="least_loaded")
    ll.in_flight["a"] = 2
    assert ll.pick() == "b"
    ll.in_flight["b"] = 3
    assert ll.pick() == "a"
    ll.mark_down("a")
    ll.mark_down("b")
    assert ll.pick() is None


def test_router_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="at least one --decode"):
        Router(["http://p"], [])
    with pytest.raises(ValueError, match="--policy must be one of"):
        Router([], ["http://d"], policy="random")


def test_connector_counters_are_read_from_a_metrics_page() -> None:
    page = (
        "# HELP servelab:kv_connector_loaded_blocks_total KV blocks loaded from the store.\n"
        'servelab:kv_connector_loaded_blocks_total{model_name="m"} 12.0\n'
        'servelab:kv_connector_loaded_blocks_created{model_name="m"} 1.7e9\n'
        'servelab:kv_connector_external_hit_tokens_total{model_name="m"} 192.0\n'
        'vllm:num_requests_running{model_name="m"} 1.0\n'
    )
    got = parse_connector_counters(page)
    assert got["loaded_blocks"] == 12.0 and got["external_hit_tokens"] == 192.0 and got["saved_blocks"] == 0.0
