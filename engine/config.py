"""Typed engine configuration.

These dataclasses are the single source of truth for every engine knob. Hydra
(`conf/`) fills them as structured configs; the offline `LLM(...)` API builds them
from keyword arguments. Nothing in the engine reads environment variables for
behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_MODEL = "smollm2"


@dataclass
class ModelConfig:
    """Which weights to load and how.

    `model` is a path to a `.gguf` file, a Hugging Face folder (config.json +
    safetensors), the name of a config under `conf/model/` (e.g. "llama-3-8b"),
    or "smollm2" for the embedded default model.
    """

    model: str = DEFAULT_MODEL
    load_format: str = "auto"  # auto | gguf | hf | dummy
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    # Override of the architecture's layer count (dummy shapes run faster with fewer).
    num_layers_override: int | None = None


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


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, as `LLM(model=..., block_size=16)`.

        Each keyword must name a field of exactly one sub-config; `attention_backend`
        is accepted as an alias for `AttentionConfig.backend`.
        """
        cfg = cls()
        cfg.model.model = model
        if "attention_backend" in kwargs:
            cfg.attention.backend = kwargs.pop("attention_backend")
        sections: list[Any] = [cfg.model, cfg.cache, cfg.scheduler, cfg.attention, cfg.device]
        for key, value in kwargs.items():
            owners = [s for s in sections if key in {f.name for f in fields(s)}]
            if not owners:
                raise ValueError(f"unknown engine argument {key!r}")
            setattr(owners[0], key, value)
        cfg.validate()
        return cfg

    @classmethod
    def from_sections(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from nested dicts (a resolved Hydra config); keys a section does not know
        (e.g. `model.arch`, kept for dummy shapes) are ignored, missing ones keep defaults."""
        cfg = cls()
        for f in fields(cls):
            section = getattr(cfg, f.name)
            known = {sf.name for sf in fields(section)}
            for key, value in (data.get(f.name) or {}).items():
                if key in known:
                    setattr(section, key, value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        s, c = self.scheduler, self.cache
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
        if self.model.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.model.dtype!r}")
