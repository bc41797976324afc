"""The planned forward's decoder layers in one C++ call (engine/kernels/csrc/planned_layers.cpp).

`forward_plan.planned_forward` runs ~10 op calls per layer from Python: at a batch-1 decode step
of SmolLM2 (30 layers, ~6 ms) those calls and the attention backend's per-layer Python cost
about a millisecond. Where every row of the step is one decoding request and the layers run the
decode kernels (amx_linear), this op makes the same calls, in the same order with the same
arguments, from C++ through torch's dispatcher: the same numbers, bit for bit
(tests/test_planned_layers.py), one Python call per step. torch.profiler still shows every
kernel by name, under `servelab::planned_layers_bound`.

    torch.ops.servelab.planned_layers_bound(LayerArgs args, Tensor input_ids, Tensor positions,
        Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens) -> Tensor

input_ids, positions: the step's token ids and positions (int64 [T]; the op gathers their rows of
the embedding and of the rotary cos / sin tables: an id or position outside its table is a
RuntimeError naming it); block_table, query_start_loc and seq_lens as the attention backend gives
them for its decode rows (`AttentionBackend.decode_rows`). `args`
(`torch.classes.servelab.LayerArgs(embed, cos_table, sin_table, kv_caches, norms, packs,
final_norm, shape, eps, scale)`, made once: `BoundLayers`) holds what stays from step to step: the
bfloat16 tables, per layer a KV cache, two norm weights (input, post-attention) and four packed
matrices (qkv, o, gate_up, down), and shape (Hq, Hkv, head_dim, qkv width, hidden size,
intermediate size). Returns the final norm's output [T, H].

Where hooks observe the attention calls (engine/hooks.observe_attention: a profiled run's
"attention" phase ranges) the loop runs instead, so that every layer's attention stays inside its
range: a profiled batch-1 decode step pays the per-layer Python calls that an unprofiled one does
not (servelab-explain takes that wrapper off and profiles this op: workloads/explain_probe.py).
Under torch.profiler the op's loop opens the plan's part ranges (`servelab::plan:<part>`,
forward_plan.PLAN_PARTS) around the kernels it calls.

The team step: where every matrix is the checkpoint's own blocks (`model.quantized_decode`, a
CPU with AVX512-VNNI) and the step has fewer rows than the attention op's AMX threshold (8), the
op runs the same kernels' loops itself, in one OpenMP parallel region for all the layers: every
linear's column blocks and the attention's units split over the threads as at::parallel_for
splits them, the threads meeting at a barrier after each, a norm, the rotary embedding and the
cache write on one thread between two barriers (engine/kernels/csrc/team.h). The same numbers bit for bit
(tests/test_planned_layers.py); no call through the dispatcher, no allocation and no fork and join
per op (a batch-1 step of SmolLM2 makes ~270 of them, each a few microseconds, more right after
the weights have streamed through the caches: benchmarks/cold_after_stream.py). Under
torch.profiler (any RecordFunction callback) the op calls the kernels through the dispatcher so
the profile names each. `torch.ops.servelab.set_decode_team(False)` (or `kernels.decode_team=false`)
turns it off; `decode_team_steps()` counts the steps it ran.

`layers_op()` returns the op once it is loaded (and the kernels it calls), or None where they
cannot be built (the Python loop runs instead).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from engine.kernels import amx_linear, options
from engine.kernels.cpu_extension import is_loaded, load_cpu_ops
from engine.kernels.cpu_kernels import kernels
from engine.kernels.paged_attention import paged_attention_op

_SOURCE = "planned_layers.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    """None to register: the op takes a `LayerArgs` script object, and the model calls it only
    outside torch.compile (`LlamaModel.forward` checks `torch.compiler.is_compiling()`)."""


class BoundLayers:
    """The plan's call of the layers (`ForwardPlan.layers_op`): a decode step's token ids and
    positions in, the final norm's output out. What stays the same from step to step (the
    embedding and rotary tables, the KV caches, the norms, the packs, the shapes) goes to C++ once,
    as a `LayerArgs` object, and each step passes only its own tensors to `planned_layers_bound`,
    which gathers the step's embedding and rotary rows itself: converting SmolLM2's 210 tensors
    from Python lists at every call, and the model's own embedding and rotary calls, cost ~0.1 ms of
    a ~3 ms batch-1 step. The object is made again when any of those changes (a list of caches is
    compared element by element: it may be refilled in place)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._caches: tuple[torch.Tensor, ...] = ()
        self._args: Any = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 norms: Sequence[torch.Tensor], packs: Sequence[torch.Tensor], final_norm: torch.Tensor,
                 shape: Sequence[int], eps: float, scale: float,
                 head: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:  # fmt: skip
        """The final norm's output [T, H]; with `head` (an `amx_linear_argmax` weight and its column
        count), each row's greedy token id [T] instead (`planned_greedy_bound`: the LM head's fused
        argmax in the same call)."""
        key = (embed, cos_table, sin_table, norms, packs, final_norm, tuple(shape), eps, scale)
        old = self._key
        if (old is None or any(a is not b for a, b in zip(old[:6], key[:6], strict=True)) or old[6:] != key[6:]
                or len(kv_caches) != len(self._caches) or any(map(operator.is_not, kv_caches, self._caches))):  # fmt: skip
            self._args = torch.classes.servelab.LayerArgs(embed, cos_table, sin_table, list(kv_caches), list(norms),
                                                          list(packs), final_norm, list(shape), eps, scale)  # fmt: skip
            self._key, self._caches = key, tuple(kv_caches)
        if head is not None:
            return torch.ops.servelab.planned_greedy_bound(self._args, head[0], head[1], input_ids, positions,
                                                           slot_mapping, block_table, query_start_loc, seq_lens)  # fmt: skip
        return torch.ops.servelab.planned_layers_bound(self._args, input_ids, positions, slot_mapping, block_table,
                                                       query_start_loc, seq_lens)  # fmt: skip


def layers_op() -> Any | None:
    """A `BoundLayers` (one per plan: it keeps the plan's arguments) once `planned_layers` is
    loaded with the kernels it calls, or None."""
    if kernels() is None or amx_linear.amx_ops() is None or paged_attention_op() is None:
        return None
    if load_cpu_ops(_SOURCE, "planned layers", _register_fakes):
        apply_options()
        return BoundLayers()
    return None


def apply_options() -> None:
    """The loaded op's decode team follows `kernels.decode_team` (`options.configure`; at load)."""
    if is_loaded(_SOURCE):
        torch.ops.servelab.set_decode_team(options.current().decode_team)



options.on_configure(apply_options)
