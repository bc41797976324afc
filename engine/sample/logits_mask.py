"""Applying grammar bitmasks to logits before sampling (structured output).

A bitmask row is int32 words: bit `t % 32` of word `t // 32` set means token `t` is
allowed. Tokens past the grammar's vocabulary (the model's logits may be wider) are
disallowed.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, W] int32 -> allowed [R, vocab_size] bool on `device`."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))  # [R, W]
    bits = (words[:, :, None] >> _BITS) & 1  # [R, W, 32]
    allowed = bits.reshape(words.shape[0], -1).bool()  # [R, 32 * W]
    n = min(vocab_size, allowed.shape[1])
    out = torch.zeros(words.shape[0], vocab_size, dtype=torch.bool)
    out[:, :n] = allowed[:, :n]
    return out.to(device)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """logits [N, V]: rows `rows` [R] keep only their allowed tokens (others -> -inf).

    Returns a new tensor (the caller may still hold the raw logits, for logprobs)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1], logits.device)  # [R, V]
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
