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
    """Workbench only. HF `config.json` hyper-parameters of a shape defined in the config itself: when set,
    the run writes them to `<run>/shapes/<model>.yaml` and the engine loads that shape with random weights,
    for example `model.model=tiny 'model.arch={hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
    intermediate_size: 128, vocab_size: 512}'`. null: `model.model` says what to load."""


@dataclass
class EngineSections(EngineConfig):
    """The engine's `EngineConfig` with the workbench's model section; every front door extends it."""

    model: ModelSection = field(default_factory=ModelSection)
    """The model section (`ModelSection`)."""

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
                           device=self.device, kernels=self.kernels, parallel=self.parallel,
                           speculative_config=self.speculative_config, kv_transfer=self.kv_transfer,
                           structured_outputs_config=self.structured_outputs_config)  # fmt: skip
        cfg.validate()
        return cfg


@dataclass
class LengthSection:
    """A length distribution: fixed | uniform | normal | lognormal | empirical."""

    dist: str = "fixed"
    """`fixed`, `uniform`, `normal`, `lognormal` or `empirical`."""
    value: int = 128  # fixed
    """`fixed`: the length (`workload.output_len` defaults to 64)."""
    low: int = 1  # uniform
    """`uniform`: the lowest length; integers uniform on [low, high], both ends included."""
    high: int = 256
    """`uniform`: the highest length, included."""
    mean: float = 128.0  # normal / lognormal (of the lengths themselves)
    """`normal`, `lognormal`: mean of the lengths themselves (for lognormal, converted to the median and sigma
    of the log: sigma² = ln(1 + (std/mean)²))."""
    std: float = 32.0
    """`normal`, `lognormal`: standard deviation of the lengths themselves."""
    path: str | None = None  # empirical: CSV file
    """`empirical`: a CSV file; lengths are resampled from its `column`, with replacement. Relative paths are
    tried from the working directory, then from the project root."""
    column: str | None = None
    """`empirical`: the CSV column holding the lengths."""
    min_len: int = 1
    """`normal`, `lognormal`, `empirical`: sampled lengths are rounded and clamped to [min_len, max_len].
    `fixed` and `uniform` ignore it."""
    max_len: int | None = None
    """`normal`, `lognormal`, `empirical`: upper clamp of the sampled lengths (null: none). `fixed` and
    `uniform` ignore it."""


@dataclass
class ArrivalSection:
    """poisson | gamma | constant | ramp | closed (fixed concurrency)."""

    process: str = "poisson"
    """`poisson`, `gamma`, `constant`, `ramp` or `closed`."""
    rate: float = 4.0  # requests/s (ramp: start rate)
    """Requests/s (> 0). For `ramp` it is the start rate."""
    rate_end: float | None = None  # ramp: end rate
    """`ramp`: end rate (required)."""
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    """`gamma`: shape of the inter-arrival Gamma (1 = Poisson, < 1 burstier, large values tend to constant
    spacing). `ramp`: gaps are drawn from a Gamma with this shape when it is not 1."""
    concurrency: int = 8  # closed loop users
    """`closed`: this many users, each sending its next request when the previous one ends."""
    max_concurrency: int | None = None
    """Open loop: at most this many requests in flight; an arrival that finds them all busy waits for a free
    slot (counted as client queue, not lateness). vLLM's `--max-concurrency`. Not supported by
    `target=simulated` (one-line error)."""


@dataclass
class SharedPrefixSection:
    num_groups: int = 0  # 0: off
    """Number of distinct shared system prompts (0: off)."""
    prefix_len: int = 256
    """Tokens in each shared prompt. A member's prompt is at least `prefix_len + 1` tokens."""
    fraction: float = 1.0
    """Share of requests, chosen at random with the seed, that start with one of the prefixes (picked
    uniformly). Such requests get `group = prefix-<g>` in `requests.csv`."""


@dataclass
class MultiTurnSection:
    num_sessions: int = 0  # 0: off
    """Number of conversations (0: off). Session start times come from `workload.arrival`."""
    turns: int = 3
    """Turns per session. Turn k+1 is sent when turn k finishes. Its prompt is turn k's prompt, then turn k's
    answer, then a new message."""
    message_len: int = 32
    """Tokens of each later user message. The first prompt is drawn from `prompt_len`, and every answer's
    length from `output_len`."""


