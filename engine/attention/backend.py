"""The attention backend seam.

The model calls `backend.forward(...)` once per layer with the step's packed
queries/keys/values; the backend writes the new K/V into the paged cache by slot
mapping and attends over the cache by block table. The scheduler and the model
never know which backend runs.

Paged KV cache layout (one tensor per layer):
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[0] holds keys, kv_cache[1] values. Token with absolute slot s lives at
    block s // block_size, offset s % block_size.

Packed batch layout (one step):
    Requests are laid out back to back: request i owns query rows
    query_start_loc[i] : query_start_loc[i + 1]. Its query tokens are the LAST
    query_len_i tokens of its sequence of seq_lens[i] tokens (the first
    seq_lens[i] - query_len_i are already in the cache: a cached prefix, earlier
    chunks or earlier decode steps). Query token j of request i sits at position
    context_len_i + j and attends causally to positions 0 .. context_len_i + j; in a layer with a
    sliding window w (Gemma 3's local layers) only to positions context_len_i + j - w + 1 ..
    context_len_i + j.

KV cache groups (engine/kv_cache_spec.py): a model whose layers form several groups gets one
metadata per group: the step's metadata is group 0's, `group_metadata[g - 1]` group g's (the same
requests, rows and lengths; the group's own `slot_mapping` and `block_table`), and each layer
passes its group's to `forward` (`for_group`). In a sliding group a position wholly outside the
window may have been given back: its table entry is stale and must not be read (the torch backend
reads only the window's blocks where a window hides a position; the others refuse such steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class OneRowEach:
    """What a decode step whose request i is query row i (one row each, in order) adds for the
    backends, in the forms the CPU paged-attention op reads: no conversion per step."""

    seq_lens: torch.Tensor  # [num_reqs] int64: the same lengths as AttentionMetadata.seq_lens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64: 0 .. num_reqs


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int  # total query tokens this step
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, on device: context + query length
    slot_mapping: torch.Tensor  # [num_tokens] int64, on device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop or pad on the CPU side.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    one_row_each: OneRowEach | None = None  # set by the runner's persistent decode inputs (CPU)
    # KV cache groups past the first: their metadata (module note); empty with one group.
    group_metadata: list[AttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group` (this one for group 0, or with one group)."""
        return self.group_metadata[group - 1] if group and self.group_metadata else self

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def window_excludes(metadata: AttentionMetadata, window: int | None) -> bool:
    """Whether a sliding window of `window` positions hides any position of this step's contexts
    (never where every sequence fits in it: the whole-context attention is then the same)."""
    return window is not None and metadata.max_seq_len > window


class AttentionBackend(ABC):
    """One instance per engine; stateless across steps apart from caches it owns."""

    name: str = "abstract"

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """(available, reason if not)."""
        return True, ""

    def begin_step(self, metadata: AttentionMetadata) -> None:  # noqa: B027
        """Called once per step before the first layer (precompute per-step state)."""

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where this step's `forward` would, for every layer, write k/v with
        `servelab::write_kv_` at the slot mapping and attend with ONE `servelab::paged_attention`
        call over all its rows (each row one decoding request, in row order): that call's
        block table, query_start_loc and seq_lens, so the caller may make those calls itself
        (engine/kernels/planned_layers.py). None (the default): call `forward`."""
        return None

    @abstractmethod
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
        """Write k/v into kv_cache at metadata.slot_mapping, then attend.

        q, k and v may be strided views (the model passes slices of its fused QKV output);
        only the last dimension is guaranteed contiguous. The result may be a view too.
        `window`: each query attends to the last `window` positions only, its own included
        (None: the whole context). A backend that cannot raises NotImplementedError where the
        window would exclude a position (`window_excludes`), never attends past it silently.
        """
