"""KV cache groups: which layers share a block table, and what one request holds in each.

vLLM V1's hybrid allocator, as servelab builds it. Layers are grouped by attention type (full
attention, or a sliding window of `w` positions); every group draws its blocks from ONE shared
pool, keeps one block table per request, and allocates, frees, hashes and caches them by its own
rules (engine/core/kv_cache/). A sliding group lets go of the blocks that fall wholly outside the
window of the next query, so a long request holds about `w / block_size + 1` blocks there, not its
whole length.

Memory: every group holds the same number of layers (`group_size`), so a block id means the same
bytes in every group: the cache is `group_size` tensors of `[2, num_blocks, block_size, Hkv, D]`,
and tensor `j` is shared by the j-th layer of every group (vLLM's uniform page size). A block id
held by the full group is written by the full layers only, one held by a sliding group by that
group's layers only. With one attention type (SmolLM2, Llama, Qwen: every layer full) there is one
group of every layer and one tensor per layer, exactly the cache of before.

Grouping rule: the layers of each type in order, cut into groups of `group_size` = the layer count
of the rarest type (Gemma 3 270M: 3 full layers and 15 sliding ones give one full group and five
sliding groups of 3; a short last group leaves part of its tensors unused). The full group is
group 0: its blocks are the prefix the prefix cache matches first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One KV cache group: its layers, and its window (None: full attention)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else "sliding"

    def blocks_held_at_most(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds in this group at any step, with
        at most `max_chunk` tokens computed per step: every block of its length in a full group; in
        a sliding one, the blocks of the window before a chunk and of the chunk itself."""
        whole = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return whole
        return min(whole, -(-(self.sliding_window - 1 + max_chunk) // block_size) + 1)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer `i` attends to a window of `layer_windows[i]` positions
    (None: the whole context). One group of every layer when all layers are alike (module note)."""
    if not layer_windows:
        raise ValueError("kv_cache_groups: a model with no layers")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1:
        ((window, layers),) = by_window.items()
        return (KVCacheGroupSpec(tuple(layers), window),)
    size = min(len(layers) for layers in by_window.values())
    # full attention first (group 0), then the windows in increasing order
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(
        KVCacheGroupSpec(tuple(by_window[w][i : i + size]), w) for w in order for i in range(0, len(by_window[w]), size)
    )


def group_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layers per group: the number of KV cache tensors (module note)."""
    return max(len(g.layers) for g in groups)


def layer_placement(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[tuple[int, int]]:
    """Per layer (its group, the tensor it reads and writes)."""
    out: list[tuple[int, int] | None] = [None] * num_layers
    for g, spec in enumerate(groups):
        for j, layer in enumerate(spec.layers):
            out[layer] = (g, j)
    missing = [i for i, p in enumerate(out) if p is None]
    if missing:
        raise ValueError(f"KV cache groups leave layers {missing} without a cache")
    return [p for p in out if p is not None]


def blocks_held_at_most(groups: Sequence[KVCacheGroupSpec], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """The most blocks of the shared pool one request of `num_tokens` tokens holds, every group
    together (`KVCacheGroupSpec.blocks_held_at_most`)."""
    return sum(g.blocks_held_at_most(num_tokens, block_size, max_chunk) for g in groups)


def tokens_alone(groups: Sequence[KVCacheGroupSpec], num_blocks: int, block_size: int, max_chunk: int) -> int:
    """The longest request `num_blocks` blocks hold alone, every group together (the scheduler caps
    requests there so that preemption always ends). One full group: `num_blocks * block_size`."""
    if len(groups) == 1 and groups[0].sliding_window is None:
        return num_blocks * block_size
    lo, hi = 0, num_blocks * block_size  # need(lo) <= num_blocks; need grows with the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_held_at_most(groups, mid, block_size, max_chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
