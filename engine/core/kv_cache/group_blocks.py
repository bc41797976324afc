"""The blocks of one KV cache group past the first (engine/kv_cache_spec.py): per request, a block
table of its own, drawn from the pool the first group draws from.

A request's list is positional like the first group's (entry j holds positions j*block_size ..
(j+1)*block_size - 1) and always as long as the first group's. In a sliding-window group an entry
is None once its block falls wholly outside the window of the next query (vLLM's null block,
`remove_skipped`): the block goes back to the pool, its hash kept, so it sits in the LRU free
queue and a later request can still hit it until it is reused.

Hashes: the request's chained block hashes with the group's index appended, so a group only ever
hits its own blocks (the pool's one hash map serves every group). A prefix-cache hit of a sliding
group needs only the blocks of the last window before the hit's end (`longest_hit`).
"""

from __future__ import annotations

from engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache_spec import KVCacheGroupSpec
from engine.request import BlockHash, Request

# A block registered in the prefix cache and the key it got.
Registration = tuple[KVCacheBlock, BlockHash]
Entry = KVCacheBlock | None


class GroupBlocks:
    """One group's block tables (a group index >= 1), over the shared `BlockPool`."""

    def __init__(self, index: int, spec: KVCacheGroupSpec, pool: BlockPool, block_size: int) -> None:
        self.index = index
        self.spec = spec
        self.window = spec.sliding_window
        self.pool = pool
        self.block_size = block_size
        self._suffix = bytes((index,))
        self.req_to_blocks: dict[str, list[Entry]] = {}
        self._num_cached: dict[str, int] = {}  # leading entries already offered to the prefix cache
        self._num_skipped: dict[str, int] = {}  # leading entries already None
        self.num_used_blocks = 0  # distinct blocks held by requests in this group
        # Blocks needed before a hit's end: the window's positions before it (sliding groups).
        self._hit_run = -(-(self.window - 1) // block_size) if self.window is not None else 0

    # ---- identity --------------------------------------------------------------------------
    def key(self, block_hash: BlockHash) -> BlockHash:
        return block_hash + self._suffix

    def skipped(self, num_computed: int) -> int:
        """Leading blocks no query after `num_computed` computed tokens reads (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    # ---- prefix-cache hits -----------------------------------------------------------------
    def _cached(self, request: Request, i: int) -> KVCacheBlock | None:
        block = self.pool.get_cached_block(self.key(request.block_hashes[i]))
        bs = self.block_size
        if block is None or block.token_ids != tuple(request.all_token_ids[i * bs : (i + 1) * bs]):
            return None
        return block

    def longest_hit(self, request: Request, max_blocks: int) -> int:
        """The most leading blocks (at most `max_blocks`) a hit of this group covers: all of them
        cached for full attention; for a sliding window the ones of the last window before the
        hit's end (those before it need not exist)."""
        if self.window is None:
            for i in range(max_blocks):
                if self._cached(request, i) is None:
                    return i
            return max_blocks
        if self._hit_run == 0:
            return max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if self._cached(request, i) is None:
                run = 0
                continue
            run += 1
            if run == self._hit_run:
                return i + run
        return run  # blocks 0 .. run - 1: a window from the very start

    def hit_entries(self, request: Request, num_blocks: int) -> tuple[Entry, ...]:
        """The entries of a hit on `num_blocks` leading blocks (`longest_hit` found them)."""
        first = self.skipped(num_blocks * self.block_size)
        entries: list[Entry] = [None] * first
        for i in range(first, num_blocks):
            block = self._cached(request, i)
            assert block is not None, "hit_entries past longest_hit"
            entries.append(block)
        return tuple(entries)

    # ---- allocation --------------------------------------------------------------------------
    def num_new_blocks(self, request_id: str, num_required: int, num_computed: int, hit: tuple[Entry, ...]) -> int:
        """Blocks `allocate` would take from the pool."""
        blocks = self.req_to_blocks.get(request_id)
        held = len(blocks) if blocks is not None else len(hit)
        return max(0, num_required - max(held, self.skipped(num_computed)))

    def remove_skipped(self, request_id: str, num_computed: int) -> None:
        """Give back the blocks wholly outside the window of the next query (module note); oldest
        first, so the LRU evicts them first."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or self.window is None:
            return
        start, end = self._num_skipped[request_id], min(self.skipped(num_computed), len(blocks))
        if end <= start:
            return
        freed = [b for b in blocks[start:end] if b is not None]
        blocks[start:end] = [None] * (end - start)
        self._num_skipped[request_id] = end
        self.num_used_blocks -= self.pool.free_blocks(freed)

    def take_hit(self, request_id: str, hit: tuple[Entry, ...]) -> None:
        """On admission, the request's list starts with its hit (a reference taken on each block).
        Before any group takes new blocks: a free hit block must leave the free queue first."""
        if request_id in self.req_to_blocks:
            return
        self.req_to_blocks[request_id] = list(hit)
        held = [b for b in hit if b is not None]
        self.num_used_blocks += sum(1 for b in held if b.ref_cnt == 0)
        self.pool.touch(held)
        self._num_cached[request_id] = 0
        self._num_skipped[request_id] = next((i for i, b in enumerate(hit) if b is not None), len(hit))

    def allocate(self, request_id: str, num_required: int, num_computed: int) -> list[KVCacheBlock]:
        """New blocks up to `num_required` entries (after `take_hit`); the caller checked the pool
        has them (`num_new_blocks`). Returns the new blocks."""
        blocks = self.req_to_blocks[request_id]
        skip = self.skipped(num_computed)
        if len(blocks) < skip:
            blocks.extend([None] * (min(skip, num_required) - len(blocks)))
            self._num_skipped[request_id] = len(blocks)
        n = num_required - len(blocks)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        self.num_used_blocks += n
        blocks.extend(new)
        return new

    def cache_full_blocks(self, request: Request, num_tokens: int, registered: list[Registration] | None) -> None:
        """Offer the request's blocks that `num_tokens` fills to the prefix cache under this group's
        keys; each one taken is added to `registered` (None: written already)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return
        bs = self.block_size
        start = self._num_cached[rid]
        end = min(num_tokens // bs, len(request.block_hashes), len(blocks))
        if end <= start:
            return
        hashes, tokens, pool = request.block_hashes, request.all_token_ids, self.pool
        for i in range(start, end):
            block = blocks[i]
            if block is None:
                continue
            key = hashes[i] + self._suffix
            if pool.cache_block(block, key, tokens[i * bs : (i + 1) * bs]) and registered is not None:
                registered.append((block, key))
        self._num_cached[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first; those past its computed tokens that only it
        holds lose their hash (their KV was never written: see KVCacheManager.free)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._num_skipped.pop(request.request_id, None)
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block is not None and block.ref_cnt == 1:
                self.pool.evict_hash(block)
        self.num_used_blocks -= self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    # ---- views -----------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's table; a position given back reads block 0 (never attended: module note)."""
        return [b.block_id if b is not None else 0 for b in self.req_to_blocks.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not None)

    def holds_any(self, request_id: str, block_ids: set[int]) -> bool:
        return any(b is not None and b.block_id in block_ids for b in self.req_to_blocks.get(request_id, ()))
