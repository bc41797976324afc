"""How many KV cache blocks fit on a device, per tensor-parallel rank.

    available = memory * gpu_memory_utilization - weight bytes / tp - activation reserve
    num_blocks = floor(available / (block_size * kv bytes per token per rank))
    kv bytes per token per rank = 2 * layers * ceil(kv_heads / tp) * head_dim * kv dtype bytes

Every rank holds the same block count (each stores its share of the KV heads), so the
rank's count is the engine's count. `layers` is the layers of one KV cache group, as the engine
counts a block (engine/kv_cache_spec.py): every layer for a model of one attention type, fewer
for one with sliding-window layers (Gemma 3: 3 of 18 for the 270M, 10 of 62 for the 27B), whose
requests then hold a block per group, and in a sliding group only the window's.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.dtypes import DTYPE_BYTES, canonical_dtype
from engine.kv_cache_spec import KVCacheGroupSpec, group_size, kv_cache_groups
from engine.model.arch import ModelArch
from engine.sim.hardware import HardwareProfile


def arch_kv_groups(arch: ModelArch) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV cache groups, as the engine's worker forms them."""
    return kv_cache_groups([arch.window(i) for i in range(arch.num_layers)])


def kv_bytes_per_token(arch: ModelArch, tp: int, kv_dtype: str) -> float:
    """K and V bytes one token of a block occupies on one rank: over the layers of one KV cache
    group (all layers for a model of one attention type; module note)."""
    kv_heads_rank = -(-arch.num_kv_heads // tp)
    layers = group_size(arch_kv_groups(arch))
    return 2 * layers * kv_heads_rank * arch.head_dim * DTYPE_BYTES[canonical_dtype(kv_dtype)]


def weight_bytes_per_rank(arch: ModelArch, tp: int, dtype: str) -> float:
    return arch.num_parameters() * DTYPE_BYTES[canonical_dtype(dtype)] / tp


def activation_reserve_bytes(
    arch: ModelArch, tp: int, dtype: str, max_num_batched_tokens: int, max_num_seqs: int
) -> float:
    """A rough peak of one step's transient memory on one rank.

    The widest live activations of a layer for every batched token (residual, q/k/v, the
    MLP's gate and up outputs) plus fp32 logits for every sequence. vLLM measures this
    with a profiling forward pass; a planner can only estimate it.
    """
    act = 2 if canonical_dtype(dtype) == "fp8" else DTYPE_BYTES[canonical_dtype(dtype)]
    s = arch
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / tp
    mlp = 2 * s.intermediate_size * max(1, s.num_experts_per_tok if s.is_moe else 1) / tp
    per_token = (2 * s.hidden_size + qkv + mlp) * act
    logits = max_num_seqs * s.vocab_size / tp * 4
    return max_num_batched_tokens * per_token + logits


@dataclass(frozen=True, slots=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    block_bytes: float  # one block on one rank
    weight_bytes: float  # per rank
    activation_bytes: float  # per rank
    available_bytes: float  # for the KV cache, per rank

    @property
    def max_tokens(self) -> int:
        """Tokens the cache holds (all sequences together)."""
        return self.num_blocks * self.block_size


def kv_capacity(
    arch: ModelArch,
    hw: HardwareProfile,
    *,
    tp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    activation_reserve: float | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
) -> KVCapacity:
    """Blocks that fit on one rank. `activation_reserve` (bytes) overrides the estimate.

    Raises ValueError when the weights and activations alone do not fit.
    """
    weights = weight_bytes_per_rank(arch, tp, dtype)
    if activation_reserve is None:
        activation_reserve = activation_reserve_bytes(arch, tp, dtype, max_num_batched_tokens, max_num_seqs)
    available = hw.memory_bytes * gpu_memory_utilization - weights - activation_reserve
    block_bytes = block_size * kv_bytes_per_token(arch, tp, kv_dtype or dtype)
    if available < block_bytes:
        raise ValueError(
            f"no room for a KV cache on {hw.name} x tp={tp}: {hw.memory_bytes * gpu_memory_utilization / 1e9:.1f} GB"
            f" usable, weights {weights / 1e9:.1f} GB, activations {activation_reserve / 1e9:.1f} GB per rank"
        )
    return KVCapacity(
        int(available // block_bytes), block_size, block_bytes, weights, activation_reserve, available
    )
