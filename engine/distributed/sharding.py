"""Which slice of the model one tensor-parallel rank holds.

Attention is split by KV head: each rank keeps a contiguous range of KV heads and the query
heads of their groups, so a rank's attention and its KV cache need nothing from the others.
Unlike vLLM (which asks `num_heads % tp == 0`), the split may be uneven: SmolLM2's 9 query /
3 KV heads over 2 ranks give rank 0 two KV groups (6 query heads) and rank 1 one (3 query
heads). With fewer KV heads than ranks each KV head is replicated on `tp / num_kv_heads`
ranks, which then split its query heads (this needs `tp % num_kv_heads == 0` and
`num_heads % tp == 0`, as in vLLM). The MLP's intermediate size, each expert's (without expert
parallelism) and the vocabulary are split in balanced contiguous ranges; with expert
parallelism the experts are partitioned instead.

`local_arch` is the architecture one rank builds: the same `LlamaForCausalLM` then has the
rank's shapes (its q/kv heads, intermediate slice, vocabulary slice), and `shard_param` cuts a
full parameter (under the model's own fused names) down to that rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.model.arch import ModelArch


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` of `total` items cut into `parts` balanced contiguous ranges."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class RankPlan:
    """One rank's slice of every sharded dimension."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]  # (first query head, count)
    kv_heads: tuple[int, int]  # (first KV head, count)
    intermediate: tuple[int, int]  # dense MLP / per-expert intermediate rows (full range under EP)
    vocab: tuple[int, int]  # (first vocabulary row, count)
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary slice (the logits gather needs them)
    experts: tuple[int, int]  # (first expert, count): all experts unless expert parallel
    expert_parallel: bool = False


def head_split(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((q start, q count), (kv start, kv count)) of `rank`; ValueError when the heads cannot split."""
    if num_heads % num_kv_heads:
        raise ValueError(f"model: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start, kv_count = split_range(num_kv_heads, tp, rank)
        return (kv_start * group, kv_count * group), (kv_start, kv_count)
    if tp % num_kv_heads or num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {num_heads} query heads / {num_kv_heads} KV heads: with fewer "
            f"KV heads than ranks, tensor_parallel_size must be a multiple of the KV heads and divide the query heads"
        )
    q_count = num_heads // tp
    q_start = rank * q_count
    return (q_start, q_count), (q_start // group, 1)


def rank_plan(arch: ModelArch, tp: int, rank: int, expert_parallel: bool = False) -> RankPlan:
    """ValueError (one line, naming the setting) when `arch` cannot be split over `tp` ranks."""
    q, kv = head_split(arch.num_heads, arch.num_kv_heads, tp, rank)
    if expert_parallel and not arch.is_moe:
        raise ValueError(f"enable_expert_parallel: model {arch.name!r} has no experts")
    if expert_parallel and arch.num_experts < tp:
        raise ValueError(f"enable_expert_parallel: {arch.num_experts} experts cannot be split over {tp} ranks")
    if arch.intermediate_size < tp or arch.vocab_size < tp:
        raise ValueError(f"tensor_parallel_size={tp} is larger than the model's intermediate size or vocabulary")
    experts = split_range(arch.num_experts, tp, rank) if expert_parallel else (0, arch.num_experts)
    return RankPlan(
        rank=rank,
        world_size=tp,
        q_heads=q,
        kv_heads=kv,
        intermediate=(0, arch.intermediate_size) if expert_parallel else split_range(arch.intermediate_size, tp, rank),
        vocab=split_range(arch.vocab_size, tp, rank),
        vocab_sizes=tuple(split_range(arch.vocab_size, tp, r)[1] for r in range(tp)),
        experts=experts,
        expert_parallel=expert_parallel,
    )


def local_arch(arch: ModelArch, plan: RankPlan) -> ModelArch:
    """The architecture whose `LlamaForCausalLM` has exactly this rank's parameter shapes
    (experts stay global: the expert-parallel MoE block holds its own slice)."""
    return replace(
        arch,
        num_heads=plan.q_heads[1],
        num_kv_heads=plan.kv_heads[1],
        intermediate_size=plan.intermediate[1],
        vocab_size=plan.vocab[1],
    )


def _rows(t: torch.Tensor, dim: int, *ranges: tuple[int, int]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, start, count) for start, count in ranges], dim=dim)


def shard_param(name: str, full: torch.Tensor, arch: ModelArch, plan: RankPlan) -> torch.Tensor:
    """This rank's slice of the full parameter `name` (the model's own, fused names)."""
    d = arch.head_dim
    (q0, nq), (k0, nk) = plan.q_heads, plan.kv_heads
    i0, ni = plan.intermediate
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return full.narrow(0, *plan.vocab)
    if name.endswith("self_attn.qkv_proj.weight"):  # [(Hq + 2 Hkv) D, H]
        k_base, v_base = arch.q_size, arch.q_size + arch.kv_size
        return _rows(full, 0, (q0 * d, nq * d), (k_base + k0 * d, nk * d), (v_base + k0 * d, nk * d))
    if name.endswith("self_attn.o_proj.weight"):  # [H, Hq D]
        return full.narrow(1, q0 * d, nq * d)
    if name.endswith("mlp.gate_up_proj.weight"):  # [2I, H], gate rows first
        return _rows(full, 0, (i0, ni), (arch.intermediate_size + i0, ni))
    if name.endswith("mlp.down_proj.weight"):  # [H, I]
        return full.narrow(1, i0, ni)
    if name.endswith("block_sparse_moe.w13"):  # [E, 2I, H]
        full = full.narrow(0, *plan.experts)
        return _rows(full, 1, (i0, ni), (arch.intermediate_size + i0, ni))
    if name.endswith("block_sparse_moe.w2"):  # [E, H, I]
        return full.narrow(0, *plan.experts).narrow(2, i0, ni)
    return full  # norms, the router: replicated