@dataclass
class TraceSection:
    path: str | None = None
    """The trace file (required for `kind: trace`)."""
    format: str = "auto"  # auto | azure | mooncake | burstgpt | jsonl
    """`auto` (detected from the first line), `azure`, `mooncake`, `burstgpt` (BurstGPT CSV; failed rows,
    those with `Response tokens == 0`, are dropped) or `jsonl` (one object per line with `timestamp_s`,
    `prompt_tokens`, `output_tokens`, and optionally `prompt` text, `hash_ids` and `group`)."""
    time_scale: float = 1.0  # replay at k times the recorded rate
    """Replay at k times the recorded rate (timestamps divided by k, k > 0)."""
    max_requests: int | None = None
    """Keep the first N rows after the time window (null: `workload.num_requests`)."""
    start_s: float | None = None
    """Keep rows with `start_s ≤ t`, in seconds of the recorded trace (first row at 0, before time scaling);
    null: from the first row."""
    end_s: float | None = None
    """Keep rows with `t < end_s`, in seconds of the recorded trace (first row at 0, before time scaling);
    null: to the last row."""
    lengths: str = "clamp"  # clamp | scale | none: fit lengths to the model context
    """Fit lengths to the model context: `clamp` cuts each prompt to `max_model_len - 1` and each output to
    what the context leaves. `scale` multiplies every prompt length by `max_model_len / (longest prompt +
    output)` (never above 1), then clamps, and scales the hash block with it so the prefix structure survives.
    `none` leaves lengths as they are."""
    block_size: int = 512  # Mooncake hash block size (tokens)
    """Tokens per `hash_ids` block (Mooncake, or our JSONL with hash ids)."""
    block_multiple: int = 16  # lengths=scale: the scaled hash block is a multiple of this (KV block size)
    """`lengths: scale` with hash ids: the factor is rounded down so the scaled hash block is a multiple of
    this. Set it to `cache.block_size` so shared blocks fill whole KV blocks; it is not derived from it."""
    max_output_tokens: int | None = None
    """Cap every output length at this value (applied before fitting)."""


@dataclass
class WorkloadSection:
    kind: str = "synthetic"  # synthetic | trace
    """`synthetic` (the distributions below) or `trace` (`workload.trace`)."""
    name: str = "default"
    """A label recorded in `config.yaml` and shown on the report."""
    num_requests: int = 64
    """Synthetic: the number of requests (≥ 1); ignored when `multi_turn.num_sessions > 0`. Trace: how many
    rows to keep when `trace.max_requests` is null."""
    warmup_requests: int = 4
    """The first N requests in arrival order are sent but left out of every metric."""
    seed: int = 0
    """Seed of the workload generator. The same seed and config give the same workload."""
    prompt_as_token_ids: bool = False
    """Synthetic: send prompts as token ids (exact lengths, no text) instead of text whose tokenization has
    exactly the sampled length. Trace prompts are always token ids."""
    prompt_salt: str = ""
    """Text put before every prompt: `""` none, `auto` a new random salt per run (`[run 3f9a0c1e] `), or the
    text itself. A rerun with the same seed sends identical prompts, which a long-lived server answers from
    its prefix cache (TTFT 960 ms became 200 ms against `servelab-serve`); a salt makes every run cold while
    prefixes shared within the run stay shared. `prompt_len` grows by the salt's tokens; the salt is recorded
    in `workload_info.json`."""
    concurrency: int | None = None
    """Short form of `arrival.process=closed arrival.concurrency=N`: a closed loop of N users (`servelab-run
    workload.concurrency=16`)."""
    ignore_eos: bool = True
    """Ask the target to ignore EOS, so every request produces its full output length."""
    prompt_len: LengthSection = field(default_factory=LengthSection)
    """Prompt length distribution (synthetic)."""
    output_len: LengthSection = field(default_factory=lambda: LengthSection(value=64))
    """Output length (`max_tokens`) distribution (synthetic)."""
    arrival: ArrivalSection = field(default_factory=ArrivalSection)
    """Arrival process (synthetic)."""
    shared_prefix: SharedPrefixSection = field(default_factory=SharedPrefixSection)
    """Shared system prompts (synthetic)."""
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    """Multi-turn sessions (synthetic)."""
    trace: TraceSection = field(default_factory=TraceSection)
    """Trace replay (`kind: trace`)."""


