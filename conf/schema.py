"""Structured (typed) configs for the Hydra tree in `conf/`.

Every yaml file of a group is validated against the dataclass registered for that
group, so a misspelled key fails at start-up with Hydra's "Key 'x' not in 'Y'"
message instead of being silently ignored. Engine sections reuse the engine's own
dataclasses (`engine/config.py`), so the harness and the engine cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from engine.config import AttentionConfig, CacheConfig, DeviceConfig, SchedulerConfig


@dataclass
class ModelSection:
    """engine.config.ModelConfig plus the architecture of a dummy shape (HF config.json names)."""

    model: str = "smollm2"
    load_format: str = "auto"
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    num_layers_override: int | None = None
    enforce_eager: bool = True  # False: compiled forward (torch.compile on a CPU, CUDA graphs on a GPU)
    arch: dict[str, Any] = field(default_factory=dict)


@dataclass
class LengthSection:
    """A length distribution: fixed | uniform | normal | lognormal | empirical."""

    dist: str = "fixed"
    value: int = 128  # fixed
    low: int = 1  # uniform
    high: int = 256
    mean: float = 128.0  # normal / lognormal (of the lengths themselves)
    std: float = 32.0
    path: str | None = None  # empirical: CSV file
    column: str | None = None
    min_len: int = 1
    max_len: int | None = None


@dataclass
class ArrivalSection:
    """poisson | gamma | constant | ramp | closed (fixed concurrency)."""

    process: str = "poisson"
    rate: float = 4.0  # requests/s (ramp: start rate)
    rate_end: float | None = None  # ramp: end rate
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    concurrency: int = 8  # closed loop users


@dataclass
class SharedPrefixSection:
    num_groups: int = 0  # 0: off
    prefix_len: int = 256
    fraction: float = 1.0


@dataclass
class MultiTurnSection:
    num_sessions: int = 0  # 0: off
    turns: int = 3
    message_len: int = 32


@dataclass
class TraceSection:
    path: str | None = None
    format: str = "auto"  # auto | azure | mooncake | burstgpt | jsonl
    time_scale: float = 1.0  # replay at k times the recorded rate
    max_requests: int | None = None
    start_s: float | None = None
    end_s: float | None = None
    lengths: str = "clamp"  # clamp | scale | none: fit lengths to the model context
    block_size: int = 512  # Mooncake hash block size (tokens)
    block_multiple: int = 16  # lengths=scale: the scaled hash block is a multiple of this (KV block size)
    max_output_tokens: int | None = None


@dataclass
class WorkloadSection:
    kind: str = "synthetic"  # synthetic | trace
    name: str = "default"
    num_requests: int = 64
    warmup_requests: int = 4
    seed: int = 0
    prompt_as_token_ids: bool = False
    ignore_eos: bool = True
    prompt_len: LengthSection = field(default_factory=LengthSection)
    output_len: LengthSection = field(default_factory=lambda: LengthSection(value=64))
    arrival: ArrivalSection = field(default_factory=ArrivalSection)
    shared_prefix: SharedPrefixSection = field(default_factory=SharedPrefixSection)
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    trace: TraceSection = field(default_factory=TraceSection)


@dataclass
class TargetSection:
    """inprocess | server (servelab-serve started by the harness) | openai (any URL) | simulated."""

    kind: str = "inprocess"
    url: str | None = None
    model_name: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"  # completions | chat
    startup_timeout_s: float = 180.0
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 0.5  # /metrics scraping for HTTP targets


@dataclass
class ProfilingSection:
    enabled: bool = False
    wait: int = 2
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    telemetry: bool = True
    telemetry_interval_s: float = 0.5


@dataclass
class SLOSection:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass
class SweepReportSection:
    throughput_metric: str = "output_throughput"
    latency_metrics: list[str] = field(default_factory=lambda: ["p99_ttft_ms", "p99_tpot_ms"])
    best_by: str = "request_goodput"


@dataclass
class ReportSection:
    html: bool = True
    fallback_slo: SLOSection = field(default_factory=SLOSection)
    sweep: SweepReportSection = field(default_factory=SweepReportSection)


@dataclass
class SimSection:
    hardware: str = "h200"
    tp: int = 1
    step_model: str = "roofline"  # roofline | path to a calibration file
    dtype: str = "bf16"  # weights and KV cache on the simulated hardware: bf16 | fp16 | fp32 | fp8
    token_id: int = 1000  # the id every simulated step samples (never EOS: outputs run to max_tokens)


@dataclass
class RunSection:
    name: str = "default"
    output_dir: str = "runs"
    max_duration_s: float = 1800.0
    time_reference: bool = True  # measure a fixed CPU/GPU reference to normalise time metrics


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    target: TargetSection = field(default_factory=TargetSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    report: ReportSection = field(default_factory=ReportSection)
    slo: SLOSection = field(default_factory=SLOSection)
    sim: SimSection = field(default_factory=SimSection)
    run: RunSection = field(default_factory=RunSection)


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelSection,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "attention": AttentionConfig,
    "device": DeviceConfig,
    "workload": WorkloadSection,
    "target": TargetSection,
    "profiling": ProfilingSection,
    "report": ReportSection,
    "slo": SLOSection,
}


def register_schemas() -> None:
    """Register the run schema and one `<group>_schema` per group (used by the group yaml defaults)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)
