"""Linear layers with weights prepacked once for oneDNN (bfloat16 on a CPU).

`F.linear` on a bfloat16 CPU tensor hands the plain [N, K] weight to oneDNN, which reorders it
into its blocked layout on every call: at decode batch sizes that reorder costs as much as the
multiply. `prepack_linears` reorders each weight once, at load time
(`torch.ops.mkldnn._reorder_linear_weight`), and routes the layer through
`torch.ops.mkldnn._linear_pointwise`, the pair inductor itself uses for frozen CPU linears
(vLLM's CPU build prepacks its oneDNN weights likewise). Measured on SmolLM2's shapes, batch 64,
avx512_bf16 (benchmarks/cpu_decode_step.py): 1.2-3x faster per GEMM, the LM head included.

Only the eager forward uses packed weights: the compiled forward (`enforce_eager=False`) keeps
the plain ones, which inductor packs itself. The plain weights stay (other code reads them), so
the linear weights take twice their memory on a CPU; this is only done for bfloat16, where
it pays.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

logger = logging.getLogger(__name__)

# A batch-size hint for the reorder: the layout chosen serves every batch size, this one best.
_PACK_HINT_ROWS = 64


def prepack_supported(weight: torch.Tensor) -> bool:
    """oneDNN prepacking applies: a bfloat16 CPU weight and a torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the same matrix in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs `rows` rows as: a multiple of 8 up to 128, of 32 above.

    oneDNN builds (JIT-compiles) a primitive for every new input shape: 1.5-6 ms per linear the
    first time a row count is seen, measured at SmolLM2's shapes. A server's steps take every row count from 1 to the token budget, so unpadded each
    new one stalls its step; padded, the shapes are few and `warm_up_linears` builds them all at
    start-up (the padding rows cost at most 1/4 of a step past 128 rows, 1.5% at 2,048)."""
    step = 8 if rows <= 128 else 32
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ packed.T (+ bias) -> [..., N], in x's dtype (rows padded to `padded_rows`
    for oneDNN, the padding cut off again)."""
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    rows = flat.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    if padded != rows:
        out = out[:rows]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Under torch.compile, autograd, or another dtype the plain weight keeps its meaning.
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or x.dtype != self.weight.dtype:
        return nn.Linear.forward(self, x)
    packed: torch.Tensor = self.__dict__["packed_weight"]
    return packed_linear(x, packed, self.bias)


def prepack_linears(model: nn.Module) -> int:
    """Give every bfloat16 CPU `nn.Linear` of `model` a prepacked weight; returns how many.

    A no-op (0) where oneDNN prepacking does not apply; a failure to pack logs once and leaves
    the layers as they were (correct, only slower).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and prepack_supported(m.weight)]
    try:
        for m in linears:
            m.packed_weight = pack_weight(m.weight)  # type: ignore[assignment]
            m.forward = types.MethodType(_packed_forward, m)  # type: ignore[method-assign]
    except RuntimeError as exc:  # a torch whose oneDNN lacks the op at run time
        logger.warning("prepacking linear weights failed (%s); using plain weights", exc)
        for m in linears:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("packed_weight", None)
        return 0
    return len(linears)

