"""Fused CPU kernels for the Llama layer's element-wise work (C++, compiled on first use).

On a CPU every element-wise torch op is one more pass over memory (and `F.rms_norm`
is itself ~5 ops there; in bfloat16 each op also rounds). These fuse each step of the
layer into one or two passes, for float32 and bfloat16 storage alike (computed in float32,
rounded once on the store). They are torch ops, `torch.ops.servelab.<name>`:

    add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()
        residual += x; x = rms_norm(residual) * weight (both in place)
    rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
    rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()
        rotate-half RoPE in place on the first `heads` heads of qkv [T, H, D], with cos /
        signed-sin rows [T, D] (the tables of `RotaryEmbedding`)
    silu_mul(Tensor gate_up) -> Tensor
        [T, 2I] -> silu(gate) * up [T, I]
    argmax_rows(Tensor logits) -> Tensor
        [N, V] -> [N] int64, each row's first maximum (a NaN counts as the maximum), as
        `logits.max(dim=-1).indices`, read in bfloat16 where the logits are (greedy sampling)
    near_max_rows(Tensor logits, float rel, int k) -> (Tensor first, Tensor count, Tensor cols)
        [N, V] -> each row's first maximum m (as argmax_rows), how many of its values are at
        least floor = (m - |m| * rel) rounded to the storage type (0 where m is NaN), and the
        first k of their indices ([N, k] int64, -1 past the count): the candidates that
        `LlamaForCausalLM._bf16_argmax` scores again in float32, found in two passes over each
        row (the second from cache) instead of max + compare + nonzero over all N x V

All tensors contiguous, on the CPU, one dtype (float32 or bfloat16). `kernels()` returns
`torch.ops.servelab` once they are loaded, or None where no C++ toolchain builds them
(callers then use torch ops).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.cpu_extension import load_cpu_ops

_SOURCE = "layer_ops.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    """Shapes only, for torch.compile / FakeTensor tracing (the in-place ops return nothing)."""

    @torch.library.register_fake("servelab::add_rms_norm_")
    def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        return None

    @torch.library.register_fake("servelab::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("servelab::rope_")
    def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        return None

    @torch.library.register_fake("servelab::argmax_rows")
    def _(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty(logits.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("servelab::near_max_rows")
    def _(logits: torch.Tensor, rel: float, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        ids = torch.int64
        return logits.new_empty((n,), dtype=ids), logits.new_empty((n,), dtype=ids), logits.new_empty((n, k), dtype=ids)

    @torch.library.register_fake("servelab::silu_mul")
    def _(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def kernels() -> Any | None:
    """`torch.ops.servelab` with the layer ops loaded, or None where they cannot be built."""
    if load_cpu_ops(_SOURCE, "llama layers", _register_fakes, ("-ffp-contract=off",)):
        return torch.ops.servelab
    return None
