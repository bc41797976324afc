"""Linear layers with weights prepacked once for oneDNN (bfloat16 on a CPU; float32 where it is faster).

`F.linear` on a bfloat16 CPU tensor hands the plain [N, K] weight to oneDNN, which reorders it
into its blocked layout on every call: at decode batch sizes that reorder costs as much as the
multiply. `prepack_linears` reorders each weight once, at load time
(`torch.ops.mkldnn._reorder_linear_weight`), and routes the layer through
`torch.ops.mkldnn._linear_pointwise`, the pair inductor itself uses for frozen CPU linears
(vLLM's CPU build prepacks its oneDNN weights likewise). Measured on SmolLM2's shapes, batch 64,
avx512_bf16 (benchmarks/cpu_decode_step.py): 1.2-3x faster per GEMM, the LM head included.

Only the eager forward uses packed weights: the compiled forward (`enforce_eager=False`) keeps
the plain ones, which inductor packs itself. The plain weights stay (other code reads them), so
the linear weights take twice their memory on a CPU; this is done for bfloat16, and for float32
only where a start-up probe finds oneDNN's packed kernel faster than the CPU BLAS (AVX2-only
CPUs, `onednn_float32_faster`).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_gemv, options
from engine.kernels.isa import best_seconds_interleaved

logger = logging.getLogger(__name__)

# A batch-size hint for the reorder: the layout chosen serves every batch size, this one best.
_PACK_HINT_ROWS = 64


def _onednn_linear_available() -> bool:
    """A torch built with oneDNN that has the prepacked linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16_supported() -> bool:
    """oneDNN's linear ops, on a CPU whose instructions oneDNN's bfloat16 kernels need
    (avx512bw/vl/dq or avx_ne_convert): on an AVX2-only CPU the reorder raises."""
    return _onednn_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_supported(weight: torch.Tensor) -> bool:
    """oneDNN prepacking applies: a CPU weight, a torch built with oneDNN, and either bfloat16
    (where oneDNN's bfloat16 kernels run here) or float32 where the packed kernel beats the plain
    BLAS on this CPU (`onednn_float32_faster`)."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16_supported()
    return weight.dtype == torch.float32 and onednn_float32_faster()


# SmolLM2's gate_up, down and qkv projections ([N, K]), at 64 rows: the probe's GEMMs.
PROBE_SHAPES = ((3072, 576), (576, 1536), (960, 576))
# Prepack only where oneDNN is clearly ahead: a 2-core AMD EPYC Zen 4 (AVX-512) measures
# 1.42-1.86x (the AVX2-only Zen 3 1.24-2.0x, timed less carefully), so a CPU
# where the two are close keeps the BLAS (and its column-major weights).
ONEDNN_FP32_MIN_SPEEDUP = 1.15


def onednn_float32_faster() -> bool:
    """Whether float32 linears run oneDNN's prepacked kernel here: `kernels.float32_linear` where it
    names one, else the probe's answer (`probe_onednn_float32_faster`)."""
    pinned = options.current().float32_linear
    if pinned != "auto":
        return pinned == "prepacked"
    return probe_onednn_float32_faster()


