"""Attention straight from the paged KV cache on a CPU: one C++ kernel for any query rows
(decode, and prefill over a cached context), float32 or bfloat16. The torch backend uses it
for decode, where it beat gather + SDPA 4.6x in bfloat16 and 1.6x in float32. For prefill rows
SDPA's GEMM-based kernel was faster on the Intel Xeons measured first; in bfloat16 on an AMD
Zen 5 (AVX512-BF16, no AMX) this op's vdpbf16ps path was faster (1.6 vs 3.0 ms for 4 fresh
prompts of 128 tokens), and the backend sends such steps' prefill rows here
(`torch_backend.prefill_on_paged_op`; benchmarks/cpu_paged_attention.py).

    torch.ops.servelab.paged_attention(Tensor q, Tensor kv_cache, Tensor block_table,
                                       Tensor query_start_loc, Tensor seq_lens, float scale,
                                       bool batch_invariant=False) -> Tensor

q: [T, Hq, D] (any row / head strides, unit stride within a head); kv_cache: [2, num_blocks,
block_size, Hkv, D] contiguous, q's dtype; block_table: [B, max_blocks] int (request b's blocks);
query_start_loc: [B + 1] int (request b's query rows are q[qsl[b]:qsl[b+1]]); seq_lens: [B] int
(request b's context length, this step's tokens included and already written to the cache).
Query row i of request b sits at position seq_len - q_len + (i - qsl[b]) and attends to
positions 0 .. its own (causal with offset); returns [T, Hq, D] contiguous, q's dtype.
`batch_invariant`: the path and the work split ignore how many rows the call has, so a row's
result is its own query's and context's alone, bit for bit, whatever shares the call
(`model.batch_invariant`; tests/test_batch_invariant.py).

Design: one work item per query row (all Hq heads together), so each key / value row, which
holds all Hkv heads contiguously, is read once per query row in cache order and converted to
float32 once for the G = Hq / Hkv query heads sharing it. Decode is memory-bound: this reads
the context once instead of gather + SDPA's reads. Scores are float32, softmax exact (max-shifted).

Paths, chosen per call: AVX-512 (head_dim 64 or 128; bfloat16 scores by vdpbf16ps where the
CPU has AVX512-BF16, and values two tokens a step by vdpbf16ps with the probabilities rounded to
bfloat16; cache blocks prefetched into L2 four ahead), AMX for bfloat16 where the CPU has it (a query row's scores against 16
cached tokens are one tile product: see the kernel's note; cold-cache decode at SmolLM2's
shape, 30 layers: 0.57 against 0.67 ms per layer on the AVX-512 path), else scalar C++.
Calls of fewer than 8 query rows stay on the AVX-512 path even there (as fast or faster at 1-4
rows, paged_attention.cpp `kAmxMinRows`). With fewer work items than twice the threads (a decode
step of a row or two), the AVX-512 path cuts each item's context into segments of whole blocks,
attended as separate items and merged by their softmax maxima and sums (flash-decoding's split):
at batch 1, SmolLM2's 3 kv heads make 6 items on 2 threads instead of 3 (1 thread against 2 at
4,096 tokens: 368 against 187 us; at 256 tokens, where a call's fixed cost weighs, 14.7 against
12.5 us). A batch-invariant call never splits.
`set_amx_attention(False)` (or `kernels.amx=false`) keeps bfloat16 on the AVX-512 path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import options
from engine.kernels.cpu_extension import load_cpu_ops
from engine.kernels.isa import cpu_flags

_SOURCE = "paged_attention.cpp"  # engine/kernels/csrc


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::write_kv_")
    def _(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("servelab::paged_prefill_attention_")
    def _(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> bool:
        return False

    @torch.library.register_fake("servelab::paged_attention")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
          seq_lens: torch.Tensor, scale: float, batch_invariant: bool = False) -> torch.Tensor:
        return q.new_empty(q.shape)


def write_kv_op() -> Any | None:
    """`torch.ops.servelab.write_kv_(kv_cache, k, v, slot_mapping)`, or None where no C++ toolchain builds it."""
    if load_cpu_ops(_SOURCE, "torch attention backend", _register_fakes):
        return torch.ops.servelab.write_kv_
    return None


def paged_prefill_attention_op() -> Any | None:
    """`torch.ops.servelab.paged_prefill_attention_(out, q, kv_cache, block_table, query_start,
    query_len, seq_lens, scale) -> bool` (prefill rows on AMX; False: not applicable, use
    another path), or None where no C++ toolchain builds it."""
    if load_cpu_ops(_SOURCE, "torch attention backend", _register_fakes):
        return torch.ops.servelab.paged_prefill_attention_
    return None


def _load() -> bool:
    """Load the op's library once (its AMX switch then set from `kernels.amx`)."""
    global _applied
    if not load_cpu_ops(_SOURCE, "torch attention backend", _register_fakes):
        return False
    if not _applied:
        _applied = True
        torch.ops.servelab.set_amx_attention(options.current().amx)
    return True


_applied = False


def apply_options() -> None:
    """After `options.configure`: the loaded op's AMX path follows `kernels.amx` (not loaded: at load)."""
    global _applied
    if _applied:
        torch.ops.servelab.set_amx_attention(options.current().amx)


options.on_configure(apply_options)


def paged_attention_op() -> Any | None:
    """`torch.ops.servelab.paged_attention`, or None where no C++ toolchain builds it."""
    if _load():
        return torch.ops.servelab.paged_attention
    return None


def set_amx_attention(enabled: bool) -> bool:
    """Allow (or forbid) the op's AMX path; returns whether it now runs (built for this CPU and
    permitted by the kernel). Off, bfloat16 takes the AVX-512 path: tests and A/B benchmarks run
    both in one process. `kernels.amx=false` starts an engine with it off."""
    if not _load():
        return False
    return bool(torch.ops.servelab.set_amx_attention(enabled))


@functools.cache
def prefill_on_paged_op(dtype: torch.dtype) -> bool:
    """Whether a step's prefill rows go through the C++ paged-attention op (engine/attention/torch_backend.py's note):
    bfloat16 on a CPU with AVX512-BF16 and without AMX (which has its own prefill op)."""
    flags = cpu_flags()
    return dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags
