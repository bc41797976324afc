"""Paged attention for packed variable-length queries (prefill, chunked prefill, mixed batches).

Grid (num_reqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads). A program owns
BLOCK_M = BLOCK_Q * G rows: BLOCK_Q consecutive query tokens of one request times
the G query heads sharing one kv head (row m is token m // G, head m % G), so
GQA reads each K/V tile once for the whole group. Every key/value, including the
step's own chunk, is read from the paged cache (the caller writes it first), so a
cached prefix (context_len = seq_len - query_len > 0) needs no special path: query
token j sits at position context_len + j and sees positions <= context_len + j.
Requests with query_len == 1 (decodes in a mixed batch) are handled the same way.
The loop over the context is the causal form of the paged online softmax
(`paged_softmax.py`) that the decode kernel runs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import (
    LOG2E,
    cdiv,
    check_last_dim_contiguous,
    dot_precision,
    is_interpreting,
    next_pow2,
)
from engine.attention.triton_kernels.paged_softmax import paged_online_softmax


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_idx = q_tile * BLOCK_Q + m // GROUP  # [BLOCK_M] query token within the request
    head = kv_head * GROUP + m % GROUP  # [BLOCK_M]
    row_mask = (q_idx < q_len) & (m // GROUP < BLOCK_Q)
    d_mask = d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position of each row's token

    # Keys this tile can see: up to its last token's position; none for an empty tile.
    tile_end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, tile_end, 0)

    acc, _, l_i = paged_online_softmax(
        q, q_pos, key_cache_ptr, value_cache_ptr, block_table_ptr + req * stride_bt, kv_head * stride_ch,
        0, kv_end, qk_scale, stride_cb, stride_cs, block_size,
        ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=True, UPCAST=UPCAST,
        DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] packed by query_start_loc
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], already holding this step's K/V
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of every packed query token over its request's cached context.

    `block_m` is the rows per program (query tokens x group heads, default 64 on a
    GPU, 16 interpreted; raised to cover one whole group); `block_n` the context
    positions per inner iteration (default 64 / 16).
    """
    num_reqs = block_table.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return out
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    check_last_dim_contiguous(q=q, out=out, key_cache=key_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    small = is_interpreting()
    block_m = max(block_m or (16 if small else 64), 16, next_pow2(group))
    block_n = block_n or (16 if small else 64)
    block_q = block_m // group
    grid = (num_reqs, cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), block_size,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_N=block_n, UPCAST=small, DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