@dataclass
class TargetSection:
    """inprocess | server (servelab-serve started by the harness) | openai (any URL) | vllm (vLLM's
    server started by the harness from a side venv) | llamacpp (llama-cpp-python's server, the same)
    | simulated | pd (prefill/decode disaggregation:
    Mooncake master, servers and servelab-router, all local)."""

    kind: str = "inprocess"
    """See the table below."""
    url: str | None = None
    """`openai`: base URL of the server (without `/v1`). Required."""
    model_name: str | None = None
    """`openai`: the `model` sent in each request. null: the first model that `GET /v1/models` lists."""
    api_key: str | None = None
    """`openai`: sent as `Authorization: Bearer <key>`."""
    endpoint: str = "completions"  # completions | chat
    """`openai`: `completions` or `chat`. `chat` sends each prompt as one user message and needs text prompts,
    so it cannot be used with trace workloads or with `prompt_as_token_ids=true`."""
    startup_timeout_s: float = 180.0
    """`server`: how long to wait for the launched server to answer `/v1/models`."""
    request_timeout_s: float = 600.0
    """`openai`: total timeout of one request."""
    metrics_interval_s: float = 0.5  # /metrics scraping for HTTP targets
    """`server`, `openai`, `pd`, `vllm`: how often `/metrics` is scraped into `steps.csv` (gauges, and the
    cumulative `vllm:prefix_cache_*`, `vllm:num_preemptions` and request-phase histogram counters; once more
    after the last request). What the summary takes from them: below the table."""
    num_prefill: int = 1  # pd: prefill (kv_producer) instances
    """`pd`: prefill (kv_producer) instances."""
    num_decode: int = 1  # pd: decode (kv_consumer) instances
    """`pd`: decode (kv_consumer) instances."""
    router_policy: str = "round_robin"  # pd: round_robin | least_loaded
    """`pd`: `round_robin` or `least_loaded`."""
    kv_connector: str = "store"  # pd: store (Mooncake's store) | transfer (its TransferEngine, direct)
    """`pd`: how the KV goes from the prefill to the decode instances: `store` (`MooncakeStoreConnector`: the
    prefill instances put blocks into Mooncake's store, the decode instances get them) or `transfer`
    (`MooncakeTransferConnector`: the decode instances read the prefill instances' outboxes directly with
    Mooncake's TransferEngine; docs/kv_transfer.md)."""
    server_timing: bool = True
    """`server`, `openai`: ask for the servelab timing extension (header `X-Servelab-Timing: 1`, ignored by
    other servers; [serving.md](serving.md#server-side-timing-the-servelab-extension)). When the answer
    carries it, token times after the first are the engine's (per token, whatever the SSE chunking),
    `requests.csv` gets the engine's phases, TTFT and the front-end share, and the per-chunk ITL is reported
    beside the per-token one. false: chunk timing only."""
    server: dict[str, Any] = field(default_factory=dict)
    """`server`: keys of the started server's `server:` section, e.g. `'+target.server={stream_chunk_tokens:
    4}'` (host and port are the target's)."""
    venv: str | None = None
    """`vllm`: the venv holding vLLM (null: `~/.cache/servelab-peers/vllm`, made by `scripts/peers.sh`);
    `llamacpp`: the venv holding llama-cpp-python[server] (null: `~/.cache/servelab-peers/llamacpp`, made by
    `make peers-llamacpp-python`)."""
    hf_model: str | None = None
    """`vllm`: the model as an HF folder (null: `~/.cache/servelab-peers/smollm2-hf`)."""
    gguf: str | None = None
    """`llamacpp`: the GGUF file its server loads (null: the embedded default model's, the file servelab
    loads)."""
    peer_args: list[str] = field(default_factory=list)
    """`vllm`, `llamacpp`: more server flags, e.g. `'target.peer_args=[--enforce-eager]'`."""
    peer_env: dict[str, str] = field(default_factory=dict)
    """`vllm`, `llamacpp`: more environment, e.g. `'target.peer_env={VLLM_CPU_KVCACHE_SPACE: "2"}'` (defaults:
    1 GB KV cache, no core reserved)."""


