"""Typed engine configuration.

These dataclasses are the single source of truth for every engine knob. The offline
`LLM(...)` API builds them from keyword arguments (vLLM's engine-argument names);
`servelab-serve`'s config file fills them section by section (`from_sections`); the
workbench's Hydra tree (`conf/`) types its engine part with these same classes. Unknown
names fail loudly everywhere. Nothing in the engine reads environment variables for
behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.dtypes import MODEL_DTYPES

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
    load_format: str = "auto"  # auto | gguf | hf | dummy
    # auto | float32 | bfloat16 | float16. auto: the checkpoint's dtype on a GPU, the faster of
    # bfloat16 / float32 on a CPU (engine/platform.py); `validate()` resolves it.
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    # A max_model_len above the model's context (max_position_embeddings) is a start-up error
    # unless this is true (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, as a setting): past its context
    # a model's outputs may be wrong.
    allow_long_max_model_len: bool = False
    seed: int = 0
    # Override of the architecture's layer count (dummy shapes run faster with fewer).
    num_layers_override: int | None = None
    enforce_eager: bool = True  # vLLM's name: False compiles the forward (torch.compile / CUDA graphs)
    # bfloat16 on a CPU: reorder the linear weights once into oneDNN's layout (engine/model/cpu_linear.py).
    prepack_weights: bool = True
    # Build oneDNN's kernels for every step size at start-up (a few seconds), so that no step
    # waits for one (cpu_linear.padded_rows). None: on for servelab-serve, off for offline use.
    warm_up_linears: bool | None = None
    # bfloat16 on a CPU with AVX512-BF16, a GGUF checkpoint: decode steps of a few rows
    # (amx_linear.QUANT_MAX_ROWS, by block kind) read its Q4_1 / Q8_0 matrices as stored and multiply the
    # checkpoint's own (unrounded) weights, summed in float32 (a third of the bytes).
    quantized_decode: bool = True
    # vLLM's VLLM_BATCH_INVARIANT, as a setting: every step size multiplies the same weights in the
    # same order, so a row's logits (and a greedy request's tokens) do not depend on which other
    # rows share its step; the quant blocks are not read (engine/model/forward_plan.py). bfloat16,
    # eager, one rank, the torch attention backend on a CPU with AMX or AVX512-BF16; else a
    # start-up error.
    batch_invariant: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks. None: derived from kv_cache_memory_gb.
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # auto: same as the model dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # A prefill chunk of one request is capped at this many tokens (0: no cap).
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # fcfs | priority
    # Test/diagnostic knob: sleep this long after every step (gates use it to
    # produce a run that is slow on purpose).
    step_delay_ms: float = 0.0
    async_scheduling: bool = False  # vLLM's name: schedule step N+1 while step N runs


@dataclass
class AttentionConfig:
    backend: str = "torch"  # torch | triton | flash_attn | flashinfer


@dataclass
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda
    # torch intra-op threads on CPU (0: leave torch's default).
    num_threads: int = 0


DISTRIBUTED_EXECUTOR_BACKENDS = ("auto", "uni", "mp")


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
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "auto"  # auto | uni | mp
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    nnodes: int = 1
    # torch.distributed backend: auto (nccl on a GPU, gloo on a CPU) | gloo | nccl
    dist_backend: str = "auto"
    # Seconds a step may wait on a silent worker before the executor gives up on it.
    worker_timeout_s: float = 300.0

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
@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`), engine/spec_decode/.

    `method`: None (off) or "ngram" (prompt lookup: drafts are the tokens that followed
    the most recent earlier occurrence of the request's last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`). Up to `num_speculative_tokens`
    drafts per request per step, verified in one forward.
    """

    method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def validate(self) -> None:
        if self.method is None:
            return
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method: only 'ngram' is supported, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")


def _speculative_from(value: Any) -> SpeculativeConfig:
    """`speculative_config=` as vLLM takes it: a dict (or None: off)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a dict, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return SpeculativeConfig(**value)


@dataclass
class StructuredOutputsConfig:
    """Grammar compilation for constrained requests (vLLM's `structured_outputs_config`),
    engine/structured_output/.

    `grammar_cache_size`: compiled grammars kept, one per distinct spec; past it the least
    recently used is dropped (its next request compiles it again). `compile_timeout_s`: a
    compile still running this long after it started fails its requests (HTTP 400 naming the
    timeout; offline an error result) while other constrained requests go on.
    """

    grammar_cache_size: int = 128
    compile_timeout_s: float = 10.0

    def validate(self) -> None:
        if not isinstance(self.grammar_cache_size, int) or self.grammar_cache_size < 1:
            raise ValueError("structured_outputs_config.grammar_cache_size must be an integer >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError("structured_outputs_config.compile_timeout_s must be > 0")


KV_CONNECTORS = ("CPUOffloadConnector", "MooncakeStoreConnector", "MooncakeTransferConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """vLLM's `kv_transfer_config`: an external KV store behind the connector boundary
    (engine/kv_transfer/). `kv_connector` None: no connector.

    `kv_role`: kv_producer saves computed blocks and never loads (a prefill instance),
    kv_consumer loads and never saves (a decode instance), kv_both does both (offload,
    a shared store); "producer" / "consumer" / "both" are accepted as short names.
    `kv_connector_extra_config`: the connector's own options (docs/kv_transfer.md).
    """

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def validate(self) -> None:
        if self.kv_role in ("producer", "consumer", "both"):
            self.kv_role = f"kv_{self.kv_role}"
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer.kv_connector must be one of {', '.join(KV_CONNECTORS)} (or null), "
                f"got {self.kv_connector!r}"
            )


# Keyword arguments of `EngineConfig.from_kwargs` under another name: key -> (section, field).
KWARG_ALIASES: dict[str, tuple[str, str]] = {
    "num_gpu_blocks_override": ("cache", "num_blocks"),  # vLLM's name for the KV block count
    "attention_backend": ("attention", "backend"),
}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

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
        self.speculative_config.validate()
        self.structured_outputs_config.validate()
        if self.speculative_config.enabled and self.scheduler.async_scheduling:
            raise ValueError("speculative_config with async_scheduling=True is not supported yet; choose one of them")
        s, c = self.scheduler, self.cache
        self.kv_transfer.validate()
        if self.kv_transfer.kv_connector is not None and s.async_scheduling:
            raise ValueError("kv_transfer with async_scheduling=True is not supported yet; choose one of them")
        tp = self.parallel.tensor_parallel_size
        if self.kv_transfer.kv_connector is not None and tp > 1:  # a connector moves one rank's KV cache
            raise ValueError(f"kv_transfer.kv_connector={self.kv_transfer.kv_connector} with "
                             f"parallel.tensor_parallel_size={tp} is not supported yet; use tensor_parallel_size=1 "
                             f"or no connector")
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
