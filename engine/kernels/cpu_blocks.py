"""Decode linears on a GGUF checkpoint's own blocks on any CPU: AVX2 (x86-64-v3) or the scalar reference.

The AVX-512 kernels (amx_linear.quant_pack, engine/kernels/csrc/gguf_blocks.h) read Q4_1 / Q8_0 blocks on
CPUs with AVX512-BF16 and VNNI, in a bfloat16 engine. Everywhere else (an AVX2-only CPU: the
hosted CI runners, most AMD cloud machines, most laptops; a float32 engine) this op reads them:

    torch.ops.servelab.block_pack(Tensor blocks, str kind) -> Tensor
        blocks uint8 [N, K / 32, block bytes] (the GGUF bytes of each output column, as
        gguf_loader.load_gguf_blocks gives them) -> uint8 [N, column bytes]: each column's quant
        bytes, then its blocks' fp16 scales as arrays (the same bytes, laid out once at load time)
    torch.ops.servelab.block_linear(Tensor x, Tensor packed, str kind, bool scalar=False) -> Tensor
        x [M, K] float32 | bfloat16 contiguous, packed from block_pack -> [M, N], x's dtype
    torch.ops.servelab.block_linear_isa() -> str      "avx2" | "scalar": what this build multiplies with

x is written per 32-input block in about 14 bits (engine/kernels/csrc/block_linear.cpp), and each block's
32 products summed in integers: a step reads 5 (Q4_1), 5.5 (Q5_0) or 8.5 (Q8_0) bits a weight where
the float32 engine read 32. Past a few rows the products' cost, not the read, sets the pace and the
dense kernels (oneDNN, the BLAS) win: `MAX_ROWS` by block kind, measured with
benchmarks/quant_linears.py --blocks on a 2-core AMD EPYC (AVX2). `attach` gives the model's
linears (and the LM head) their blocks; a step of at most that many rows reads them.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.kernels.cpu_extension import load_cpu_ops

logger = logging.getLogger(__name__)

_SOURCE = "block_linear.cpp"  # engine/kernels/csrc
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22}  # a GGUF block's bytes (32 weights)
QUANT_BYTES = {"Q4_1": 16, "Q8_0": 32, "Q5_0": 20}  # its bytes other than the fp16 scales
# Up to how many rows a step reads a linear's blocks rather than its dense weight, by block kind
# (module note). 2-core AMD EPYC (Zen 3, AVX2), SmolLM2's matrices, float32 dense weights
# (oneDNN prepacked), weights out of cache: see docs/benchmarks.md ("Block linears on AVX2").
MAX_ROWS = {"Q4_1": 8, "Q8_0": 8, "Q5_0": 8}


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::block_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, kind: str, scalar: bool = False) -> torch.Tensor:
        return x.new_empty((x.shape[0], packed.shape[0]))

    @torch.library.register_fake("servelab::block_pack")
    def _(blocks: torch.Tensor, kind: str) -> torch.Tensor:
        n, kb, _ = blocks.shape
        scales = 2 if kind == "Q4_1" else 1
        return blocks.new_empty((n, kb * QUANT_BYTES[kind] + -(-kb // 8) * 8 * 2 * scales))


@functools.cache
def block_ops() -> Any | None:
    """`torch.ops.servelab` with `block_linear` loaded, or None where no C++ toolchain builds it."""
    if load_cpu_ops(_SOURCE, "GGUF block linears", _register_fakes):
        return torch.ops.servelab
    return None


@functools.cache
def isa() -> str | None:
    """What multiplies the blocks here: "avx2", "scalar" (a build without AVX2 / FMA / F16C), None
    (no build). Asked once per process: every eager linear and LM-head call asks it."""
    ops = block_ops()
    return None if ops is None else str(ops.block_linear_isa())


def max_rows(kind: str) -> int:
    """Up to how many rows a step reads blocks of `kind` (0: a kind this op does not read). The
    scalar build reads them at one row only: it is correct everywhere, fast nowhere."""
    rows = MAX_ROWS.get(kind, 0)
    return rows if isa() == "avx2" else min(rows, 1)


def pack(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF blocks uint8 [N, K / 32, block bytes] -> the layout `linear` reads (block_pack)."""
    ops = block_ops()
    assert ops is not None, "block_linear unavailable"
    return ops.block_pack(blocks, kind)


def linear(x: torch.Tensor, packed: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., K] @ the packed blocks' [N, K].T -> [..., N] in x's dtype."""
    ops = block_ops()
    assert ops is not None, "block_linear unavailable"
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = ops.block_linear(flat, packed, kind)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def takes(x: torch.Tensor, kind: str) -> bool:
    """A step of x's rows reads the blocks: few rows (`max_rows`), float32 or bfloat16, eager, no autograd."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or x.dtype not in (torch.float32, torch.bfloat16):
        return False  # (first: under torch.compile nothing below is traced)
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return 1 <= rows <= max_rows(kind)


def _blocks_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    kind, blocks = self.__dict__["gguf_blocks"]
    if self.bias is None and not torch.compiler.is_compiling() and takes(x, kind):
        return linear(x, blocks, kind)
    dense: Callable[[torch.Tensor], torch.Tensor] | None = self.__dict__["dense_forward"]
    return dense(x) if dense is not None else nn.Linear.forward(self, x)


def attach(linear_layer: nn.Linear, kind: str, blocks: torch.Tensor) -> bool:
    """Let `linear_layer` read `blocks` (GGUF uint8 [N, K / 32, bytes] of `kind`, packed here) at decode-sized steps,
    its own forward (oneDNN's packed weight or the plain one) above that. False where the blocks do
    not describe this layer's weight (shape) or the op cannot run them."""
    n, k = linear_layer.weight.shape
    if (kind not in BLOCK_BYTES or block_ops() is None or linear_layer.weight.device.type != "cpu"
            or tuple(blocks.shape) != (n, k // 32, BLOCK_BYTES[kind]) or k % 32):  # fmt: skip
        return False
    linear_layer.gguf_blocks = (kind, pack(blocks, kind))  # type: ignore[assignment]
    if "dense_forward" not in linear_layer.__dict__:  # the forward set on the instance (cpu_linear's), or None
        linear_layer.__dict__["dense_forward"] = linear_layer.__dict__.get("forward")
    linear_layer.forward = types.MethodType(_blocks_forward, linear_layer)  # type: ignore[method-assign]
    return True


def detach(linear_layer: nn.Linear) -> None:
    """Undo `attach` (the layer's own forward again)."""
    if "dense_forward" not in linear_layer.__dict__:
        return
    dense = linear_layer.__dict__.pop("dense_forward")
    linear_layer.__dict__.pop("gguf_blocks", None)
    if dense is None:
        linear_layer.__dict__.pop("forward", None)
    else:
        linear_layer.forward = dense  # type: ignore[method-assign]