@dataclass
class ProfilingSection:
    enabled: bool = False
    """Wrap engine steps in `torch.profiler` and write `trace.json` and `kernels.csv`. Applies to the
    `inprocess` and `offline` targets only."""
    wait: int = 2
    """torch.profiler schedule: steps skipped at the start of each cycle."""
    warmup: int = 1
    """Steps traced but discarded."""
    active: int = 3
    """Steps recorded per cycle."""
    repeat: int = 1
    """Number of cycles (0: repeat until the run ends)."""
    record_shapes: bool = False
    """Record operator input shapes."""
    telemetry: bool = True
    """Sample host CPU % and RSS, plus GPU utilisation, memory, power and SM clock through NVML when
    available, into `telemetry.csv` / `telemetry.json`. Applies to `inprocess`, `server` and `openai`, and
    records the harness process's RSS."""
    telemetry_interval_s: float = 0.5
    """Sampling period."""


@dataclass
class SLOSection:
    ttft_ms: float | None = None
    """Time-to-first-token limit per request (`slo/default.yaml`: 2000.0)."""
    tpot_ms: float | None = None
    """Time-per-output-token limit, not checked for 1-token outputs (`slo/default.yaml`: 200.0)."""
    e2el_ms: float | None = None
    """End-to-end latency limit (`slo/default.yaml`: null)."""


@dataclass
class SweepReportSection:
    throughput_metric: str = "output_throughput"
    """Sweep report: x axis of the throughput–latency curves."""
    latency_metrics: list[str] = field(default_factory=lambda: ["p99_ttft_ms", "p99_tpot_ms"])
    """Sweep report: one plot per metric."""
    best_by: str = "request_goodput"
    """Sweep report: the metric that ranks the jobs meeting the SLOs (falls back to `output_throughput` when
    absent)."""


@dataclass
class ReportSection:
    html: bool = True
    """Write `report.html` at the end of the run."""
    fallback_slo: SLOSection = field(default_factory=SLOSection)
    """Sweep report: the SLOs to use when the first job's `config.yaml` has none
    (`report.fallback_slo.ttft_ms` / `.tpot_ms` / `.e2el_ms`)."""
    sweep: SweepReportSection = field(default_factory=SweepReportSection)
    """Sweep report: its axes and ranking (`report.sweep.*`, below)."""


@dataclass
class SimSection:
    hardware: str = "h200"
    """A hardware profile: a name packaged in `engine/sim/profiles/` (`h200`, `h100`, `a100`, `cpu-2core`) or
    the path of a yaml file."""
    tp: int = 1
    """Tensor-parallel degree modelled; left at 1, the engine's `parallel.tensor_parallel_size` is used (both
    above 1 and different: an error)."""
    ep: bool = False
    """Expert parallelism over the `tp` ranks (MoE models): the roofline adds an `all_to_all` part (dispatch +
    combine) and reads whole experts per rank; false: `parallel.enable_expert_parallel`."""
    step_model: str = "roofline"  # roofline | path to a calibration file
    """`roofline`, or the path of a calibration (`.json`/`.yaml`) saved by `engine.sim.calibrated`."""
    dtype: str = "bf16"  # weights and KV cache on the simulated hardware: bf16 | fp16 | fp32 | fp8
    """Weights and KV cache on the simulated hardware (`bf16`, `fp16`, `fp32`, `fp8`); independent of
    `model.dtype`, which is the real engine's."""
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV cache
    """Fraction of the device memory for weights, activations and KV cache when `cache.num_blocks` is null."""
    token_id: int = 1000  # the id every simulated step samples (never EOS: outputs run to max_tokens)
    """The token every simulated step samples (modulo the vocabulary, never EOS: outputs run to
    `max_tokens`)."""


@dataclass
class RunSection:
    name: str = "default"
    """Name of the run folder: `${run.output_dir}/${run.name}/<YYYYmmdd-HHMMSS>`. For sweeps it is
    `${run.output_dir}/sweeps/${run.name}-<YYYYmmdd-HHMMSS>`."""
    output_dir: str = "runs"
    """Root of run and sweep folders (relative to the working directory)."""
    max_duration_s: float = 1800.0
    """Stops sending and cancels what is in flight after this long. The run keeps what was measured, and
    `error.txt` says `run stopped early: ...`. Applies to `inprocess`, `server`, `openai` and `simulated`
    (simulated seconds); `offline` hands every request over at once and does not apply it."""
    time_reference: bool = True  # measure a fixed CPU/GPU reference to normalise time metrics
    """Time a fixed CPU matmul loop in the harness process, on as many threads at once as the engine uses,
    before and after the run (the mean is kept) and store it as `summary.json` `time_reference_s`. The gate
    divides time metrics by it, so machines of different speed can be compared. Not measured with
    `target=simulated`."""
    stop_when_saturated: bool = False
    """Open loop: stop the run once it is saturated (see [Saturation](#saturation)); `stop_reason` and
    `error.txt` say `saturated`. Drivers' targets only (`inprocess`, `server`, `openai`, ...); the simulated
    target marks its runs but does not stop them."""
    time_slice_s: float | None = None  # the report's time slices (null: about ten per run)
    """The report's time slices, in seconds (null: about ten per run, of a round size); see [Steady
    state](#steady-state)."""


