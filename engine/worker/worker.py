"""A worker owns one device: the model, the paged KV cache tensors and the model runner."""

from __future__ import annotations

import logging

import torch

from engine.attention.registry import get_attention_backend
from engine.config import CacheConfig, ConfigLimitError, EngineConfig
from engine.dtypes import torch_dtype
from engine.hugepages import zeros_huge_in_background
from engine.kernels import options as kernel_options
from engine.kernels.kernel_choices import quantized_decode_fallback
from engine.kv_cache_spec import KVCacheGroupSpec, group_size, kv_cache_groups, layer_placement, tokens_alone
from engine.kv_transfer.base import KVConnectorBase, KVConnectorRole
from engine.kv_transfer.factory import create_kv_connector
from engine.kv_transfer.worker_step import execute_with_connector
from engine.model.gguf_loader import gguf_layer_kinds
from engine.model.layers import RotaryEmbedding
from engine.platform import resolve_device, resolve_dtype
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def check_kv_capacity(max_model_len: int, requested: int | None, num_blocks: int, cache: CacheConfig,
                      holds: int | None = None) -> int:
    """The context length the KV cache can serve: `max_model_len` when `num_blocks` blocks hold
    one request of that length (`holds` tokens: `num_blocks * block_size` unless given, as
    `kv_cache_spec.tokens_alone` counts it for several KV cache groups). A `requested` (ModelConfig.max_model_len) the cache cannot hold
    is a ConfigLimitError naming both numbers and the settings to change (vLLM refuses it at
    start-up too); with none requested, the model's own context is lowered to the cache's, with
    a warning, so that longer prompts are refused at the door instead of failing in the scheduler."""
    holds = num_blocks * cache.block_size if holds is None else holds
    if max_model_len <= holds:
        return max_model_len
    sized_by = f"cache.num_blocks={num_blocks}" if cache.num_blocks else f"cache.kv_cache_memory_gb={cache.kv_cache_memory_gb:g}"
    if requested is not None:
        raise ConfigLimitError(
            f"model.max_model_len={max_model_len} is more than the KV cache holds ({holds} tokens: {num_blocks} "
            f"blocks of {cache.block_size}, {sized_by}); raise {sized_by.split('=')[0]} or lower model.max_model_len"
        )
    logger.warning("max_model_len: the model's context of %d tokens is more than the KV cache holds; serving %d "
                   "(%s; raise it for longer requests)", max_model_len, holds, sized_by)
    return holds


