"""Write a step's new keys/values into the paged KV cache by slot mapping.

Cache layout (engine/attention/backend.py): kv_cache [2, num_blocks, block_size,
num_kv_heads, head_dim]; token with slot s lives at block s // block_size, offset
s % block_size. Slots < 0 mark padding tokens and are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import check_last_dim_contiguous, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # A negative slot masks every lane, so padding tokens touch no memory.
    mask = (h < num_kv_heads) & (d < HEAD_DIM) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    dst = (safe_slot // block_size) * stride_cb + (safe_slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [>= T] int64; entries < 0 are skipped
    num_tokens: int | None = None,
) -> None:
    """Scatter rows 0..num_tokens-1 of k/v into kv_cache in place (casting to the cache dtype)."""
    n = k.shape[0] if num_tokens is None else num_tokens
    if n == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    check_last_dim_contiguous(k=k, v=v, key_cache=key_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    _reshape_and_cache_kernel[(n,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_size, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
    )  # fmt: skip
