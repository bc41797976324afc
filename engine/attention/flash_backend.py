"""FlashAttention and FlashInfer adapters over the engine's paged KV cache.

Both libraries import lazily (inside `is_available` checks and `forward`), so this
module imports on any machine; `is_available` says "... is not installed" or
"... needs a CUDA GPU". Both write the step's K/V with the Triton
`reshape_and_cache` kernel when triton is present, else with a torch scatter.

Cache layout: kv_cache [2, num_blocks, block_size, Hkv, D] (backend.py), so
kv_cache[0] / kv_cache[1] are exactly the NHD paged K and V tensors both
libraries accept. Their causal masks are bottom-right aligned when a request has
more keys than queries, which is this engine's convention (queries are the last
query_len tokens of the sequence).
"""

from __future__ import annotations

import importlib.util
from abc import abstractmethod
from typing import Any

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, window_excludes

# Upstream flash_attn 2 accepts a block table only for pages that are a multiple of this.
FLASH_ATTN_PAGE_MULTIPLE = 256
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024


def _cuda_library_available(module: str, device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec(module) is None:
        return False, f"{module} is not installed"
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"{module} needs a CUDA GPU"
    return True, ""


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 skipped
    num_tokens: int,
) -> None:
    """Scatter the first num_tokens rows of k/v into the cache by slot (in place)."""
    if importlib.util.find_spec("triton") is not None and k.device.type == "cuda":
        from engine.attention.triton_kernels import reshape_and_cache

        reshape_and_cache(k, v, kv_cache, slot_mapping, num_tokens)
        return
    num_blocks, block_size, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0
    flat[0][slots[keep]] = k[:num_tokens][keep].to(kv_cache.dtype)
    flat[1][slots[keep]] = v[:num_tokens][keep].to(kv_cache.dtype)


class _LibraryBackend(AttentionBackend):
    """The forward both adapters share: check the dtype, write the step's K/V, attend over the
    real tokens only (rows past metadata.num_tokens come back zero). `name` is the library's."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write k/v into kv_cache, then attend with the library (fp16/bf16 only); no sliding window yet."""
        if window_excludes(metadata, window):
            raise NotImplementedError(f"{self.name}: sliding-window attention (window {window}) is not implemented; "
                                      "use the torch backend")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{self.name} supports float16/bfloat16 only, got {q.dtype}; use dtype='bfloat16'")
        n = metadata.num_tokens
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, n)
        out = torch.zeros_like(q)
        out[:n] = self._attend(q[:n], kv_cache, metadata, scale)
        return out

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [num_tokens, Hq, D], the step's real tokens -> [num_tokens, Hq, D]."""


