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
    seed: int = 0
    # Override of the architecture's layer count (dummy shapes run faster with fewer).
    num_layers_override: int | None = None
    enforce_eager: bool = True  # vLLM's name: False compiles the forward (torch.compile / CUDA graphs)


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


KV_CONNECTORS = ("CPUOffloadConnector", "MooncakeStoreConnector")
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
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, as `LLM(model=..., block_size=16)`.

        Each keyword names a field of one section, under vLLM's engine-argument name where
        the meaning is the same (`dtype`, `seed`, `max_model_len`, `enforce_eager`,
        `block_size`, `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`);
        `KWARG_ALIASES` adds vLLM's `num_gpu_blocks_override` (= `num_blocks`) and
        `attention_backend` (= `AttentionConfig.backend`); `kv_transfer_config` takes a
        `KVTransferConfig` or a dict of its fields. An unknown keyword is a ValueError.
        """
        cfg = cls()
        cfg.model.model = model
        sections: list[Any] = [getattr(cfg, f.name) for f in fields(cls)]
        for key, value in kwargs.items():
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
        s, c = self.scheduler, self.cache
        check_execution_modes(self.model, s)
        self.kv_transfer.validate()
        if self.kv_transfer.kv_connector is not None and s.async_scheduling:
            raise ValueError("kv_transfer with async_scheduling=True is not supported yet; choose one of them")
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
        from engine.platform import resolve_engine_dtype

        self.model.dtype = resolve_engine_dtype(self.model.dtype, self.device.device, self.model.model)


def check_execution_modes(model: ModelConfig, scheduler: SchedulerConfig) -> None:
    """ValueError for a combination the engine cannot run yet.

    async_scheduling runs the forward on the executor's thread, where the compiled forward
    (enforce_eager=False) fails dynamo's guards on every step until the recompile limit stops it.
    """
    if scheduler.async_scheduling and not model.enforce_eager:
        raise ValueError(
            "async_scheduling=True with enforce_eager=False is not supported yet (the compiled forward "
            "recompiles on the executor thread); choose one of them"
        )