@functools.cache
def probe_onednn_float32_faster() -> bool:
    """Whether oneDNN's prepacked float32 linear beats `F.linear` (the CPU BLAS, on the engine's
    column-major weights) at SmolLM2's projection shapes, 64 rows, by at least
    `ONEDNN_FP32_MIN_SPEEDUP`: a probe of ~70 ms, once per process, the two kernels timed in
    turn (`isa.best_seconds_interleaved`) so that every process on one machine decides
    alike (timed one after the other, 1 process in 5 here decided differently).

    Measured 2026-12-02 (benchmarks/cpu_decode_step.py shapes, 2 threads): on a 2-core AMD EPYC
    with AVX2 only, oneDNN ran 1.1-2.5x faster than MKL at 8-256 rows (the LM head 2.3-2.6x,
    gate_up 1.9x); on the Intel Xeons with AVX-512 the engine was tuned on, MKL's float32 path
    was the one measured fast. `kernels.float32_linear` (prepacked | plain) skips the probe."""
    if not _onednn_linear_available():
        return False
    gen = torch.Generator().manual_seed(0)
    calls: list[Callable[[], object]] = []
    try:
        with torch.inference_mode():
            for n, k in PROBE_SHAPES:
                w = torch.randn(n, k, generator=gen)
                w_cm, pw = w.t().contiguous().t(), pack_weight(w)
                x = torch.randn(64, k, generator=gen)
                calls += [functools.partial(F.linear, x, w_cm), functools.partial(packed_linear, x, pw)]
            times = best_seconds_interleaved(calls, 10)
    except RuntimeError:
        return False
    ratio = sum(times[0::2]) / sum(times[1::2])
    faster = ratio >= ONEDNN_FP32_MIN_SPEEDUP
    logger.info("float32 linears: oneDNN prepacked %.2fx the plain BLAS here -> %s", ratio,
                "prepacked" if faster else "plain")
    return faster


def float32_linear_kernel() -> str:
    """What runs this CPU's float32 linears: "onednn-prepacked" (with the GEMV for <= 4 rows
    where it is built) or "blas" (`F.linear`); recorded in every run's summary.json."""
    if not onednn_float32_faster():
        return "blas"
    return "onednn-prepacked+gemv" if cpu_gemv.gemv_ops() is not None else "onednn-prepacked"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the same matrix in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs `rows` rows as: a multiple of 8 up to 128, of 32 above.

    oneDNN builds (JIT-compiles) a primitive for every new input shape: 1.5-6 ms per linear the
    first time a row count is seen, measured at SmolLM2's shapes. A server's steps take every row count from 1 to the token budget, so unpadded each
    new one stalls its step; padded, the shapes are few and `warm_up_linears` builds them all at
    start-up (the padding rows cost at most 1/4 of a step past 128 rows, 1.5% at 2,048)."""
    step = 8 if rows <= 128 else 32
    return -(-rows // step) * step


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, plain: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ packed.T (+ bias) -> [..., N], in x's dtype (rows padded to `padded_rows`
    for oneDNN, the padding cut off again; a `packed` that is a plain weight runs `F.linear`). Given the plain weight (row-major), a few rows
    without bias run the GEMV instead (engine/kernels/cpu_gemv.py: float32, or bfloat16 at 1-2 rows)."""
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    if plain is not None and bias is None and cpu_gemv.applies(flat, plain) and (ops := cpu_gemv.gemv_ops()):
        out = cpu_gemv.gemv(ops, flat, plain)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    if not packed.is_mkldnn:  # a plain weight (a plan that runs the BLAS: ForwardPlan.onednn)
        return torch.nn.functional.linear(x, packed, bias)
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
    return packed_linear(x, packed, self.bias, plain=self.weight)


def prepack_linears(model: nn.Module) -> int:
    """Give every CPU `nn.Linear` of `model` a prepacked weight where `prepack_supported`; returns how many.

    A no-op (0) where oneDNN prepacking does not apply; a failure to pack logs once and leaves
    the layers as they were (correct, only slower).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and prepack_supported(m.weight)]
    try:
        for m in linears:
            if m.weight.dtype == torch.float32:  # row-major for oneDNN and the GEMV (undo the BLAS layout)
                m.weight.data = m.weight.data.contiguous()
            m.packed_weight = pack_weight(m.weight)  # type: ignore[assignment]
            m.forward = types.MethodType(_packed_forward, m)  # type: ignore[method-assign]
    except RuntimeError as exc:  # a torch whose oneDNN lacks the op at run time
        logger.warning("prepacking linear weights failed (%s); using plain weights", exc)
        for m in linears:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("packed_weight", None)
        return 0
    return len(linears)

