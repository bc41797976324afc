"""Decode-sized bfloat16 linear layers on AMX or AVX512-BF16 (C++, compiled on first use), with fused epilogues.

At a decode step (a few dozen rows) a linear layer is a stream of its weights from memory past
a small activation block. oneDNN's prepacked kernel (engine/kernels/cpu_linear.py) runs these
shapes at about half the machine's read bandwidth; this kernel lays each weight out as the
tile unit reads it (32 output columns x 32 inputs per 2 KiB, in the order it is read) and
runs 2 x 2 tiles of 16 x 16 results per step over the reduction, 12-30% faster per step at
SmolLM2's shapes, batch 64 (benchmarks/cpu_decode_step.py --linears). On AMX they also beat
oneDNN's prepacked kernels at prefill sizes up to 1,024 rows (`AMX_MAX_ROWS`; a 512-token step
99 -> 85 ms); on AVX512-BF16 oneDNN takes over past `DECODE_MAX_ROWS`; `max_rows()` says which.

On a CPU with AVX512-BF16 and no AMX (AMD Zen 4 / Zen 5) the same layout feeds `vdpbf16ps`:
each 64-byte line of a block holds one pair of inputs for 16 output columns, so a step loads the
block's two column vectors once and multiply-adds them into up to 12 rows x 2 accumulators held
in registers (each row's input pair broadcast), while the next block is prefetched into L2 (the
hardware prefetcher stops at 4 KiB pages). On a 2-core AMD EPYC Zen 4 (vdpbf16ps peak measured
390 GFLOP/s), against oneDNN's prepacked linear at SmolLM2's shapes, weights out of cache:
1.1-2.2x at 16 rows, 1.15-1.4x at 32, 1.07-1.4x at 64 (the LM head 0.9x), ~1.0x at 128; a
decode step (benchmarks/cpu_decode_step.py) at batch 1 20 -> 15 ms, at 16 30-41 -> 26-27 ms.

Fused epilogues save a pass over memory each:
- `linear_silu_mul(x, gate_up)`: the MLP's [2I, K] gate/up projection packed so that each
  32-column block holds 16 gate and the matching 16 up columns; the results, rounded to
  bfloat16 as the plain projection would store them, become silu(gate) * up [M, I] directly
  (the same arithmetic as `servelab::silu_mul`);
- `linear_argmax(x, lm_head)`: greedy decoding's LM head: each row's logits rounded to
  bfloat16 are reduced to the index of their first maximum (a NaN counts as the maximum, as
  `max(dim=-1).indices`) without ever being stored.

    torch.ops.servelab.amx_pack(Tensor w, int interleave) -> Tensor      w [N, K] bf16
    torch.ops.servelab.amx_linear(Tensor x, Tensor packed, int N, Tensor? next=None) -> Tensor      [M, N]
    torch.ops.servelab.amx_linear_silu_mul(Tensor x, Tensor packed, int I, Tensor? next=None) -> Tensor      [M, I]
    torch.ops.servelab.amx_linear_argmax(Tensor x, Tensor packed, int N) -> Tensor      [M] int64
    torch.ops.servelab.quant_pack(Tensor blocks, str kind, Tensor w, int interleave) -> Tensor

`packed` is an `amx_pack` result or a `quant_pack` one: a GGUF checkpoint's Q4_1 / Q8_0 blocks
as stored, multiplied as the checkpoint defines them (engine/kernels/csrc/gguf_blocks.h: a third of the
bytes; AVX512-VNNI's byte products of the unrounded weights and x written in 16-bit integers per
32-input block, so not the bfloat16 kernel's bits), which the model uses for steps of at most
`quant_max_rows(packed)` rows (by block kind: `QUANT_MAX_ROWS`).

`next` (optional, AVX512-BF16 path): the packed weight of the op that runs next; while a thread
reads its last block it prefetches its first blocks of that one into L2, so a step's back-to-back
linears do not each start from memory at latency (SmolLM2's 30 layers: 1.05-1.09x at 1-4 rows, 1.01-1.04x at 16-64;
benchmarks/decode_weight_pages.py --handoff). Results never depend on it.

K must be a multiple of 32 (and I of 16); x is contiguous [M, K] bfloat16. `available()` says
whether the CPU and the build run them (amx_bf16 and the kernel grants the tile state, or
avx512_bf16); `kind()` says which. `kernels.amx=false` (engine/config.py) turns the AMX kernels
off, as it does the attention op's AMX path (the engine then runs oneDNN's kernels, as on a CPU
without AMX); `kernels.avx512_bf16=false` turns the AVX512-BF16 ones off likewise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.kernels import options
from engine.kernels.cpu_extension import load_cpu_ops

# Up to this many rows a step's linears run here on AVX512-BF16; above, oneDNN's prepacked kernels
# are faster.
DECODE_MAX_ROWS = 128
# The same on AMX tiles, where these kernels beat oneDNN's prepacked ones well past decode sizes:
# SmolLM2's 30 layers on 2 Sapphire Rapids cores, a whole prefill step (4-8 prompts of 128
# tokens, bfloat16, median of 8): 512 rows 99 -> 85 ms, 768 rows 145 -> 121 ms, 1,024 rows
# 183 -> 162 ms; past that each 32-row block re-reads weights that no longer share the cache
# with the activations and oneDNN wins (1,536 rows 205 against 275 ms, 2,048 rows 293 against
# 418 ms). Per matrix at 512 rows: o 0.25 -> 0.19 ms, down 0.71 -> 0.44 ms, gate_up with
# silu * up 1.69 -> 1.10 ms, qkv about even (docs/benchmarks-log.md, 2026-12-05).
AMX_MAX_ROWS = 1024
# Up to how many rows a quant_pack weight is read rather than the bfloat16 one, by its block kind:
# past that the products' throughput, not the stream, sets the pace and the bfloat16 kernels win.
# benchmarks/quant_linears.py on 2 Sapphire Rapids cores (AMX for bfloat16; the blocks on
# AVX512-VNNI, 2026-12-06): SmolLM2's 120 Q4_1 layer matrices 2.7x faster at 1 row, 2.2x at 4,
# 1.4x at 8, 1.19x at 10, 1.05x at 12, 0.83x at 16; its Q8_0 LM head 2.0x at 1-3 rows, 1.5x at 4,
# 1.28x at 6, 1.00x at 8 (docs/benchmarks-log.md). (With the bfloat16-word products before, on
# a 2-core Zen 4: 6 and 2.)
QUANT_MAX_ROWS = {"Q4_1": 10, "Q8_0": 6}

_SOURCE = "amx_linear.cpp"  # engine/kernels/csrc
logger = logging.getLogger(__name__)


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::amx_pack")
    def _(w: torch.Tensor, interleave: int) -> torch.Tensor:
        n, k = w.shape
        nb = interleave // 16 if interleave else -(-n // 32)
        return w.new_empty((nb, k // 32, 2, 16, 16), dtype=torch.int32)

    @torch.library.register_fake("servelab::amx_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, next: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("servelab::amx_linear_silu_mul")
    def _(x: torch.Tensor, packed: torch.Tensor, i: int, next: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], i))

    @torch.library.register_fake("servelab::amx_linear_argmax")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("servelab::quant_pack")
    def _(blocks: torch.Tensor, kind: str, w: torch.Tensor, interleave: int) -> torch.Tensor:
        n, kb, _ = blocks.shape
        nb = interleave // 16 if interleave else -(-n // 32)
        return blocks.new_empty((nb, kb, 640 if kind == "Q4_1" else 1088))


def amx_ops() -> Any | None:
    """`torch.ops.servelab` with these linear ops, or None where the CPU or the build has neither
    AMX nor AVX512-BF16 (or no C++ toolchain builds them): callers then keep oneDNN's kernels."""
    if not _loaded():
        return None
    return torch.ops.servelab if torch.ops.servelab.amx_linear_available() else None


