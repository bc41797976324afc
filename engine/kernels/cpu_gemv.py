"""x @ W.T for a few rows (decode at low batch), streaming W once at memory speed (C++).

At 1-4 rows a linear is a matrix-vector product: its time is the time to read W. The CPU BLAS
and oneDNN both run it far below the memory's speed on some CPUs: on a 2-core AMD EPYC (AVX2)
MKL's float32 GEMV read SmolLM2's weights at ~6 GB/s on one thread and oneDNN's at ~19 GB/s
(benchmarks/cpu_decode_step.py --batch 1). This op splits W's rows over the threads and reads
each row once, contiguous, with every input row's dot product accumulated in registers
(AVX2 + FMA where the build has them, else plain loops the compiler vectorises):

    gemv_f32(Tensor x, Tensor w) -> Tensor
        x [M, K] float32 (M <= MAX_ROWS), w [N, K] float32 row-major, both contiguous -> [M, N]
    gemv_bf16(Tensor x, Tensor w) -> Tensor
        the same in bfloat16: products and sums in float32 (vdpbf16ps where the CPU has
        AVX512-BF16), each output rounded once to bfloat16, as oneDNN's bfloat16 linear does.
        oneDNN's own kernel read SmolLM2's bfloat16 weights at ~18 GB/s at one row on a 2-core
        AMD EPYC Zen 5, whose memory streams ~30 GB/s (benchmarks/cpu_decode_step.py --batch 1).

The sums run in another order than the BLAS's / oneDNN's, so results differ from `F.linear` by
float32 rounding only (and in bfloat16 by the output's rounding, rarely: tests/test_cpu_gemv.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.cpu_extension import load_cpu_ops
from engine.kernels.isa import cpu_flags

MAX_ROWS = 4
# bfloat16 rows where the op beats oneDNN's packed linear: SmolLM2's projections and LM head, 2-core
# AMD EPYC Zen 5 (AVX512-BF16), 30 layers' weights out of cache: 1 row 8.8 vs 14.0 ms (30.7 vs
# 19.2 GB/s), 2 rows 10.2 vs 12.1 ms, 4 rows 16.8 vs 15.0 ms (there the multiply-adds, not the reads,
# bound it).
MAX_ROWS_BF16 = 2

_SOURCE = "gemv.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::gemv_f32")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("servelab::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


def gemv_ops() -> Any | None:
    """`torch.ops.servelab` with `gemv_f32` and `gemv_bf16` loaded, or None where they cannot be built."""
    if load_cpu_ops(_SOURCE, "GEMV", _register_fakes):
        return torch.ops.servelab
    return None


def max_rows(dtype: torch.dtype) -> int:
    """The most rows the GEMV takes in `dtype` (0: none)."""
    return MAX_ROWS if dtype == torch.float32 else MAX_ROWS_BF16 if dtype == torch.bfloat16 else 0


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The op takes these operands (few rows of float32, or of bfloat16, and a row-major weight
    of the same dtype, on a CPU) and runs them fast: bfloat16 only on its vector path (AVX-512,
    K a multiple of 32; its scalar loop is ~6x slower than oneDNN)."""
    return (
        x.dim() == 2 and 1 <= x.shape[0] <= max_rows(x.dtype) and w.dtype == x.dtype and x.device.type == "cpu"
        and w.is_contiguous() and not torch.compiler.is_compiling()
        and (x.dtype != torch.bfloat16 or (x.shape[1] % 32 == 0 and "avx512f" in cpu_flags()))
    )  # fmt: skip


def gemv(ops: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T by the op of x's dtype (operands that `applies` accepted)."""
    return ops.gemv_f32(x, w) if x.dtype == torch.float32 else ops.gemv_bf16(x, w)
