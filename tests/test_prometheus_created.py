"""servelab's /metrics has no `_created` series (as vLLM's), without switching them off for
every other registry in the process (prometheus_client's switch is process-wide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from engine.metrics.prometheus import PrometheusMetrics


def test_servelab_metrics_leave_other_registries_their_created_series() -> None:
    servelab = PrometheusMetrics("m")  # its module is imported and its metrics built
    servelab._l(servelab.prompt_tokens).inc(3)
    servelab._l(servelab.ttft).observe(0.2)
    registry = CollectorRegistry()
    Counter("other_requests", "Requests of another library.", registry=registry).inc()
    names = [s.name for m in registry.collect() for s in m.samples]
    assert names == ["other_requests_total", "other_requests_created"]
    text = servelab.render().decode()
    assert "_created" not in text
    assert 'vllm:prompt_tokens_total{model_name="m"} 3.0' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    # the exposition is still prometheus_client's own: histograms keep their buckets and sum
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.25",model_name="m"} 1.0' in text