@dataclass
class RunConfig(EngineSections):
    """`servelab-run` (conf/run.yaml): the engine sections plus the experiment's."""

    workload: WorkloadSection = field(default_factory=WorkloadSection)
    """The requests to send and when (`WorkloadSection`)."""
    target: TargetSection = field(default_factory=TargetSection)
    """What serves them (`TargetSection`)."""
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    """torch.profiler and host/GPU telemetry (`ProfilingSection`)."""
    report: ReportSection = field(default_factory=ReportSection)
    """The HTML report and the sweep report (`ReportSection`)."""
    slo: SLOSection = field(default_factory=SLOSection)
    """Latency limits per request, for goodput and SLO-miss causes (`SLOSection`)."""
    sim: SimSection = field(default_factory=SimSection)
    """The simulated engine of `target=simulated` (`SimSection`)."""
    run: RunSection = field(default_factory=RunSection)
    """The run folder, its time limit and stop rules (`RunSection`)."""
    replay: str | None = None
    """A recorded run folder: resend its exact traffic (`servelab-run replay=RUN_DIR`, see [Replay and
    A/B](#replay-and-ab-on-identical-traffic))."""

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
    """The HTTP server's section (docs/serving.md)."""


@dataclass
class PlanSection:
    """What `servelab-plan` varies and how it searches (see docs/capacity.md)."""

    max_num_batched_tokens: list[int] | None = None
    """Candidate token budgets (null: `[scheduler.max_num_batched_tokens]`); every combination with
    `max_num_seqs` runs."""
    max_num_seqs: list[int] | None = None
    """Candidate sequence limits (null: `[scheduler.max_num_seqs]`)."""
    rates: list[float] | None = None  # offered request rates, req/s
    """Offered request rates, req/s. Exactly one of `rates`, `time_scales`, `search`."""
    time_scales: list[float] | None = None  # multipliers of the trace's own rate
    """Trace only: multipliers of the trace's own rate."""
    search: bool = False  # the highest rate meeting the SLOs, per configuration
    """Search, per configuration, the highest rate meeting the SLOs (needs `slo.ttft_ms` and/or
    `slo.tpot_ms`)."""
    search_start: float | None = None  # null: the trace's own rate (synthetic: 1 req/s)
    """First rate of the search (null: the trace's own rate, synthetic 1 req/s)."""
    search_tol: float = 0.05  # relative tolerance of the search
    """Relative tolerance of the search."""
    search_max: float = 1e6  # highest rate the search may try, req/s
    """Highest rate the search may try, req/s."""
    target_rate: float | None = None  # total rate to serve: replicas of the best configuration
    """Total rate to serve: prints the replicas of the best configuration needed."""
    slo_stat: str = "p99"  # the statistic of TTFT / TPOT held to slo.*: p99 | p95 | p90 | median | mean
    """Statistic of TTFT / TPOT held to the SLO: `p99`, `p95`, `p90`, `median`, `mean`."""
    verify: int = 0  # run the K best picks for real on `target` and compare (workloads/plan_verify.py)
    """Run the K best picks for real on `target` and compare them with the simulation
    (`workloads/plan_verify.py`; 0: none)."""
    out: str | None = None  # folder for plan.csv, plan.json, plan.html
    """Folder for plan.csv, plan.json, plan.html."""
    plain: bool = False  # plain-text table (no rich)
    """Plain-text table (no rich)."""
    progress: bool = False  # a progress bar per simulated run
    """A progress bar per simulated run."""


@dataclass
class PlanConfig(RunConfig):
    """`servelab-plan` (conf/plan.yaml): a run config (model, scheduler, cache, workload, sim,
    slo) plus the candidates and the load to plan over."""

    plan: PlanSection = field(default_factory=PlanSection)
    """What `servelab-plan` varies and how it searches (`PlanSection`)."""


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
