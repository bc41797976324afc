"""Launch-side helpers shared by the paged-attention Triton kernels."""

from __future__ import annotations

import os

import torch

# exp(x) == exp2(x * LOG2E): the kernels keep scores in the log2 domain.
LOG2E = 1.4426950408889634


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (tf32 would cost ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels address the head dimension with stride 1; everything else goes by strides."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
