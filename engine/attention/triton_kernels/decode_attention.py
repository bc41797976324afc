"""Paged decode attention: one query token per sequence, flash-decoding split-K.

Grid (num_seqs, num_kv_heads, num_splits). One program loads the G = num_heads /
num_kv_heads query heads that share a kv head (padded to >= 16 rows so tl.dot
works on a GPU), walks its slice of the context through the block table and
keeps an online softmax in fp32 (log2 domain). With one split it writes the
output directly; otherwise it writes unnormalised partials (acc, max, sum) that
`_decode_reduce_kernel` merges, so long contexts at small batch still fill the GPU.
"""

from __future__ import annotations

import functools

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

# A split shorter than this costs more in the reduce than it wins in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [T, Hq, D] (SINGLE_SPLIT)
    part_o_ptr,  # [num_seqs, Hq, num_splits, D] fp32 (split-K)
    part_m_ptr,  # [num_seqs, Hq, num_splits] fp32
    part_l_ptr,  # [num_seqs, Hq, num_splits] fp32
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,
    num_splits,
    num_heads,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g  # [BLOCK_G]
    g_mask = g < GROUP
    q_mask = g_mask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)  # [BLOCK_G, BLOCK_D]

    # Not causal (q_pos, given g, is not read): the decode token sees its whole context.
    acc, m_i, l_i = paged_online_softmax(
        q, g, key_cache_ptr, value_cache_ptr, block_table_ptr + seq * stride_bt, kv_head * stride_ch,
        start, end, qk_scale, stride_cb, stride_cs, block_size,
        ROWS=BLOCK_G, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=False, UPCAST=UPCAST,
        DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    if SINGLE_SPLIT:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * num_heads + head) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,  # [num_seqs, Hq, num_splits, D] fp32
    part_m_ptr,  # [num_seqs, Hq, num_splits] fp32
    part_l_ptr,
    query_start_loc_ptr,
    out_ptr,  # [T, Hq, D]
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    base = (seq * num_heads + head) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    l_s = tl.load(part_l_ptr + base + s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds position 0
    w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
    o_mask = s_mask[:, None] & d_mask[None, :]
    o = tl.load(part_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=o_mask, other=0.0)
    num = tl.sum(o * w[:, None], 0)  # [BLOCK_D]
    den = tl.sum(l_s * w, 0)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split the context until ~2 programs per SM exist, never below MIN_TOKENS_PER_SPLIT tokens."""
    programs = num_seqs * num_kv_heads
    wanted = cdiv(2 * num_sms, max(programs, 1))
    by_length = cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    if q.device.type != "cuda":
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return choose_num_splits(num_seqs, num_kv_heads, max_seq_len, sms)


def paged_decode_attention(
    q: torch.Tensor,  # [T, Hq, D]; row query_start_loc[i] is sequence i's query
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written at the query rows only
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole cached context.

    The new token's K/V must already be in the cache. `num_splits` None picks a
    split count from the device's SM count (1 on CPU); `block_n` is the number of
    context positions per inner iteration (default 64 on a GPU, 16 interpreted).
    """
    num_seqs = block_table.shape[0]
    if num_seqs == 0:
        return out
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    check_last_dim_contiguous(q=q, out=out, key_cache=key_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    block_n = block_n or (16 if is_interpreting() else 64)
    splits = num_splits or _default_num_splits(q, num_seqs, num_kv_heads, max_seq_len)
    tokens_per_split = cdiv(cdiv(max_seq_len, splits), block_n) * block_n
    splits = cdiv(max_seq_len, tokens_per_split)
    single = splits == 1
    if single:
        part_o = part_m = part_l = out  # unused placeholders
    else:
        part_o = torch.empty(num_seqs, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
        part_m = torch.empty(num_seqs, num_heads, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    block_d = next_pow2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, out,
        part_o, part_m, part_l,
        scale * LOG2E, tokens_per_split, splits, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), block_size,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, SINGLE_SPLIT=single, UPCAST=is_interpreting(), DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o, part_m, part_l, query_start_loc, out, splits, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(splits),
        )  # fmt: skip
    return out
