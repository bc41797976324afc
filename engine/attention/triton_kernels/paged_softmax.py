"""The paged online-softmax loop both attention kernels run (decode split-K and varlen prefill).

A program holds ROWS query rows (query heads of one kv head, times query tokens for
prefill) and walks context positions [start, end) of one sequence through its block
table, BLOCK_N positions per iteration. Per iteration it loads the K/V tile from the paged
cache (position n lives in block block_table[n // block_size], offset n % block_size),
scores it with one tl.dot, and folds it into a running max `m_i`, sum `l_i` and
unnormalised output `acc`, all fp32 and in the log2 domain (`qk_scale` includes log2(e)).
With CAUSAL a row sees only positions <= its own `q_pos`.

The caller normalises (`acc / l_i`) or, for split-K, stores the three partials for a
reduce. Every row must see at least one position of the first tile (decode: start < end;
prefill: position 0 precedes every row's own), so `m_i` is finite after it and no
`exp2(-inf - -inf)` arises; a loop that runs no iteration returns m_i = -inf, l_i = 0.
BLOCK_D and BLOCK_N are the K sides of the two tl.dot products: a GPU compile needs them
>= 16 (the interpreter accepts less); the kernels keep ROWS >= 16 as well.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_online_softmax(
    q,  # [ROWS, BLOCK_D] query rows (fp32 when UPCAST), padded rows/columns zero
    q_pos,  # [ROWS] absolute position of each row's token (read only when CAUSAL)
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,
    block_table_row_ptr,  # this sequence's row of the block table (int32)
    kv_head_off,  # kv_head * stride_ch
    start,  # first context position
    end,  # one past the last context position
    qk_scale,  # softmax scale * log2(e)
    stride_cb,
    stride_cs,
    block_size,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """-> (acc [ROWS, BLOCK_D] unnormalised, m_i [ROWS] running max, l_i [ROWS] running sum)."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        n_mask = n < end
        blk = tl.load(block_table_row_ptr + n // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (n % block_size) * stride_cs + kv_head_off  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_N]
        if CAUSAL:
            visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        else:
            visible = n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
