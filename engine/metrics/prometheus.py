"""Prometheus metrics under the names vLLM exports, so its dashboards work unchanged.

State gauges come from StepStats (each step) and from a fresh scheduler snapshot
taken when /metrics is scraped (so an idle engine reads idle at once). Request
histograms are observed when a request finishes, from its RequestMetrics.
Each server owns its CollectorRegistry (no global state; tests can start several).
vLLM exports no `*_created` series; prometheus_client's switch for them
(`disable_created_metrics`) is process-wide, so they are dropped from servelab's own
exposition instead (`_WithoutCreated`), and other registries in the process keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from engine.outputs import RequestOutput
from engine.seam import EngineStats, StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _WithoutCreated:
    """A registry's metrics without their `_created` samples (a collector for exposition)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if s.name != metric.name + "_created"]
            yield kept


class PrometheusMetrics:
    """The vLLM metric set for one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100 percent).")
        # KV cache groups (engine/kv_cache_spec.py); absent for a model with one group
        self.kv_group_blocks = Gauge("servelab:kv_cache_group_blocks_used",
                                     "KV blocks held in each KV cache group (group 0: full attention).",
                                     [*labels, "group"], registry=r)  # fmt: skip
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.")
        # Speculative decoding, under vLLM's names (acceptance rate = accepted / draft tokens).
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Requests verified with draft tokens.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            ("position",),
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.success = counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting to be scheduled.", LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Prefill time.", LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Decode time.", LATENCY_BUCKETS)
        # External KV (engine/kv_transfer/); zero without a connector.
        self.kv_loaded_blocks = counter("servelab:kv_connector_loaded_blocks", "KV blocks loaded from the store.")
        self.kv_saved_blocks = counter("servelab:kv_connector_saved_blocks", "KV blocks saved to the store.")
        self.kv_loaded_bytes = counter("servelab:kv_connector_loaded_bytes", "KV bytes loaded from the store.")
        self.kv_saved_bytes = counter("servelab:kv_connector_saved_bytes", "KV bytes saved to the store.")
        self.kv_load_seconds = counter("servelab:kv_connector_load_seconds", "Seconds the worker spent loading KV.")
        self.kv_save_seconds = counter("servelab:kv_connector_save_seconds", "Seconds the worker spent saving KV.")
        self.kv_external_hits = counter("servelab:kv_connector_external_hit_tokens",
                                        "Prompt tokens whose KV came from the store (not recomputed).")  # fmt: skip
        self.kv_load_failures = counter("servelab:kv_connector_load_failures", "Loads that failed (recomputed).")
        self.model_name = model_name

    def _l(self, metric):  # type: ignore[no-untyped-def]
        return metric.labels(model_name=self.model_name)

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step (state gauges and counters)."""
        self._l(self.running).set(stats.num_running)
        self._l(self.waiting).set(stats.num_waiting)
        self._l(self.kv_usage).set(stats.kv_usage)
        self._set_groups(stats.kv_blocks_used_per_group)
        self._l(self.prefix_queries).inc(stats.prefix_cache_queries)
        self._l(self.prefix_hits).inc(stats.prefix_cache_hits)
        self._l(self.preemptions).inc(stats.num_preemptions)
        self._l(self.spec_drafts).inc(stats.num_drafts)
        self._l(self.spec_draft_tokens).inc(stats.num_draft_tokens)
        self._l(self.spec_accepted_tokens).inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(n)
        if stats.kv_blocks_loaded or stats.kv_blocks_saved or stats.kv_load_failures:
            self._l(self.kv_loaded_blocks).inc(stats.kv_blocks_loaded)
            self._l(self.kv_saved_blocks).inc(stats.kv_blocks_saved)
            self._l(self.kv_loaded_bytes).inc(stats.kv_bytes_loaded)
            self._l(self.kv_saved_bytes).inc(stats.kv_bytes_saved)
            self._l(self.kv_load_seconds).inc(stats.kv_load_time)
            self._l(self.kv_save_seconds).inc(stats.kv_save_time)
            self._l(self.kv_external_hits).inc(stats.kv_external_hit_tokens)
            self._l(self.kv_load_failures).inc(stats.kv_load_failures)

    def on_snapshot(self, stats: EngineStats) -> None:
        self._l(self.running).set(stats.num_running)
        self._l(self.waiting).set(stats.num_waiting)
        self._l(self.kv_usage).set(stats.kv_usage)
        self._set_groups(stats.kv_blocks_used_per_group)

    def _set_groups(self, per_group: list[int]) -> None:
        for group, n in enumerate(per_group):
            self.kv_group_blocks.labels(model_name=self.model_name, group=str(group)).set(n)

    def on_finished(self, out: RequestOutput) -> None:
        """Record one finished request (a child of an n > 1 request counts on its own)."""
        m = out.metrics
        num_out = sum(len(c.token_ids) for c in out.outputs)
        self._l(self.prompt_tokens).inc(len(out.prompt_token_ids))
        self._l(self.generation_tokens).inc(num_out)
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.success.labels(model_name=self.model_name, finished_reason=str(reason)).inc()
        if m.arrival_time <= 0:
            return
        if m.first_token_time > 0:
            self._l(self.ttft).observe(max(0.0, m.first_token_time - m.arrival_time))
            self._l(self.queue).observe(m.queued_time)
            self._l(self.prefill).observe(m.prefill_time)
        if m.finished_time > 0:
            self._l(self.e2e).observe(max(0.0, m.finished_time - m.arrival_time))
            self._l(self.decode).observe(m.decode_time)
        times = m.token_times
        for a, b in zip(times, times[1:], strict=False):
            self._l(self.itl).observe(b - a)
        if num_out > 1 and m.finished_time > 0 and m.first_token_time > 0:
            self._l(self.tpot).observe((m.finished_time - m.first_token_time) / (num_out - 1))

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))