def _loaded() -> bool:
    from engine.kernels.isa import cpu_flags

    flags, allowed = cpu_flags(), options.current()
    if "amx_bf16" in flags:
        if not allowed.amx:  # kernels.amx=false: as the attention op, every AMX path off (A/B, tests)
            return False
    elif "avx512_bf16" not in flags or not allowed.avx512_bf16:
        return False  # no build attempt on CPUs that multiply bfloat16 natively neither way
    return load_cpu_ops(_SOURCE, "AMX linear layers", _register_fakes)


def available() -> bool:
    """Whether this CPU and build run these linear ops (on AMX or AVX512-BF16)."""
    return amx_ops() is not None


def kind() -> str:
    """What runs the decode-sized bfloat16 linears here: "amx", "avx512_bf16" or "onednn"."""
    from engine.kernels.isa import cpu_flags

    if not available():
        return "onednn"
    return "amx" if "amx_bf16" in cpu_flags() else "avx512_bf16"


def max_rows() -> int:
    """Up to how many rows a step's linears run on these kernels (module constants): 1,024 on
    AMX tiles, 128 on AVX512-BF16 (0 where neither runs)."""
    k = kind()
    return {"amx": AMX_MAX_ROWS, "avx512_bf16": DECODE_MAX_ROWS}.get(k, 0)


