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

Where the build has no AVX-512 and no profiler is listening, the op runs its team step: the same
kernels' loops as one OpenMP parallel region for all layers, met at barriers instead of forked and
joined per op (block_layers.cpp's note), the same numbers bit for bit. `kernels.decode_team=false`
(`SERVELAB_DECODE_TEAM=0`) keeps the op's dispatcher calls; `torch.ops.servelab.set_block_team` says
whether it runs and `block_team_steps` counts its steps.

Where hooks observe the attention calls (a profiled run's "attention" phase ranges) the backend's
`decode_rows` says no and the Python loop runs, so each layer's attention stays in its range.
`kernels.block_layers=false` (`SERVELAB_BLOCK_LAYERS=0`) turns the op off: the Python loop runs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.kernels import cpu_blocks, options
from engine.kernels.cpu_extension import is_loaded, load_cpu_ops
from engine.kernels.cpu_kernels import kernels
from engine.kernels.paged_attention import paged_attention_op

if TYPE_CHECKING:
    from engine.attention.backend import AttentionMetadata
    from engine.kernels.forward_plan import ForwardPlan, LayerPlan

_SOURCE = "block_layers.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    """None to register: the op takes a `BlockLayerArgs` script object, and the model calls it only
    outside torch.compile (`LlamaModel.forward` checks `torch.compiler.is_compiling()`)."""


class BoundBlockLayers:
    """A plan's call of its block layers. What stays the same from step to step goes to C++ once, as
    a `BlockLayerArgs`, made again when any of it changes (the list of caches compared element by
    element: it may be refilled in place); None from a call whose caches are not laid out as the
    kernels take them (contiguous), asked once per list of caches."""

    def __init__(self, norms: Sequence[torch.Tensor], blocks: Sequence[tuple[str, torch.Tensor]],
                 final_norm: torch.Tensor, shape: Sequence[int], eps: float, scale: float) -> None:  # fmt: skip
        self._fixed = (tuple(norms), tuple(b for _, b in blocks), [k for k, _ in blocks], final_norm,
                       [int(s) for s in shape], float(eps), float(scale))  # fmt: skip
        self._caches: tuple[torch.Tensor, ...] = ()
        self._args: Any = None  # None with caches bound: they are not contiguous

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                 slot_mapping: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        if not self._caches or len(kv_caches) != len(self._caches) or any(
                map(operator.is_not, kv_caches, self._caches)):  # fmt: skip
            norms, blocks, kinds, final_norm, shape, eps, scale = self._fixed
            self._caches = tuple(kv_caches)
            self._args = torch.classes.servelab.BlockLayerArgs(list(kv_caches), list(norms), list(blocks), kinds,
                                                               final_norm, shape, eps, scale) if all(
                c.is_contiguous() for c in kv_caches) else None  # fmt: skip
        if self._args is None:
            return None
        return torch.ops.servelab.planned_block_layers_bound(self._args, x, cos, sin, slot_mapping, block_table,
                                                             query_start_loc, seq_lens)  # fmt: skip


def loaded() -> bool:
    """Whether the op and the kernels it calls are built and loaded (False where they cannot be:
    the Python loop runs)."""
    if kernels() is None or cpu_blocks.block_ops() is None or paged_attention_op() is None:
        return False
    if load_cpu_ops(_SOURCE, "GGUF block layers", _register_fakes,
                    instead="the planned forward calls the same block kernels one by one from Python"):
        apply_options()
        return True
    return False


def apply_options() -> None:
    """The loaded op's team step follows `kernels.decode_team` (`options.configure`; at load)."""
    if is_loaded(_SOURCE):
        torch.ops.servelab.set_block_team(options.current().decode_team)


options.on_configure(apply_options)


def bind(layers: Sequence[LayerPlan], final_norm: torch.Tensor, hidden: int, eps: float) -> BoundBlockLayers | None:
    """The op for a plan's layers (each with its four block matrices, one attention shape and scale:
    forward_plan checks both), where `kernels.block_layers` allows it and the op is built; None otherwise."""
    if not options.current().block_layers or not loaded():
        return None
    a = layers[0].attn
    return BoundBlockLayers([t for lp in layers for t in (lp.in_norm, lp.post_norm)],
                            [b for lp in layers for b in lp.blocks or ()], final_norm,
                            (a.num_heads, a.num_kv_heads, a.head_dim, hidden), eps, a.scale)  # fmt: skip


def step(plan: ForwardPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor | None:  # fmt: skip
    """The blocks branch of `forward_plan.planned_forward` in one call of the plan's op, where every row
    of the step is one decoding request whose attention the backend would give to the C++ op
    (`decode_rows`) and the tensors are laid out as the Python loop's kernels take them; None otherwise
    (the loop runs)."""
    rows = plan.layers[0].attn.attn_backend.decode_rows()
    if (plan.block_layers is None or rows is None or rows[0].shape[0] != x.shape[0] or not x.is_contiguous()
            or kv_caches[0].dtype != x.dtype):  # fmt: skip
        return None
    out: torch.Tensor | None = plan.block_layers(x, cos, sin, kv_caches, metadata.slot_mapping, *rows)
    return out
