"""Mixtral-style top-k routed mixture of SwiGLU experts.

Routing follows HF Mixtral: softmax over all experts in float32, keep the top k,
renormalise them to sum to one (Qwen3-MoE only where its config's `norm_topk_prob` says so).
Dispatch sorts the (token, expert) pairs by expert so each expert runs one GEMM over all of its
tokens: a Python loop over experts (at most `num_experts` iterations per layer), never over tokens.

HF weight names (under `model.layers.N.block_sparse_moe.`): `gate.weight` [E, H] (the
router) and `experts.E.w1/w3/w2.weight` (gate [I, H], up [I, H], down [H, I]); they are
stored stacked here as `w13` [E, 2I, H] (w1 rows first) and `w2` [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, k] float32, summing to 1 if `renormalize`, else the
    top k softmax probabilities as they are; expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = probs.topk(top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..{num_experts}, got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)  # [T, k]
        flat_experts = experts.flatten()  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert
        token_of = order // self.top_k  # [T*k] token row of each sorted pair
        pair_weight = weights.flatten()[order].to(x.dtype)  # [T*k]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start : start + n]  # [n]
            y = self.expert_forward(e, x[rows]) * pair_weight[start : start + n, None]  # [n, H]
            out.index_add_(0, rows, y)
            start += n
        return out

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU: x [n, H] -> [n, H]."""
        gate_up = x @ self.w13[e].t()  # [n, 2I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return (F.silu(gate) * up) @ self.w2[e].t()
