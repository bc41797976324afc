"""Decode linears on a GGUF checkpoint's own blocks on any CPU: AVX2 (x86-64-v3) or the scalar reference.

The AVX-512 kernels (amx_linear.quant_pack, engine/kernels/csrc/gguf_blocks.h) read Q4_1 / Q8_0 blocks on
CPUs with AVX512-BF16 and VNNI, in a bfloat16 engine. Everywhere else (an AVX2-only CPU: the
hosted CI runners, most AMD cloud machines, most laptops; a float32 engine) this op reads them:

    torch.ops.servelab.block_pack(Tensor blocks, str kind) -> Tensor
        blocks uint8 [N, K / 32 (256 for Q4_K / Q6_K), block bytes] (the GGUF bytes of each output column, as
        gguf_loader.load_gguf_blocks gives them) -> uint8 [N, column bytes]: each column's quant
        bytes, then its blocks' fp16 scales as arrays (the same bytes, laid out once at load time)
    torch.ops.servelab.block_linear(Tensor x, Tensor packed, str kind, bool scalar=False) -> Tensor
        x [M, K] float32 | bfloat16 contiguous, packed from block_pack -> [M, N], x's dtype
    torch.ops.servelab.block_linear_isa() -> str      "avx2" | "scalar": what this build multiplies with

x is written per 32-input block in about 14 bits (engine/kernels/csrc/block_linear.cpp), and each block's
32 products summed in integers: a step reads 5 (Q4_1), 5.5 (Q5_0), 8.5 (Q8_0), 4.6 (Q4_K, its scales
unpacked to bytes) or 6.6 (Q6_K) bits a weight where the float32 engine read 32 (the K-quants'
256-weight super-blocks: engine/kernels/csrc/kquant_blocks.h). Past a few rows the products' cost,
not the read, sets the pace and the dense kernels (oneDNN, the BLAS) win: `MAX_ROWS` by block kind, measured with
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

_SOURCE = "block_linear.cpp"  # engine/kernels/csrc (the K-quants: kquant_blocks.h)
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}  # a GGUF block's bytes
BLOCK_WEIGHTS = {"Q4_K": 256, "Q6_K": 256}  # weights a block holds where not 32 (the K-quants' super-blocks)
QUANT_BYTES = {"Q4_1": 16, "Q8_0": 32, "Q5_0": 20}  # a 32-weight block's bytes other than the fp16 scales
SUPER_BYTES = {"Q4_K": 148, "Q6_K": 210}  # a packed K-quant super-block's bytes (Q4_K's scales unpacked)
# Up to how many rows a step reads a linear's blocks rather than its dense weight, by block kind
# (module note). 2-core AMD EPYC (Zen 3, AVX2), SmolLM2's matrices, float32 dense weights
# (oneDNN prepacked), weights out of cache: see docs/benchmarks.md ("Block linears on AVX2").
# Q4_K / Q6_K: the others' limit, not yet measured on their own (benchmarks/quant_linears.py has no K-quant case).
MAX_ROWS = {"Q4_1": 8, "Q8_0": 8, "Q5_0": 8, "Q4_K": 8, "Q6_K": 8}


def block_weights(kind: str) -> int:
    """How many weights of a column one GGUF block of `kind` holds (32; 256 for Q4_K / Q6_K)."""
    return BLOCK_WEIGHTS.get(kind, 32)


def column_bytes(kind: str, k: int) -> int:
    """A packed column's bytes for `k` inputs (engine/kernels/csrc/block_quant.h `column_bytes`)."""
    if kind in SUPER_BYTES:
        return k // 256 * SUPER_BYTES[kind]
    kb = k // 32
    return kb * QUANT_BYTES[kind] + -(-kb // 8) * 8 * 2 * (2 if kind == "Q4_1" else 1)


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::block_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, kind: str, scalar: bool = False) -> torch.Tensor:
        return x.new_empty((x.shape[0], packed.shape[0]))

    @torch.library.register_fake("servelab::block_pack")
    def _(blocks: torch.Tensor, kind: str) -> torch.Tensor:
        n, nb, _ = blocks.shape
        return blocks.new_empty((n, column_bytes(kind, nb * block_weights(kind))))


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
    """GGUF blocks uint8 [N, K / block_weights, block bytes] -> the layout `linear` reads (block_pack)."""
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
    parts: tuple[tuple[str, torch.Tensor], ...] = self.__dict__["gguf_parts"]
    if self.bias is None and not torch.compiler.is_compiling() and all(takes(x, kind) for kind, _ in parts):
        if len(parts) == 1:
            return linear(x, parts[0][1], parts[0][0])
        return torch.cat([linear(x, packed, kind) for kind, packed in parts], dim=-1)
    dense: Callable[[torch.Tensor], torch.Tensor] | None = self.__dict__["dense_forward"]
    return dense(x) if dense is not None else nn.Linear.forward(self, x)


def describes(kind: str, blocks: torch.Tensor, rows: int, k: int) -> bool:
    """Whether `blocks` are GGUF blocks of `kind` this op reads for a [rows, k] weight."""
    bw = block_weights(kind)
    return kind in BLOCK_BYTES and k % bw == 0 and tuple(blocks.shape) == (rows, k // bw, BLOCK_BYTES[kind])


def attach(linear_layer: nn.Linear, kind: str, blocks: torch.Tensor) -> bool:
    """Let `linear_layer` read `blocks` (GGUF uint8 [N, K / block_weights, bytes] of `kind`, packed here) at
    decode-sized steps, its own forward (oneDNN's packed weight or the plain one) above that. False
    where the blocks do not describe this layer's weight (shape) or the op cannot run them."""
    return attach_parts(linear_layer, [(kind, blocks)])


def attach_parts(linear_layer: nn.Linear, parts: list[tuple[str, torch.Tensor]]) -> bool:
    """`attach` for a fused weight whose row ranges are stored in different block kinds (Gemma 3's
    q / k in Q5_0 and v in Q8_0): `parts` the (kind, GGUF blocks) of its rows in order; a step reads
    each part's blocks and concatenates the outputs. A layer of one kind keeps `gguf_blocks`
    (kind, packed), which the planned forward reads (forward_plan.py). False, and nothing attached,
    where the parts do not describe the layer's weight or the op cannot run them."""
    n, k = linear_layer.weight.shape
    merged: list[tuple[str, torch.Tensor]] = []
    for kind, blocks in parts:  # neighbours of one kind: one call
        if merged and merged[-1][0] == kind and blocks.shape[1:] == merged[-1][1].shape[1:]:
            merged[-1] = (kind, torch.cat([merged[-1][1], blocks]))
        else:
            merged.append((kind, blocks))
    if (not merged or block_ops() is None or linear_layer.weight.device.type != "cpu"
            or sum(b.shape[0] for _, b in merged) != n or not all(describes(kd, b, b.shape[0], k) for kd, b in merged)):  # fmt: skip
        return False
    packed = tuple((kind, pack(blocks, kind)) for kind, blocks in merged)
    linear_layer.__dict__["gguf_parts"] = packed
    if len(packed) == 1:
        linear_layer.gguf_blocks = packed[0]  # type: ignore[assignment]
    else:
        linear_layer.__dict__.pop("gguf_blocks", None)
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
    linear_layer.__dict__.pop("gguf_parts", None)
    if dense is None:
        linear_layer.__dict__.pop("forward", None)
    else:
        linear_layer.forward = dense  # type: ignore[method-assign]
