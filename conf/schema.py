"""The typed configuration of the workbench's front doors, and the checks that keep it strict.

Hydra composes `conf/run.yaml` (servelab-run), `conf/serve.yaml` (servelab-serve) and
`conf/plan.yaml` (servelab-plan) against the dataclasses below, and `OmegaConf.to_object`
turns the result into a `RunConfig` / `ServeConfig` / `PlanConfig`. Their engine part is the
engine's own `EngineConfig` (they extend it): its sections are the engine's dataclasses, the
model section a `ModelSection` that adds the workbench-only fields. A key no dataclass
declares fails at start-up (`check_overrides` gives the one-line message).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from hydra.core.config_store import ConfigStore

from engine.config import EngineConfig, ModelConfig
from engine.entrypoints.api_server import ServerSettings

CONF_DIR = Path(__file__).parent


@dataclass
class ModelSection(ModelConfig):
    """`engine.config.ModelConfig` plus the workbench-only `arch`: Hugging Face config.json
    hyper-parameters of a dummy shape defined in the config itself (null: `model` names the
    weights or a shape the engine finds, e.g. engine/model/shapes/llama-3-8b.yaml)."""

    # A mapping, or null. Typed Any: Hydra merges `model.arch={...}` into a typed dict node and
    # rejects its new keys (struct mode), while an untyped node takes the whole mapping.
    arch: Any = None


@dataclass
class EngineSections(EngineConfig):
    """The engine's `EngineConfig` with the workbench's model section; every front door extends it."""

    model: ModelSection = field(default_factory=ModelSection)

    def engine_config(self, shape_dir: str | Path | None = None) -> EngineConfig:
        """The plain `EngineConfig` the engine runs (same section objects; `ModelConfig` without
        the workbench fields). A model given by `arch` is written to `<shape_dir>/<model>.yaml`
        and named by that path."""
        model = ModelConfig(**{f.name: getattr(self.model, f.name) for f in fields(ModelConfig)})
        if self.model.arch:
            if shape_dir is None:
                raise ValueError("model.arch: a shape defined in the config needs a folder to write it to")
            path = Path(shape_dir) / f"{Path(self.model.model).stem}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not isinstance(self.model.arch, dict):
                raise ValueError(f"model.arch: expected a mapping of hyper-parameters, got {self.model.arch!r}")
            path.write_text(yaml.safe_dump(dict(self.model.arch), sort_keys=False))
            model.model = str(path)
        cfg = EngineConfig(model=model, cache=self.cache, scheduler=self.scheduler, attention=self.attention,
                           device=self.device, parallel=self.parallel,
                           speculative_config=self.speculative_config, kv_transfer=self.kv_transfer,
                           structured_outputs_config=self.structured_outputs_config)  # fmt: skip
        cfg.validate()
        return cfg


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
    # Open loop: at most this many requests in flight; a due arrival waits for a free slot
    # (vLLM's `--max-concurrency`). None: no cap.
    max_concurrency: int | None = None


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
    # Text put before every prompt so a long-lived server's prefix cache cannot answer a rerun
    # of the same seed from the previous run: "" none, "auto" a new random salt per run, or the text.
    prompt_salt: str = ""
    # Short form of `arrival.process=closed arrival.concurrency=N`: a closed loop of N users.
    concurrency: int | None = None
    ignore_eos: bool = True
    prompt_len: LengthSection = field(default_factory=LengthSection)
    output_len: LengthSection = field(default_factory=lambda: LengthSection(value=64))
    arrival: ArrivalSection = field(default_factory=ArrivalSection)
    shared_prefix: SharedPrefixSection = field(default_factory=SharedPrefixSection)
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    trace: TraceSection = field(default_factory=TraceSection)


@dataclass
class TargetSection:
    """inprocess | server (servelab-serve started by the harness) | openai (any URL) | vllm (vLLM's
    server started by the harness from a side venv) | llamacpp (llama-cpp-python's server, the same)
    | simulated | pd (prefill/decode disaggregation:
    Mooncake master, servers and servelab-router, all local)."""

    kind: str = "inprocess"
    url: str | None = None
    model_name: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"  # completions | chat
    startup_timeout_s: float = 180.0
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 0.5  # /metrics scraping for HTTP targets
    num_prefill: int = 1  # pd: prefill (kv_producer) instances
    num_decode: int = 1  # pd: decode (kv_consumer) instances
    router_policy: str = "round_robin"  # pd: round_robin | least_loaded
    kv_connector: str = "store"  # pd: store (Mooncake's store) | transfer (its TransferEngine, direct)
    # HTTP targets ask for the servelab timing extension (per-token engine times; a header,
    # ignored by other servers). false: chunk timing only.
    server_timing: bool = True
    # target=server: keys of servelab-serve's `server:` section for the started server
    # (e.g. stream_chunk_tokens: 4); host and port are the target's.
    server: dict[str, Any] = field(default_factory=dict)
    # target=vllm (workloads/targets/peer.py): the side venv holding vLLM and the model as an HF
    # folder (null: ~/.cache/servelab-peers/vllm and .../smollm2-hf, what scripts/peers.sh makes),
    # extra server arguments and environment.
    venv: str | None = None
    hf_model: str | None = None
    # target=llamacpp: the GGUF file its server loads (null: the embedded default model's)
    gguf: str | None = None
    peer_args: list[str] = field(default_factory=list)
    peer_env: dict[str, str] = field(default_factory=dict)


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
    # Tensor-parallel ranks and expert parallelism of the simulated engine. 1 / false: the engine's
    # own parallel.tensor_parallel_size / parallel.enable_expert_parallel (RunConfig.sim_parallel).
    tp: int = 1
    ep: bool = False
    step_model: str = "roofline"  # roofline | path to a calibration file
    dtype: str = "bf16"  # weights and KV cache on the simulated hardware: bf16 | fp16 | fp32 | fp8
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV cache
    token_id: int = 1000  # the id every simulated step samples (never EOS: outputs run to max_tokens)


@dataclass
class RunSection:
    name: str = "default"
    output_dir: str = "runs"
    max_duration_s: float = 1800.0
    time_reference: bool = True  # measure a fixed CPU/GPU reference to normalise time metrics
    # Open loop: stop the run once in-flight requests and TTFT keep rising (workloads/saturation.py).
    stop_when_saturated: bool = False
    time_slice_s: float | None = None  # the report's time slices (null: about ten per run)


@dataclass
class RunConfig(EngineSections):
    """`servelab-run` (conf/run.yaml): the engine sections plus the experiment's."""

    workload: WorkloadSection = field(default_factory=WorkloadSection)
    target: TargetSection = field(default_factory=TargetSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    report: ReportSection = field(default_factory=ReportSection)
    slo: SLOSection = field(default_factory=SLOSection)
    sim: SimSection = field(default_factory=SimSection)
    run: RunSection = field(default_factory=RunSection)
    # A recorded run folder: resend its exact traffic (workloads/replay.py); its workload
    # section replaces this one, everything else comes from this config.
    replay: str | None = None

    def sim_parallel(self) -> tuple[int, bool]:
        """(tensor-parallel size, expert parallel) the simulator models: `sim.tp` / `sim.ep`, or the
        engine's `parallel.*` where those are left at 1 / false; ValueError when both name a TP size
        and they differ."""
        tp, ptp = int(self.sim.tp), int(self.parallel.tensor_parallel_size)
        if tp > 1 and ptp > 1 and tp != ptp:
            raise ValueError(f"sim.tp={tp} and parallel.tensor_parallel_size={ptp} disagree; set one of them")
        return max(tp, ptp), bool(self.sim.ep or self.parallel.enable_expert_parallel)


@dataclass
class ServeConfig(EngineSections):
    """`servelab-serve` (conf/serve.yaml): the engine sections plus the HTTP server's."""

    server: ServerSettings = field(default_factory=ServerSettings)


@dataclass
class PlanSection:
    """What `servelab-plan` varies and how it searches (see docs/capacity.md)."""

    # Candidate engine configurations: every combination (null: the scheduler section's value).
    max_num_batched_tokens: list[int] | None = None
    max_num_seqs: list[int] | None = None
    # Load: exactly one of rates, time_scales (trace only), search.
    rates: list[float] | None = None  # offered request rates, req/s
    time_scales: list[float] | None = None  # multipliers of the trace's own rate
    search: bool = False  # the highest rate meeting the SLOs, per configuration
    search_start: float | None = None  # null: the trace's own rate (synthetic: 1 req/s)
    search_tol: float = 0.05  # relative tolerance of the search
    search_max: float = 1e6  # highest rate the search may try, req/s
    target_rate: float | None = None  # total rate to serve: replicas of the best configuration
    slo_stat: str = "p99"  # the statistic of TTFT / TPOT held to slo.*: p99 | p95 | p90 | median | mean
    verify: int = 0  # run the K best picks for real on `target` and compare (workloads/plan_verify.py)
    out: str | None = None  # folder for plan.csv, plan.json, plan.html
    plain: bool = False  # plain-text table (no rich)
    progress: bool = False  # a progress bar per simulated run


@dataclass
class PlanConfig(RunConfig):
    """`servelab-plan` (conf/plan.yaml): a run config (model, scheduler, cache, workload, sim,
    slo) plus the candidates and the load to plan over."""

    plan: PlanSection = field(default_factory=PlanSection)


SCHEMAS: dict[str, type] = {"run_schema": RunConfig, "serve_schema": ServeConfig, "plan_schema": PlanConfig}


def register_schemas() -> None:
    """Register the primary configs' schemas (named in the `defaults:` of run/serve/plan.yaml)."""
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)


# ---- strictness: unknown keys fail at start-up with one line ------------------------
def config_groups() -> dict[str, list[str]]:
    """Config group -> its options (the yaml files of `conf/<group>/`)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONF_DIR.iterdir() if d.is_dir()
            and not d.name.startswith("_")}  # fmt: skip


def check_overrides(schema: type, overrides: list[str]) -> str | None:
    """Why these command-line overrides cannot apply to `schema` (one line), or None.

    Checks what Hydra would reject with a multi-line message: a key no dataclass declares
    (`scheduler.max_num_seq=8`) and a config group option with no yaml file (`model=llama3`).
    `hydra.*` and `hydra/...` overrides, deletions (`~key`) and keys under a free-form
    mapping (`model.arch.*`) pass.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        return one_line(exc)
    groups = config_groups()
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_delete() or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key in groups and ov.package is None:
            values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
            for value in values:
                if value is not None and str(value) not in groups[key]:
                    return f"unknown {key} {str(value)!r} (known: {', '.join(groups[key])})"
            continue
        problem = _unknown_key(schema, key)
        if problem:
            return problem
    return None


def _unknown_key(schema: type, dotted: str) -> str | None:
    node: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(node, type) and is_dataclass(node)):
            return None  # below a mapping or a list: free-form
        hints = get_type_hints(node)
        if part not in hints:
            where = ".".join(parts[:i]) or "the config"
            known = ", ".join(f.name for f in fields(node))
            return f"unknown key {dotted!r}: {where} ({node.__name__}) has {known}"
        node = hints[part]
    return None


def one_line(exc: BaseException) -> str:
    """A Hydra / OmegaConf error as one line (their messages span several, with a full_key line)."""
    texts = [str(exc)] + ([str(exc.__cause__)] if exc.__cause__ is not None else [])
    lines = [ln.strip() for text in texts for ln in text.splitlines() if ln.strip()]
    skip = ("full_key:", "object_type=", "reference_type=", "To append to your config use")
    keep = [ln for ln in lines if not ln.startswith(skip)]
    return "; ".join(dict.fromkeys(keep)) or type(exc).__name__


def compose_typed(schema: type, config_name: str, overrides: list[str]) -> Any:
    """Compose conf/<config_name>.yaml with `overrides` into its typed `schema` object.

    ValueError with one line (unknown key or group option, a yaml key the schema lacks, a value
    of the wrong type) instead of Hydra's multi-line report; the front doors print it as is.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    problem = check_overrides(schema, overrides)
    if problem:
        raise ValueError(problem)
    register_schemas()
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            composed = compose(config_name=config_name, overrides=overrides)
        cfg = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ValueError(one_line(exc)) from None
    assert isinstance(cfg, schema)
    return cfg
