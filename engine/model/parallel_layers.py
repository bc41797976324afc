"""Tensor- and expert-parallel versions of the Llama / Mixtral model.

`ParallelLlamaForCausalLM` is `LlamaForCausalLM` built with one rank's shapes
(`engine.distributed.sharding.local_arch`) and four module swaps, each keeping the parameter
names, so weight loading and the model's forward are unchanged:

- `VocabParallelEmbedding`: the rank's vocabulary rows; other ids give zeros; all-reduce.
- `RowParallelLinear` for `o_proj` and `down_proj`: input split by head / intermediate
  range, output all-reduced (the one all-reduce after attention, the one after the MLP).
  `qkv_proj` and `gate_up_proj` are plain `nn.Linear`s of the rank's fused rows (column
  parallel needs no communication: each rank keeps its heads / its intermediate slice).
- MoE without expert parallelism: each expert's intermediate rows are split (`TPMoEBlock`,
  all-reduced); with it, `ExpertParallelMoE` holds whole experts and moves tokens through a
  `MoEDispatcher` (engine/distributed/moe_dispatch.py).
- `compute_logits`: the rank's vocabulary slice of the logits, gathered on rank 0 only
  (other ranks get an empty tensor: rank 0 samples and broadcasts the ids).

`load_parallel_model` fills the rank's parameters by slicing full tensors at load time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.distributed import parallel_state as ps
from engine.distributed.moe_dispatch import MoEDispatcher, make_dispatcher
from engine.distributed.sharding import RankPlan, local_arch, shard_param, split_range
from engine.model import registry
from engine.model.arch import ModelArch
from engine.model.dummy import DUMMY_STD
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.moe import MoEBlock, route


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_rank @ W_rank^T): x and W split along the input dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ps.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Rows `vocab_start .. vocab_start + num_embeddings - 1` of the embedding table."""

    def __init__(self, vocab_start: int, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        x.masked_fill_(outside[:, None], 0.0)
        return ps.all_reduce(x)


class TPMoEBlock(MoEBlock):
    """Every expert's intermediate rows split over the ranks; the routed sum is all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ps.all_reduce(super().forward(x))


class ExpertParallelMoE(nn.Module):
    """Whole experts `first_expert .. first_expert + num_local - 1` on this rank.

    The hidden states are replicated over the ranks (attention is tensor parallel), so each
    rank routes its own contiguous share of the tokens, dispatches them to the ranks of their
    experts and combines the answers; one all-reduce then replicates the full [T, H] again.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
        experts: tuple[int, int], dispatcher: MoEDispatcher | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.intermediate_size = num_experts, top_k, intermediate_size
        self.first_expert, self.num_local = experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router: replicated
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size))
        self.dispatcher = dispatcher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (the same on every rank) -> [T, H]."""
        info = ps.info()
        assert self.dispatcher is not None, "set a dispatcher before the forward"
        start, count = split_range(x.shape[0], info.world_size, info.rank)
        mine = x[start : start + count]  # [t, H]
        weights, experts = route(self.gate(mine), self.top_k)  # [t, k]
        layout = self.dispatcher.get_dispatch_layout(experts, self.num_experts)
        recv = self.dispatcher.dispatch(mine, experts, weights, layout)
        y = self.local_experts(recv.x, recv.topk_idx, recv.topk_weights)  # [N, H]
        out = torch.zeros_like(x)
        out[start : start + count] = self.dispatcher.combine(y, recv.handle)
        return ps.all_reduce(out)

    def local_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], topk_idx [N, k] local ids (-1: elsewhere) -> sum of this rank's weighted experts [N, H]."""
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            rows, slot = (topk_idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (x[rows] @ self.w13[e].t()).split(self.intermediate_size, dim=-1)  # [n, I] each
            y = (F.silu(gate) * up) @ self.w2[e].t()  # [n, H]
            out.index_add_(0, rows, y * topk_weights[rows, slot, None].to(x.dtype))
        return out


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's slice of a Llama / Mixtral model (module note)."""

    def __init__(self, arch: ModelArch, plan: RankPlan, attn_backend: AttentionBackend) -> None:
        super().__init__(local_arch(arch, plan), attn_backend, arch.max_position_embeddings)
        self.full_arch, self.plan = arch, plan
        a, h = self.arch, arch.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(plan.vocab[0], plan.vocab[1], h)
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.o_proj = RowParallelLinear(a.q_size, h, bias=False)
            if not a.is_moe:
                layer.mlp.down_proj = RowParallelLinear(a.intermediate_size, h, bias=False)
            elif plan.expert_parallel:
                layer.block_sparse_moe = ExpertParallelMoE(  # type: ignore[assignment]
                    h, a.intermediate_size, a.num_experts, a.num_experts_per_tok, plan.experts
                )
            else:
                layer.block_sparse_moe = TPMoEBlock(h, a.intermediate_size, a.num_experts, a.num_experts_per_tok)

    def prepack(self, quantized_decode: bool = True) -> int:
        """No oneDNN prepacking here (nor the decode kernels'): it swaps every `nn.Linear`'s forward
        for a packed GEMM, which would drop the all-reduce of `RowParallelLinear` (and the LM
        head's gather). Returns 0."""
        return 0

    def set_dispatcher(self, dispatcher: MoEDispatcher) -> None:
        for module in self.modules():
            if isinstance(module, ExpertParallelMoE):
                module.dispatcher = dispatcher

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] float32 on rank 0 (whatever `upcast` says: the
        gather is in float32); an empty tensor on the others."""
        local = super().compute_logits(hidden)  # [N, vocab slice]
        if hidden.shape[0] == 0:  # every rank knows N: no collective for an empty step
            return local.new_empty((0, self.full_arch.vocab_size))
        full = ps.gather_last_dim(local, list(self.plan.vocab_sizes))
        return full if full is not None else local.new_empty(0)


@torch.no_grad()
def load_parallel_model(
    model_config: ModelConfig, attn_backend: AttentionBackend, device: torch.device, plan_for: Callable[[ModelArch], RankPlan]
) -> ParallelLlamaForCausalLM:
    """Build this rank's model on `device` and fill it by slicing the full weights.

    GGUF / safetensors: the full model is loaded on the CPU as for one rank, then every
    parameter is cut to the rank's slice (peak host memory: one full copy per rank). Dummy
    weights: each full tensor is drawn in turn with the one-rank generator sequence and cut,
    so every tensor-parallel size holds the same weights as one rank (peak: one full tensor).
    """
    from engine.model.loader import _dtype, build_on_meta, materialize, resolve_model, resolve_source

    if model_config.batch_invariant:  # the decode kernels need the whole matrices (prepack: why)
        raise ValueError("model.batch_invariant: one rank only (tensor_parallel_size 1)")
    arch, weights_fn, _ = resolve_model(model_config)
    if not registry.family(arch.family).tensor_parallel:  # shard_param knows the Llama / Mixtral parameters only
        raise ValueError(f"parallel.tensor_parallel_size: the {arch.family} family runs on one rank only "
                         f"(tensor parallel: {', '.join(f.name for f in registry.FAMILIES if f.tensor_parallel)})")
    plan = plan_for(arch)
    dtype = _dtype(model_config.dtype, resolve_source(model_config.model), device)
    with build_on_meta():
        model = ParallelLlamaForCausalLM(arch, plan, attn_backend)
    model = materialize(model, device, dtype)
    model.model.rotary_emb.rebuild(device, dtype)
    params = dict(model.named_parameters())
    if weights_fn is None:
        with build_on_meta():
            full_model = LlamaForCausalLM(arch, attn_backend)
        gen = torch.Generator().manual_seed(model_config.seed)
        for name, meta in full_model.named_parameters():  # the order init_dummy_weights draws in
            if meta.dim() == 1 and name.endswith("norm.weight"):
                full = torch.ones(meta.shape, dtype=dtype)
            else:
                full = torch.empty(meta.shape, dtype=dtype).normal_(0.0, DUMMY_STD, generator=gen)
            params[name].copy_(shard_param(name, full, arch, plan))
    else:  # the one-rank model on the CPU (as engine.model.loader.load_model builds it), then sliced
        with build_on_meta():
            full_model = LlamaForCausalLM(arch, attn_backend)
        full_model = materialize(full_model, torch.device("cpu"), dtype)
        full_model.load_weights(weights_fn())
        full_params = dict(full_model.named_parameters())
        for name, param in params.items():
            param.copy_(shard_param(name, full_params[name].data, arch, plan))
        del full_params, full_model
    model._column_major_linears()
    if plan.expert_parallel:
        model.set_dispatcher(make_dispatcher(arch.num_experts, arch.hidden_size * dtype.itemsize, device))
    return model.eval()
