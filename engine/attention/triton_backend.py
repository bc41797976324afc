"""Attention over the paged KV cache with the Triton kernels in `triton_kernels/`.

Per layer: `reshape_and_cache` writes the step's K/V by slot mapping, then a
pure-decode step (every query length 1) runs the split-K decode kernel, and any
step holding a longer query (prefill, chunked prefill, prefix hit, or a mixed
batch of prefills and decodes) runs the varlen prefill kernel over all requests,
which treats a decode as a one-token query. The kernels import lazily, so this
module imports on a machine without triton or a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, window_excludes


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> ModuleType:
    import engine.attention.triton_kernels as kernels

    return kernels


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; on CPU only under TRITON_INTERPRET=1.

    `decode_num_splits` forces the split-K partition count of the decode kernel
    (None: chosen per step from the SM count, 1 on CPU).
    """

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        self.decode_num_splits = decode_num_splits

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        if device.type == "cuda" and torch.cuda.is_available():
            return True, ""
        if device.type == "cpu" and _interpreting():
            return True, ""
        return False, "triton needs a GPU or TRITON_INTERPRET=1"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into kv_cache (in place), then attend; rows past metadata.num_tokens are zero. No
        sliding window yet."""
        if window_excludes(metadata, window):
            raise NotImplementedError(f"{self.name}: sliding-window attention (window {window}) is not implemented; "
                                      "use the torch backend")
        kernels = _kernels()
        n = metadata.num_tokens
        kernels.reshape_and_cache(k, v, kv_cache, metadata.slot_mapping, n)
        out = torch.empty_like(q) if q.shape[0] == n else torch.zeros_like(q)
        if metadata.num_reqs == 0 or n == 0:
            return out
        block_table = metadata.block_table[: metadata.num_reqs]
        seq_lens = metadata.seq_lens[: metadata.num_reqs]
        if metadata.is_pure_decode:
            kernels.paged_decode_attention(
                q, kv_cache, block_table, seq_lens, metadata.query_start_loc,
                metadata.max_seq_len, scale, out, num_splits=self.decode_num_splits,
            )  # fmt: skip
        else:
            kernels.paged_prefill_attention(
                q, kv_cache, block_table, seq_lens, metadata.query_start_loc,
                metadata.max_query_len, scale, out,
            )  # fmt: skip
        return out
