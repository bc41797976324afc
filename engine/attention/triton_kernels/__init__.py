"""Triton kernels for paged attention.

Importing this package defines the kernels: set TRITON_INTERPRET=1 before the
first import to run them on CPU tensors. Requires `triton` to be installed.
"""

from engine.attention.triton_kernels.decode_attention import choose_num_splits, paged_decode_attention
from engine.attention.triton_kernels.prefill_attention import paged_prefill_attention
from engine.attention.triton_kernels.reshape_and_cache import reshape_and_cache

__all__ = ["choose_num_splits", "paged_decode_attention", "paged_prefill_attention", "reshape_and_cache"]