class FlashAttnBackend(_LibraryBackend):
    """`flash_attn` (FlashAttention 2) over the paged cache.

    Pages that are a multiple of 256 tokens go straight to the kernels through the
    block table (`flash_attn_with_kvcache` for pure decode, `flash_attn_varlen_func`
    otherwise). Smaller pages, which upstream flash_attn rejects, are first gathered
    into contiguous per-request K/V (one gather per layer) and run without a block table.
    """

    name = "flash_attn"

    def __init__(self) -> None:
        self._cu_seqlens_k: torch.Tensor | None = None  # [num_reqs + 1] int32
        self._gather_slots: torch.Tensor | None = None  # [sum(seq_lens)] int64, small pages only

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        return _cuda_library_available("flash_attn", device)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        n = metadata.num_reqs
        seq_lens = metadata.seq_lens[:n]
        cu = torch.zeros(n + 1, dtype=torch.int32, device=seq_lens.device)
        cu[1:] = torch.cumsum(seq_lens, 0)
        self._cu_seqlens_k = cu
        self._gather_slots = None
        if metadata.block_size % FLASH_ATTN_PAGE_MULTIPLE != 0:
            total = sum(metadata.seq_lens_cpu[:n])
            req = torch.repeat_interleave(
                torch.arange(n, device=cu.device), seq_lens.long(), output_size=total
            )  # [total] request of each context position
            pos = torch.arange(total, device=cu.device) - cu[req].long()  # [total] position within request
            blocks = metadata.block_table[req, pos // metadata.block_size].long()
            self._gather_slots = blocks * metadata.block_size + pos % metadata.block_size

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        if self._cu_seqlens_k is None:
            self.begin_step(metadata)
        nr = metadata.num_reqs
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self._gather_slots is None and metadata.is_pure_decode:
            o = flash_attn_with_kvcache(
                q.unsqueeze(1), key_cache, value_cache,  # q: [num_reqs, 1, Hq, D]
                cache_seqlens=metadata.seq_lens[:nr], block_table=metadata.block_table[:nr],
                softmax_scale=scale, causal=True,
            )  # fmt: skip
            return o.squeeze(1)
        common: dict[str, Any] = dict(
            cu_seqlens_q=metadata.query_start_loc[: nr + 1], cu_seqlens_k=self._cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        if self._gather_slots is None:
            return flash_attn_varlen_func(
                q, key_cache, value_cache, block_table=metadata.block_table[:nr], **common
            )
        hkv, d = key_cache.shape[2:]
        keys = key_cache.reshape(-1, hkv, d)[self._gather_slots]  # [sum(seq_lens), Hkv, D]
        values = value_cache.reshape(-1, hkv, d)[self._gather_slots]
        return flash_attn_varlen_func(q, keys, values, **common)


class FlashInferBackend(_LibraryBackend):
    """`flashinfer` BatchPrefillWithPagedKVCacheWrapper over the paged cache (NHD layout).

    The page table (CSR indptr / indices / last-page lengths) is built in
    `begin_step`; the wrapper is planned once per step at the first layer's
    forward (head counts and dtypes are known only then) and reused by every layer.
    """

    name = "flashinfer"

    def __init__(self) -> None:
        self._wrapper: Any = None
        self._metadata: AttentionMetadata | None = None
        self._page_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._planned = False

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        return _cuda_library_available("flashinfer", device)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        n, bs = metadata.num_reqs, metadata.block_size
        device = metadata.block_table.device
        num_pages = [-(-s // bs) for s in metadata.seq_lens_cpu[:n]]
        indptr = [0]
        for p in num_pages:
            indptr.append(indptr[-1] + p)
        pages = torch.tensor(num_pages, dtype=torch.int32, device=device)  # [num_reqs]
        max_blocks = metadata.block_table.shape[1]
        used = torch.arange(max_blocks, device=device)[None, :] < pages[:, None]  # [num_reqs, max_blocks]
        indices = metadata.block_table[:n][used].to(torch.int32)  # [sum(num_pages)] physical pages in order
        last_len = torch.tensor(
            [s - (p - 1) * bs for s, p in zip(metadata.seq_lens_cpu[:n], num_pages, strict=True)],
            dtype=torch.int32, device=device,
        )  # fmt: skip
        self._page_table = (torch.tensor(indptr, dtype=torch.int32, device=device), indices, last_len)
        self._metadata = metadata
        self._planned = False

    def _plan(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> None:
        import flashinfer

        if self._wrapper is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if self._metadata is not metadata or self._page_table is None:
            self.begin_step(metadata)
        assert self._page_table is not None
        indptr, indices, last_len = self._page_table
        num_heads, head_dim = q.shape[1], q.shape[2]
        self._wrapper.plan(
            metadata.query_start_loc[: metadata.num_reqs + 1], indptr, indices, last_len,
            num_heads, kv_cache.shape[3], head_dim, metadata.block_size,
            causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
        )  # fmt: skip
        self._planned = True

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if not self._planned or self._metadata is not metadata:
            self._plan(q, kv_cache, metadata, scale)
        run = getattr(self._wrapper, "run", None) or self._wrapper.forward
        return run(q, (kv_cache[0], kv_cache[1]))
