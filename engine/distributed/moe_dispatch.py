"""MoE expert-parallel communication: dispatch tokens to the ranks of their experts, combine back.

The interface follows DeepEP's normal-mode buffer, with its three steps explicit:

    layout = d.get_dispatch_layout(topk_idx, num_experts)   # counts: tokens per rank / expert
    recv = d.dispatch(x, topk_idx, topk_weights, layout)    # each token once to every rank
                                                            # holding one of its top-k experts
    y = experts(recv.x, recv.topk_idx, recv.topk_weights)   # local experts, weighted sum per row
    out = d.combine(y, recv.handle)                         # each (token, rank) row back once,
                                                            # summed per token
`recv.topk_idx` holds *local* expert ids, -1 where the expert lives on another rank (as in
DeepEP). `AllToAllDispatcher` is always available: counts are exchanged with one
`all_to_all_single`, then rows, expert ids and weights with one each. `DeepEPDispatcher` wraps
`deep_ep.Buffer` and is chosen by `make_dispatcher` only on a GPU where `deep_ep` imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed import parallel_state as ps
from engine.distributed.sharding import split_range


@dataclass
class DispatchLayout:
    num_tokens_per_rank: torch.Tensor  # [R] int64: tokens sent to each rank
    num_tokens_per_expert: torch.Tensor  # [E] int64: (token, expert) pairs per expert
    is_token_in_rank: torch.Tensor  # [T, R] bool


@dataclass
class DispatchHandle:
    """What combine needs to send the rows back: the sender's token of every sent row and the splits."""

    send_token_idx: torch.Tensor  # [S] int64: token index of each sent row, grouped by destination rank
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int  # T on the sender
    native: Any = None  # a backend's own handle (DeepEP)


@dataclass
class Received:
    x: torch.Tensor  # [N, H] hidden states of the received rows
    topk_idx: torch.Tensor  # [N, k] int64 local expert ids, -1: not on this rank
    topk_weights: torch.Tensor  # [N, k] float32
    handle: DispatchHandle


class MoEDispatcher(ABC):
    """Dispatch / combine between the router's top-k and the experts (module note)."""

    @abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout: ...

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layout: DispatchLayout
    ) -> Received: ...

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor: ...


class AllToAllDispatcher(MoEDispatcher):
    """torch.distributed.all_to_all_single (gloo on a CPU, NCCL on a GPU); rank r holds the
    experts `split_range(num_experts, world_size, r)`."""

    def __init__(self, num_experts: int, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        ranges = [split_range(num_experts, world_size, r) for r in range(world_size)]
        self.rank_of_expert = torch.tensor([r for r, (_, n) in enumerate(ranges) for _ in range(n)], dtype=torch.int64)
        self.first_expert = torch.tensor([s for s, _ in ranges], dtype=torch.int64)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        t = topk_idx.shape[0]
        dest = self.rank_of_expert.to(topk_idx.device)[topk_idx]  # [T, k] rank of each chosen expert
        in_rank = torch.zeros(t, self.world_size, dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, dest, True)
        return DispatchLayout(
            num_tokens_per_rank=in_rank.sum(0),
            num_tokens_per_expert=torch.bincount(topk_idx.flatten(), minlength=num_experts),
            is_token_in_rank=in_rank,
        )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layout: DispatchLayout
    ) -> Received:
        with ps.timed("dispatch"):
            dest, token = layout.is_token_in_rank.t().nonzero(as_tuple=True)  # rank-major, then token order
            send_idx = topk_idx[token]  # [S, k] global expert ids
            local = send_idx - self.first_expert.to(x.device)[dest][:, None]
            owned = self.rank_of_expert.to(x.device)[send_idx] == dest[:, None]
            send_idx = torch.where(owned, local, torch.full_like(local, -1))
            send_splits = layout.num_tokens_per_rank.tolist()
            recv_splits = self._exchange_counts(layout.num_tokens_per_rank)
            recv_x = self._a2a(x[token], recv_splits, send_splits)
            recv_idx = self._a2a(send_idx, recv_splits, send_splits)
            recv_w = self._a2a(topk_weights[token].float(), recv_splits, send_splits)
        handle = DispatchHandle(token, send_splits, recv_splits, x.shape[0])
        return Received(recv_x, recv_idx, recv_w, handle)

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        with ps.timed("combine"):
            back = self._a2a(x, handle.send_splits, handle.recv_splits)  # [S, H], in send order
            out = torch.zeros(handle.num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
            out.index_add_(0, handle.send_token_idx, back)
        return out

    def _exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        if self.world_size == 1:
            return send_counts.tolist()
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous())
        return recv.tolist()

    def _a2a(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows of x (grouped by destination as `in_splits`) -> rows received (`out_splits`)."""
        if self.world_size == 1:
            return x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits)
        return out


class DeepEPDispatcher(MoEDispatcher):  # pragma: no cover - needs deep_ep on a multi-GPU machine
    """DeepEP's normal-mode (intranode NVLink) kernels behind the same interface."""

    def __init__(self, group: Any, hidden_bytes: int, num_nvl_bytes: int | None = None) -> None:
        import deep_ep

        self.buffer = deep_ep.Buffer(group, num_nvl_bytes or max(hidden_bytes * 4096, 1 << 28), 0)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, num_experts)
        return DispatchLayout(per_rank, per_expert, in_rank)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layout: DispatchLayout
    ) -> Received:
        with ps.timed("dispatch"):
            recv_x, recv_idx, recv_w, _, native, _ = self.buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights.float(),
                num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                num_tokens_per_expert=layout.num_tokens_per_expert,
            )
        handle = DispatchHandle(torch.empty(0, dtype=torch.int64), [], [], x.shape[0], native=native)
        return Received(recv_x, recv_idx, recv_w, handle)

    def combine(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        with ps.timed("combine"):
            combined, _, _ = self.buffer.combine(x, handle.native)
        return combined


def deep_ep_available() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def make_dispatcher(num_experts: int, hidden_bytes: int, device: torch.device) -> MoEDispatcher:
    """DeepEP on a GPU where it is installed, else all_to_all_single."""
    info = ps.info()
    if device.type == "cuda" and info.world_size > 1 and deep_ep_available():
        return DeepEPDispatcher(dist.group.WORLD, hidden_bytes)
    return AllToAllDispatcher(num_experts, info.world_size, info.rank)
