"""The planned forward's layers on the checkpoint's GGUF blocks in one C++ call
(engine/kernels/csrc/block_layers.cpp): the decode path of a CPU without AVX-512 (an AVX2 laptop, a
hosted CI runner, an AMD cloud machine), where `forward_plan.planned_forward`'s blocks branch made
~10 op calls per layer from Python, plus the attention backend's own Python. The op makes the same
calls in the same order with the same arguments through torch's dispatcher: the same numbers, bit
for bit (tests/test_block_layers.py), one Python call per step.

    torch.ops.servelab.planned_block_layers_bound(BlockLayerArgs args, Tensor(a!) x, Tensor cos,
        Tensor sin, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc,
        Tensor seq_lens) -> Tensor

x: the step's embedded tokens [T, H] (the residual stream: changed in place, as in the Python
loop); cos, sin [T, 1, head_dim]; block_table, query_start_loc and seq_lens as the attention backend
gives them for its decode rows (`AttentionBackend.decode_rows`). `args`
(`torch.classes.servelab.BlockLayerArgs(kv_caches, norms, blocks, kinds, final_norm, shape, eps,
scale)`, made once by `BoundBlockLayers`) holds what stays from step to step: per layer a KV cache,
two norm weights and four packed block matrices (qkv, o, gate_up, down) with their block types,
and shape (Hq, Hkv, head_dim, hidden). Returns the final norm's output [T, H].

Where hooks observe the attention calls (a profiled run's "attention" phase ranges) the backend's
`decode_rows` says no and the Python loop runs, so each layer's attention stays in its range.
`kernels.block_layers=false` (`SERVELAB_BLOCK_LAYERS=0`) turns the op off: the Python loop runs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from engine.kernels import cpu_blocks
from engine.kernels.cpu_extension import load_cpu_ops
from engine.kernels.cpu_kernels import kernels
from engine.kernels.paged_attention import paged_attention_op

_SOURCE = "block_layers.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    """None to register: the op takes a `BlockLayerArgs` script object, and the model calls it only
    outside torch.compile (`LlamaModel.forward` checks `torch.compiler.is_compiling()`)."""


class BoundBlockLayers:
    """A plan's call of its block layers. What stays the same from step to step goes to C++ once, as
    a `BlockLayerArgs`, made again when any of it changes (the list of caches compared element by
    element: it may be refilled in place)."""

    def __init__(self, norms: Sequence[torch.Tensor], blocks: Sequence[tuple[str, torch.Tensor]],
                 final_norm: torch.Tensor, shape: Sequence[int], eps: float, scale: float) -> None:  # fmt: skip
        self._fixed = (tuple(norms), tuple(b for _, b in blocks), [k for k, _ in blocks], final_norm,
                       [int(s) for s in shape], float(eps), float(scale))  # fmt: skip
        self._caches: tuple[torch.Tensor, ...] = ()
        self._args: Any = None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                 slot_mapping: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        if self._args is None or len(kv_caches) != len(self._caches) or any(
                map(operator.is_not, kv_caches, self._caches)):  # fmt: skip
            norms, blocks, kinds, final_norm, shape, eps, scale = self._fixed
            self._args = torch.classes.servelab.BlockLayerArgs(list(kv_caches), list(norms), list(blocks), kinds,
                                                               final_norm, shape, eps, scale)  # fmt: skip
            self._caches = tuple(kv_caches)
        return torch.ops.servelab.planned_block_layers_bound(self._args, x, cos, sin, slot_mapping, block_table,
                                                             query_start_loc, seq_lens)  # fmt: skip


def loaded() -> bool:
    """Whether the op and the kernels it calls are built and loaded (False where they cannot be:
    the Python loop runs)."""
    if kernels() is None or cpu_blocks.block_ops() is None or paged_attention_op() is None:
        return False
    return load_cpu_ops(_SOURCE, "GGUF block layers", _register_fakes)