def cover_positions(model: torch.nn.Module, max_model_len: int) -> None:
    """Extend the model's RoPE table to `max_model_len` positions when it is longer than the model's
    context (model.allow_long_max_model_len); a no-op otherwise, and for models without one."""
    for rotary in model.modules():  # (Gemma 3 has two)
        if isinstance(rotary, RotaryEmbedding) and rotary.max_positions < max_model_len:
            rotary.max_positions = max_model_len
            rotary.rebuild()


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        kernel_options.configure(config.kernels)  # before anything loads a kernel (engine/kernels/options.py)
        self.device = resolve_device(config.device.device)
        if config.device.num_threads > 0 and self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads)
        config.model.dtype = resolve_dtype(config.model.dtype, self.device)
        self.dtype = torch_dtype(config.model.dtype)
        cache_dtype = config.cache.cache_dtype
        self.kv_dtype = self.dtype if cache_dtype == "auto" else torch_dtype(cache_dtype)
        self.model_runner: ModelRunner | None = None
        self.compile_time = 0.0  # seconds of compile + warm-up at start-up (enforce_eager=False)
        self.kv_bytes_per_block = 0
        # The model's KV cache groups (engine/kv_cache_spec.py): one of every layer for most models.
        self.kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()
        self.kv_connector: KVConnectorBase | None = None  # the worker half (engine/kv_transfer/)

    def load_and_allocate(self) -> int:
        """Load the model, allocate the KV cache; returns the number of KV blocks.

        The cache's shape needs only the architecture (the checkpoint's metadata), so its pages
        are faulted in on a background thread while the weights load and pack
        (`hugepages.zeros_huge_in_background`: ~1-3 s per GiB in some VMs)."""
        from engine.model.loader import load_model, resolve_model

        torch.manual_seed(self.config.model.seed)
        backend = get_attention_backend(self.config.attention.backend, self.device)
        resolved = resolve_model(self.config.model)  # metadata only; the weights load below
        arch = resolved[0]
        self.arch = arch
        model_cfg = self.config.model
        self.max_model_len = arch.max_model_len(model_cfg.max_model_len, model_cfg.allow_long_max_model_len)
        cache = self.config.cache
        # one tensor per layer of a group, shared by the groups' layers (engine/kv_cache_spec.py)
        groups = self.kv_cache_groups = kv_cache_groups([arch.window(i) for i in range(arch.num_layers)])
        num_tensors = group_size(groups)
        per_block = kv_bytes_per_block(num_tensors, cache.block_size, arch.num_kv_heads, arch.head_dim, self.kv_dtype)
        self.kv_bytes_per_block = per_block
        num_blocks = cache.num_blocks or max(2, int(cache.kv_cache_memory_gb * (1 << 30) // per_block))
        holds = tokens_alone(groups, num_blocks, cache.block_size, self.config.scheduler.max_num_batched_tokens)
        self.max_model_len = check_kv_capacity(self.max_model_len, model_cfg.max_model_len, num_blocks, cache, holds)
        shape = (2, num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim)
        pending_kv = zeros_huge_in_background(shape, self.kv_dtype, num_tensors, self.device)
        self.model = load_model(self.config.model, backend, self.device, resolved)
        cover_positions(self.model, self.max_model_len)
        if self.config.model.prepack_weights and hasattr(self.model, "prepack"):
            packed = self.model.prepack(self.config.model.quantized_decode)
            if packed:
                logger.info("prepacked %d weight matrices for oneDNN", packed)
            if (fallback := quantized_decode_fallback(self.model, self.config.model.quantized_decode,
                                                      self.config.model.batch_invariant,
                                                      gguf_layer_kinds)) is not None:
                logger.warning(fallback)
        tensors = pending_kv.result()
        kv_caches = [tensors[j] for _, j in layer_placement(groups, arch.num_layers)]  # one per layer
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, cache.block_size,
                    num_blocks * per_block / (1 << 20))
        if len(groups) > 1:
            logger.info("KV cache groups: %s (%d layers each, one shared block pool)",
                        ", ".join(f"{g.kind}{'' if g.sliding_window is None else f'({g.sliding_window})'}" for g in groups),
                        num_tensors)  # fmt: skip
        self.model_runner = ModelRunner(
            self.model,
            backend,
            kv_caches,
            cache.block_size,
            self.max_model_len,
            self.config.scheduler.max_num_seqs,
            self.device,
            enforce_eager=self.config.model.enforce_eager,
            num_kv_cache_groups=len(groups),
        )
        self.compile_time = self.model_runner.warm_up()
        warm_up_linears = getattr(getattr(self.model, "model", None), "warm_up_linears", None)
        if self.config.model.warm_up_linears and warm_up_linears is not None:  # oneDNN's kernels, before serving
            seconds = warm_up_linears(self.config.scheduler.max_num_batched_tokens)
            if seconds:
                logger.info("built oneDNN's linear kernels for every step size in %.1f s", seconds)
            self.compile_time += seconds
        self.kv_connector = create_kv_connector(self.config, KVConnectorRole.WORKER, per_block)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(kv_caches)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None, "load_and_allocate() first"
        connector = self.kv_connector
        if connector is None:
            return self.model_runner.execute_model(scheduler_output)
        return execute_with_connector(connector, self.model_runner, scheduler_output, len(self.model_runner.kv_caches))

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
