"""The planned forward's decoder layers in one C++ call (engine/csrc/planned_layers.cpp).

`forward_plan.planned_forward` runs ~10 op calls per layer from Python: at a batch-1 decode step
of SmolLM2 (30 layers, ~6 ms) those calls and the attention backend's per-layer Python cost
about a millisecond. Where every row of the step is one decoding request and the layers run the
decode kernels (amx_linear), this op makes the same calls, in the same order with the same
arguments, from C++ through torch's dispatcher: the same numbers, bit for bit
(tests/test_planned_layers.py), one Python call per step. torch.profiler still shows every
kernel by name, under `servelab::planned_layers`.

    torch.ops.servelab.planned_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!)[] kv_caches,
        Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens,
        Tensor[] norms, Tensor[] packs, Tensor final_norm, int[] shape, float eps, float scale) -> Tensor

x [T, H] bfloat16, the embedded tokens (overwritten: the residual stream); per layer two norm
weights (input, post-attention) and four packed matrices (qkv, o, gate_up, down); block_table,
query_start_loc and seq_lens as the attention backend gives them for its decode rows
(`AttentionBackend.decode_rows`); shape: (Hq, Hkv, head_dim, qkv width, hidden size,
intermediate size). Returns the final norm's output [T, H].

Where hooks observe the attention calls (engine/hooks.observe_attention: a profiled run's
"attention" phase ranges) the loop runs instead, so that every layer's attention stays inside its
range: a profiled batch-1 decode step pays the per-layer Python calls that an unprofiled one does
not (servelab-explain sets the plan aside altogether: workloads/explain_probe.py).

`layers_op()` returns the op once it is loaded (and the kernels it calls), or None where they
cannot be built (the Python loop runs instead).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.cpu_paged_attention import paged_attention_op
from engine.cpu_extension import load_cpu_ops
from engine.model import amx_linear
from engine.model.cpu_kernels import kernels

_SOURCE = "planned_layers.cpp"  # engine/csrc


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::planned_layers")
    def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
          slot_mapping: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
          seq_lens: torch.Tensor, norms: list[torch.Tensor], packs: list[torch.Tensor], final_norm: torch.Tensor,
          shape: list[int], eps: float, scale: float) -> torch.Tensor:  # fmt: skip
        return torch.empty_like(x)


def layers_op() -> Any | None:
    """`torch.ops.servelab.planned_layers` with the kernels it calls loaded, or None."""
    if kernels() is None or amx_linear.amx_ops() is None or paged_attention_op() is None:
        return None
    if load_cpu_ops(_SOURCE, "planned layers", _register_fakes):
        return torch.ops.servelab.planned_layers
    return None
