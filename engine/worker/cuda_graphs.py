"""Piecewise CUDA graphs for the compiled forward on a GPU (vLLM's piecewise capture).

Why piecewise: a CUDA graph replays fixed kernels on fixed addresses, but attention's
work depends on the step (block tables, sequence lengths, the backend's per-step plan
made on the host). So the traced forward is split at every `servelab::layer_attention`
call: the pieces between two attention calls (norms, projections, rotary, MLP) are
captured once per padded decode batch size and replayed; attention runs eagerly between
them with the step's metadata.

`piecewise_backend(capture)` is a `torch.compile` backend. Each piece's inputs are
copied into the piece's static input buffers before a replay unless they already live
there (the weights always do; the activations coming out of attention never do, and
they are small: [batch, hidden]). Outputs are the static output buffers, consumed
within the same step. With `capture=False` (any device) the pieces run as plain FX
modules: that is how a CPU test checks the split without a GPU.

Imports nothing CUDA-specific at module load: safe on a CPU-only machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

logger = logging.getLogger(__name__)

ATTENTION_OP = "servelab.layer_attention"


def is_attention_node(node: fx.Node) -> bool:
    return node.op == "call_function" and ATTENTION_OP in str(node.target)


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Split `gm` into submodules `submod_<i>`; each attention call alone in its own one.

    Returns (split module, names of the attention submodules).
    """
    from torch.fx.passes.split_module import split_module

    part = 0
    partition_of: dict[fx.Node, int] = {}
    attention_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            part += 1
            partition_of[node] = part
            attention_parts.add(part)
            part += 1
        else:
            partition_of[node] = part
    split = split_module(gm, gm, lambda n: partition_of[n], keep_original_order=True)
    return split, [f"submod_{p}" for p in sorted(attention_parts)]


class CudaGraphPiece(torch.nn.Module):
    """One piece of the split forward, replayed from a CUDA graph per input shape."""

    def __init__(self, module: torch.nn.Module, pool: Any) -> None:
        super().__init__()
        self.module = module
        self.pool = pool
        # input shapes -> (graph, static inputs, static outputs)
        self.graphs: dict[tuple[tuple[int, ...], ...], tuple[Any, list[Any], Any]] = {}

    def forward(self, *args: Any) -> Any:
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else () for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args)
        graph, static_in, static_out = entry
        for buf, a in zip(static_in, args, strict=True):
            if isinstance(buf, torch.Tensor) and buf.data_ptr() != a.data_ptr():
                buf.copy_(a)
        graph.replay()
        return static_out

    def _capture(self, args: Sequence[Any]) -> tuple[Any, list[Any], Any]:
        # Weights are captured in place; activations get their own static buffers.
        static_in = [
            a if not isinstance(a, torch.Tensor) or isinstance(a, torch.nn.Parameter) else a.clone() for a in args
        ]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.module(*static_in)  # warm-up: lazy inits (cuBLAS workspaces) happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.module(*static_in)
        return graph, static_in, static_out


def piecewise_backend(capture: bool) -> Callable[[fx.GraphModule, list[torch.Tensor]], Callable[..., Any]]:
    """A torch.compile backend: split at attention; pieces replayed as CUDA graphs if `capture`."""

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        split, attention_names = split_at_attention(gm)
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for name, child in list(split.named_children()):
                if name not in attention_names:
                    setattr(split, name, CudaGraphPiece(child, pool))
        logger.info("piecewise forward: %d attention calls, %d captured pieces",
                    len(attention_names), 0 if not capture else len(list(split.named_children())))
        return split.forward

    return backend