def pack(weight: torch.Tensor, interleave: int = 0) -> torch.Tensor:
    """weight [N, K] bfloat16 -> the packed layout the ops read (module note)."""
    ops = amx_ops()
    assert ops is not None, "AMX linear ops unavailable"
    return ops.amx_pack(weight.detach(), interleave)


def supports(weight: torch.Tensor, interleave: int = 0) -> bool:
    """A weight these ops take: [N, K] bfloat16 on the CPU, 32 | K (and 16 | I for interleave I)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 32:
        return False
    return interleave == 0 or (weight.shape[0] == 2 * interleave and interleave % 16 == 0)


# GGUF block types the quant ops read as stored (engine/kernels/csrc/gguf_blocks.h).
GGUF_BLOCK_KINDS = ("Q4_1", "Q8_0")


# quant_pack's tile bytes (its last dimension) -> block kind (engine/kernels/csrc/gguf_blocks.h)
_TILE_KINDS = {640: "Q4_1", 1088: "Q8_0"}


def block_kind(packed: torch.Tensor) -> str:
    """The GGUF block kind ("Q4_1", "Q8_0") of a quant_pack result."""
    return _TILE_KINDS[int(packed.shape[-1])]


def quant_max_rows(packed: torch.Tensor) -> int:
    """Up to how many rows a step reads this quant_pack result instead of the bfloat16 pack."""
    return QUANT_MAX_ROWS[block_kind(packed)]


def quant_available() -> bool:
    """Whether the decode linears can read a GGUF checkpoint's Q4_1 / Q8_0 blocks as stored (the
    AVX512-BF16 and AVX512-VNNI build; `model.quantized_decode=false` keeps a model off them)."""
    ops = amx_ops()
    return ops is not None and bool(ops.quant_linear_available())


def quant_pack(blocks: torch.Tensor, kind: str, weight: torch.Tensor, interleave: int = 0) -> torch.Tensor | None:
    """A GGUF tensor's blocks (uint8 [N, K / 32, block bytes], `weight`'s rows in its order) in the
    quant ops' layout, or None where they do not reproduce `weight` (bfloat16 [N, K]) bit for bit
    or the ops are unavailable: the caller then keeps the bfloat16 kernels."""
    if kind not in GGUF_BLOCK_KINDS or not quant_available() or not supports(weight, interleave):
        return None
    try:
        return torch.ops.servelab.quant_pack(blocks, kind, weight.detach(), interleave)
    except RuntimeError as exc:
        logger.warning("decode linears: %s; reading the bfloat16 weight instead", exc)
        return None
